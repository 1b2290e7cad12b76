"""What a tool parser gives: an output read as content plus tool calls, whole or as stream deltas.

One parser object reads one choice's output. ``feed`` takes each new piece of text and returns what
can be sent now (content the markup cannot be part of, a call's id and name once, then its argument
deltas); ``finish`` flushes what was held back. ``parse`` reads a whole output the same way, so a
stream's deltas add up to the whole response; an output whose calls do not parse is content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvmesh.common.chat_prompt import ToolPrompt
from kvmesh.engine.server.tool_parsers.json_calls import JsonCallScanner


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its first piece carries the id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        d["function"] = function
        return d


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: StreamDelta) -> StreamDelta:
        return StreamDelta(self.content + other.content, merge_deltas(self.calls + other.calls))


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one (a chunk names each call once)."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index and d.id is None:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.arguments + d.arguments, last.id, last.name)
        else:
            merged.append(d)
    return merged


@dataclass
class _Sent:
    id: str
    arguments: int = 0  # characters of the arguments sent


class CallStream:
    """Calls read by a :class:`JsonCallScanner`, numbered from ``first_index``, sent in order (a call
    is sent once its name is known; its arguments as they grow). At most ``limit`` calls in all."""

    def __init__(self, first_index: int = 0, limit: int | None = None):
        self.scanner = JsonCallScanner()
        self.first_index = first_index
        self.limit = limit
        self._sent: list[_Sent] = []

    def feed(self, text: str) -> list[ToolCallDelta]:
        if text:
            self.scanner.feed(text)
        return self._drain()

    @property
    def sent_calls(self) -> int:
        return len(self._sent)

    def _drain(self) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for k, call in enumerate(self.scanner.calls):
            index = self.first_index + k
            if self.limit is not None and index >= self.limit:
                break
            if k == len(self._sent):
                if call.name is None:
                    break  # calls are sent in order: a later one waits for this one's name
                self._sent.append(_Sent(new_tool_call_id()))
                out.append(ToolCallDelta(index, id=self._sent[k].id, name=call.name))
            sent = self._sent[k]
            args = self.scanner.arguments(call)
            if len(args) > sent.arguments:
                out.append(ToolCallDelta(index, args[sent.arguments :]))
                sent.arguments = len(args)
        return merge_deltas(out)

    @property
    def valid(self) -> bool:
        """Every call read is complete and named, nothing left open."""
        s = self.scanner
        return s.error is None and not s.open and all(c.complete and c.name for c in s.calls)

    def tool_calls(self) -> list[ToolCall]:
        self._drain()
        return [
            ToolCall(sent.id, call.name, self.scanner.arguments(call))
            for sent, call in zip(self._sent, self.scanner.calls)
        ]


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag`` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolParser(ToolPrompt):
    """Reads one output. Subclasses implement ``feed`` and ``finish`` over ``self.streams``; the format's
    prompt side (how a template without tool support is told about tools) is kvmesh.common.chat_prompt's."""

    name = ""
    # None: the request's skip_special_tokens stands; False: the call markup is special tokens
    # that must reach the text (Hermes: <tool_call>, as vLLM's parser asks)
    skip_special_tokens: bool | None = None
    finishes_with_tool_calls = (
        True  # finish_reason "tool_calls" once it read a call (not a named function)
    )

    def __init__(self, limit: int | None = None):
        self.limit = limit  # at most this many calls (parallel_tool_calls false: 1)
        self.streams: list[CallStream] = []

    def feed(self, delta: str) -> StreamDelta:
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        return StreamDelta()

    @property
    def num_calls(self) -> int:
        return sum(s.sent_calls for s in self.streams)

    def tool_calls(self) -> list[ToolCall]:
        return [call for s in self.streams for call in s.tool_calls()]

    def parse(self, text: str) -> ParsedOutput:
        whole = self.feed(text) + self.finish()
        calls = self.tool_calls()
        if not calls or not all(s.valid for s in self.streams):
            return ParsedOutput(text, [])
        return ParsedOutput(whole.content or None, calls)
