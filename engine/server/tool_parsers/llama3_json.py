"""Llama 3.1 / 3.2 JSON format (vLLM's ``llama3_json``): an output that starts with ``<|python_tag|>``
or ``{`` is tool calls, ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any other
output is content."""

from __future__ import annotations

import json
from typing import Any

from kvmesh.engine.server.tool_parsers.base import CallStream, StreamDelta, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, limit: int | None = None):
        super().__init__(limit)
        self._pending = ""
        self._mode: str | None = None  # None until the output's first characters decide: "content" or "calls"

    def feed(self, delta: str) -> StreamDelta:
        if self._mode is None:
            self._pending += delta
            head = self._pending.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return StreamDelta()  # undecided yet
            if head.startswith(PYTHON_TAG):
                self._mode, delta = "calls", head[len(PYTHON_TAG):]
            elif head.startswith("{"):
                self._mode, delta = "calls", head
            else:
                self._mode, delta = "content", self._pending
            self._pending = ""
            if self._mode == "calls":
                self.streams.append(CallStream(0, self.limit))
        if self._mode == "content":
            return StreamDelta(delta)
        return StreamDelta(calls=self.streams[0].feed(delta))

    def finish(self) -> StreamDelta:
        rest, self._pending = self._pending, ""
        return StreamDelta(rest) if self._mode is None else StreamDelta()

    @classmethod
    def default_prompt(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its "
                "proper arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name '
                "and its value}. Do not use variables.\n\n" + listed)

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
