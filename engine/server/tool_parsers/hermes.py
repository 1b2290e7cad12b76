"""Hermes 2 Pro / Qwen 2.5 format (vLLM's ``hermes``): each call is a JSON object inside
``<tool_call>`` ... ``</tool_call>``; text before the first call is content, text between and after
calls is dropped (as vLLM's parser does). A final block left unclosed still counts."""

from __future__ import annotations

from kvmesh.common.chat_prompt import HermesPrompt
from kvmesh.engine.server.tool_parsers.base import CallStream, StreamDelta, ToolParser, held_prefix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(HermesPrompt, ToolParser):
    name = "hermes"
    skip_special_tokens = False  # <tool_call> is an added token in Hermes and Qwen vocabularies

    def __init__(self, limit: int | None = None):
        super().__init__(limit)
        self._pending = ""  # text not read yet (a possible partial tag)
        self._in_call = False
        self._called = False  # a call began: later text outside calls is dropped

    def feed(self, delta: str) -> StreamDelta:
        self._pending += delta
        out = StreamDelta()
        while True:
            tag = END if self._in_call else START
            at = self._pending.find(tag)
            upto = at if at >= 0 else len(self._pending) - held_prefix(self._pending, tag)
            piece, self._pending = self._pending[:upto], self._pending[upto:]
            if self._in_call:
                out += StreamDelta(calls=self.streams[-1].feed(piece))
            elif not self._called:
                out += StreamDelta(piece)
            if at < 0:
                return out
            self._pending = self._pending[len(tag) :]
            self._in_call = not self._in_call
            if self._in_call:
                self._called = True
                self.streams.append(CallStream(self.num_calls, self.limit))

    def finish(self) -> StreamDelta:
        rest, self._pending = self._pending, ""
        if self._in_call:
            return StreamDelta(calls=self.streams[-1].feed(rest))
        return StreamDelta("" if self._called else rest)
