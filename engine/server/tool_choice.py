"""``tools`` and ``tool_choice`` of a chat request, as vLLM reads them: which mode a request asks
for, the JSON schema that forces ``required`` and a named function, and the parser that reads the
output.

- no ``tool_choice``: ``auto`` when there are tools, else none;
- ``none``: the tools still reach the chat template, the output is plain content;
- ``auto``: the model decides; the server's ``--tool-call-parser`` reads its calls (and a server
  started without ``--enable-auto-tool-choice`` answers 400, vLLM's message);
- ``required``: an array of ``{"name", "parameters"}`` objects, one of the tools each (vLLM's schema;
  ``parallel_tool_calls: false`` makes it one item at most);
- ``{"type": "function", "function": {"name": ...}}``: that function's parameters schema.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.tool_parsers import TOOL_PARSERS, ToolParser
from kvmesh.engine.server.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser

NO_ARGUMENTS = {"type": "object", "properties": {}}
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[
        dict[str, Any]
    ]  # as the chat template gets them: {"type": "function", "function": {...}}
    function_name: str | None = None
    parallel: bool = True

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow (required, named), else None."""
        if self.mode == "named":
            return self.functions[self.function_name].get("parameters") or NO_ARGUMENTS
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        items = []
        for tool in self.tools:
            function = tool["function"]
            params = copy.deepcopy(function.get("parameters")) or NO_ARGUMENTS
            for name, schema in params.pop("$defs", {}).items():  # one $defs for the whole array
                if defs.setdefault(name, schema) != schema:
                    raise InvalidParameter(
                        "tools", f"tools define $defs {name!r} twice, with different schemas"
                    )
            items.append(
                {
                    "properties": {
                        "name": {"type": "string", "enum": [function["name"]]},
                        "parameters": params,
                    },
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": items},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def parser(self, auto_parser: type[ToolParser] | None) -> ToolParser | None:
        """A new reader of one choice's output (None: the output is content)."""
        limit = None if self.parallel else 1
        if self.mode == "named":
            return NamedFunctionParser(self.function_name)
        if self.mode == "required":
            return RequiredCallsParser(limit)
        if self.mode == "auto" and auto_parser is not None:
            return auto_parser(limit)
        return None


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None
) -> ToolPlan | None:
    """The request's tool mode (None: no tools at all), or InvalidParameter naming the field."""
    tools = tools or []
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolPlan("none", tools) if tools else None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise InvalidParameter(
                "tool_choice",
                f"Invalid value for `tool_choice`: {tool_choice[:40]!r}! Only "
                'named tools, "none", "auto" or "required" are supported.',
            )
        if not tools:
            if tool_choice == "required":  # OpenAI's: required with no tools is none
                return None
            raise InvalidParameter("tool_choice", "When using `tool_choice`, `tools` must be set.")
        return ToolPlan(tool_choice, tools, parallel=parallel is not False)
    if not isinstance(tool_choice, dict):
        raise InvalidParameter(
            "tool_choice",
            f'tool_choice must be "none", "auto", "required" or a named function. {NAMED_USAGE}',
        )
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise InvalidParameter(
            "tool_choice.function", f"Invalid value for `function` in `tool_choice`! {NAMED_USAGE}"
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidParameter(
            "tool_choice.function.name",
            f"Expected a function name in `tool_choice.function.name`! {NAMED_USAGE}",
        )
    if tool_choice.get("type", "function") != "function":
        raise InvalidParameter("tool_choice.type", 'tool_choice.type must be "function"')
    if not tools:
        raise InvalidParameter("tool_choice", "When using `tool_choice`, `tools` must be set.")
    plan = ToolPlan("named", tools, name, parallel is not False)
    if name not in plan.functions:
        raise InvalidParameter(
            "tool_choice.function.name",
            f"tool_choice names the function {name[:64]!r}, which is not among `tools`",
        )
    return plan


def auto_parser(
    plan: ToolPlan | None, enable_auto_tool_choice: bool, tool_call_parser: str | None
) -> type[ToolParser] | None:
    """The parser class ``auto`` reads calls with (the server's); the 400 vLLM answers without one."""
    if plan is None or plan.mode != "auto":
        return None
    if not enable_auto_tool_choice or tool_call_parser is None:
        raise InvalidParameter("tool_choice", AUTO_NEEDS_FLAGS)
    return TOOL_PARSERS[tool_call_parser]
