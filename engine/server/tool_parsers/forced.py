"""Outputs whose shape the request forced through a JSON schema (``tool_choice`` ``required`` or a
named function; :mod:`kvmesh.engine.server.tool_choice` builds the schemas), read as tool calls."""

from __future__ import annotations

from kvmesh.engine.server.tool_parsers.base import (
    CallStream,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)


class NamedFunctionParser(ToolParser):
    """The whole output is the named function's arguments (vLLM: content "", one call)."""

    finishes_with_tool_calls = False

    def __init__(self, function_name: str):
        super().__init__(1)
        self.function_name = function_name
        self.id = new_tool_call_id()
        self._text = ""
        self._named = False  # the call's id and name were sent

    def feed(self, delta: str) -> StreamDelta:
        self._text += delta
        if not self._named:
            self._named = True
            return StreamDelta(calls=[ToolCallDelta(0, delta, self.id, self.function_name)])
        return StreamDelta(calls=[ToolCallDelta(0, delta)] if delta else [])

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(self.id, self.function_name, self._text)]

    def parse(self, text: str) -> ParsedOutput:
        self.feed(text)
        return ParsedOutput("", self.tool_calls())


class RequiredCallsParser(ToolParser):
    """The output is a JSON array of ``{"name", "parameters"}`` objects (vLLM's schema for
    ``required``): content "", one call per item."""

    def __init__(self, limit: int | None = None):
        super().__init__(limit)
        self.streams = [CallStream(0, limit)]

    def feed(self, delta: str) -> StreamDelta:
        return StreamDelta(calls=self.streams[0].feed(delta))

    def parse(self, text: str) -> ParsedOutput:
        parsed = super().parse(text)
        return ParsedOutput("", parsed.tool_calls) if parsed.tool_calls else parsed
