"""Llama 3.1 / 3.2 JSON format (vLLM's ``llama3_json``): an output that starts with ``<|python_tag|>``
or ``{`` is tool calls, ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any other
output is content."""

from __future__ import annotations

from kvmesh.common.chat_prompt import Llama3JsonPrompt
from kvmesh.engine.server.tool_parsers.base import CallStream, StreamDelta, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(Llama3JsonPrompt, ToolParser):
    name = "llama3_json"

    def __init__(self, limit: int | None = None):
        super().__init__(limit)
        self._pending = ""
        self._mode: str | None = (
            None  # None until the output's first characters decide: "content" or "calls"
        )

    def feed(self, delta: str) -> StreamDelta:
        if self._mode is None:
            self._pending += delta
            head = self._pending.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return StreamDelta()  # undecided yet
            if head.startswith(PYTHON_TAG):
                self._mode, delta = "calls", head[len(PYTHON_TAG) :]
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
