"""An incremental reader of tool calls written as JSON objects, ``{"name": ..., "arguments": {...}}``
(or ``"parameters"``), alone, one after another (``;``- or ``,``-separated), or in one array.

It reads the text one character at a time and records, per call, its name once the name's string
is complete and where its arguments start and end in the text. The arguments are streamed as the
model wrote them, so the concatenated argument deltas of a stream equal the whole response's
``arguments`` byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ARGUMENT_KEYS = (
    "arguments",
    "parameters",
)  # Hermes and OpenAI say arguments; Llama 3 says parameters
_SPACE = " \t\r\n"


@dataclass
class ScannedCall:
    name: str | None = None
    args_start: int | None = None  # offset of the arguments value's first character
    args_end: int | None = None  # offset just past it, once the value is complete
    args_kind: str = (
        ""  # "{" or "[": streamed raw; '"': a JSON string holding the arguments; "scalar"
    )
    complete: bool = False  # the call's object closed


@dataclass
class _Frame:
    kind: str  # "{" or "["
    expect_key: bool = False  # in an object: the next string is a key
    key: str | None = None  # in a call object: the key whose value is being read


@dataclass
class _Value:
    """The value being read directly inside a call object."""

    key: str | None
    start: int
    kind: str  # "{", "[", '"' or "scalar"


@dataclass
class JsonCallScanner:
    text: str = ""
    calls: list[ScannedCall] = field(default_factory=list)
    error: str | None = None  # why the text is not a call (reading stops)
    _stack: list[_Frame] = field(default_factory=list)
    _call_depth: int = 1  # stack depth inside a call object: 1 for a bare object, 2 inside an array
    _in_string: bool = False
    _escape: bool = False
    _string_start: int = 0
    _value: _Value | None = None

    def feed(self, chunk: str) -> None:
        start = len(self.text)
        self.text += chunk
        text = self.text
        for i in range(start, len(text)):
            if self.error is not None:
                return
            self._step(i, text[i])

    @property
    def open(self) -> bool:
        """Inside a value (an unfinished call or array)."""
        return bool(self._stack) or self._in_string

    # -- one character --------------------------------------------------------------------
    def _step(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                self._string_closed(i)
            return
        if c in _SPACE:
            return
        if not self._stack:
            self._top_level(i, c)
            return
        frame = self._stack[-1]
        if c == '"':
            self._in_string, self._string_start = True, i
            if not (frame.kind == "{" and frame.expect_key):
                self._value_begins(i, c)
        elif c in "{[":
            if frame.kind == "{" and frame.expect_key:
                self._fail(f"expected a key, got {c!r}")
                return
            self._value_begins(i, c)
            self._stack.append(_Frame(c, expect_key=c == "{"))
            if len(self._stack) == self._call_depth:
                self.calls.append(ScannedCall())
                self._value = None
        elif c in "}]":
            if (c == "}") != (frame.kind == "{"):
                self._fail(f"unbalanced {c!r}")
                return
            self._scalar_ends(i)
            self._stack.pop()
            self._container_closed(i)
        elif c == ":":
            if frame.kind != "{" or not frame.expect_key:
                self._fail("unexpected ':'")
                return
            frame.expect_key = False
        elif c == ",":
            self._scalar_ends(i)
            if frame.kind == "{":
                frame.expect_key = True
        else:  # a number, true, false or null
            if frame.kind == "{" and frame.expect_key:
                self._fail(f"expected a key, got {c!r}")
                return
            self._value_begins(i, "scalar")

    def _top_level(self, i: int, c: str) -> None:
        if c == "{":
            self._call_depth = 1
            self._stack.append(_Frame("{", expect_key=True))
            self.calls.append(ScannedCall())
            self._value = None
        elif c == "[":
            self._call_depth = 2
            self._stack.append(_Frame("["))
        elif c not in ";,":  # separators between calls written one after another
            self._fail(f"expected a tool call object, got {c!r}")

    def _fail(self, why: str) -> None:
        self.error = why

    # -- values directly inside a call object ---------------------------------------------
    def _in_call(self) -> bool:
        return len(self._stack) == self._call_depth and self._stack[-1].kind == "{"

    def _value_begins(self, i: int, kind: str) -> None:
        depth = len(self._stack)
        if depth == self._call_depth - 1 and kind != "{":  # an item of the calls' array
            self._fail("an array of tool calls holds objects only")
            return
        if not self._in_call() or self._value is not None:
            return
        key = self._stack[-1].key
        self._value = _Value(key, i, kind)
        call = self.calls[-1]
        if key in ARGUMENT_KEYS and call.args_start is None:
            call.args_start, call.args_kind = i, kind

    def _value_ends(self, end: int) -> None:
        value, self._value = self._value, None
        call = self.calls[-1]
        if value.key == "name":
            try:
                name = json.loads(self.text[value.start : end])
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self._fail("a tool call's name must be a non-empty string")
                return
            call.name = name
        elif call.args_start == value.start:
            call.args_end = end

    def _string_closed(self, i: int) -> None:
        if not self._stack:
            return
        frame = self._stack[-1]
        if frame.kind == "{" and frame.expect_key:  # a key
            if len(self._stack) == self._call_depth:
                frame.key = json.loads(self.text[self._string_start : i + 1])
            return
        if self._in_call() and self._value is not None and self._value.kind == '"':
            self._value_ends(i + 1)

    def _scalar_ends(self, i: int) -> None:
        if self._in_call() and self._value is not None and self._value.kind == "scalar":
            self._value_ends(len(self.text[:i].rstrip(_SPACE)))

    def _container_closed(self, i: int) -> None:
        depth = len(self._stack)
        if depth == self._call_depth and self._value is not None:  # a call's object or array value
            self._value_ends(i + 1)
        elif depth == self._call_depth - 1:  # the call's own object
            self.calls[-1].complete = True
            self._value = None

    # -- what a call's arguments read so far ------------------------------------------------
    def arguments(self, call: ScannedCall) -> str:
        """The call's arguments as far as they can be sent: an object's text as it grows; a string
        or scalar value once complete; ``{}`` for a complete call without arguments."""
        if call.args_start is None:
            return "{}" if call.complete else ""
        if call.args_kind in "{[":
            return self.text[
                call.args_start : call.args_end if call.args_end is not None else len(self.text)
            ]
        if call.args_end is None:
            return ""
        raw = self.text[call.args_start : call.args_end]
        try:
            value = json.loads(raw)
        except ValueError:  # a malformed scalar: as written (the whole-output check refuses it)
            return raw
        if isinstance(value, str):  # arguments the model wrote as a JSON string
            return value
        return "{}" if value is None else raw
