"""Tool-call parsers (vLLM's ``--tool-call-parser``): each reads a model's output as content plus tool
calls, whole or streamed. ``TOOL_PARSERS`` names the formats ``tool_choice: "auto"`` can read;
``forced`` reads the outputs that ``required`` and a named function constrain."""

from __future__ import annotations

from kvmesh.engine.server.tool_parsers.base import (
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from kvmesh.engine.server.tool_parsers.hermes import HermesToolParser
from kvmesh.engine.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedOutput", "StreamDelta", "ToolCall", "ToolCallDelta", "ToolParser"]
