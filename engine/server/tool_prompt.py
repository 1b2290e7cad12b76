"""Tools and tool messages into the chat template.

A template that reads ``tools`` (Hermes, Qwen 2.5, Llama 3.1, ...) gets them as a template variable
and the messages as the client sent them, with each earlier call's ``arguments`` decoded to an object
(as Hugging Face templates expect, and vLLM passes them).

A template that does not (SmolLM2's, for one) gets the documented default instead: the tools are
described in the system message by the tool parser's prompt (Hermes' ``<tools>`` block and
``<tool_call>`` format without ``--tool-call-parser``), earlier calls are written into the assistant's
content in that format, and ``tool`` messages become user messages holding a ``<tool_response>``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.tool_choice import ToolPlan
from kvmesh.engine.server.tool_parsers import ToolParser
from kvmesh.engine.server.tool_parsers.hermes import HermesToolParser


@lru_cache(maxsize=8)
def template_reads_tools(template: str | None) -> bool:
    if not template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def decoded_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` with each ``function.arguments`` (JSON text) decoded;
    InvalidParameter naming the part that is wrong (``messages.1.tool_calls.0.function.arguments``)."""
    if not isinstance(tool_calls, list):
        raise InvalidParameter(where, f"{where} must be a list of tool calls")
    calls = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.{j}"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidParameter(f"{at}.function", f"{at}.function must be an object with a name and arguments")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidParameter(f"{at}.function.name", f"{at}.function.name must be a non-empty string")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidParameter(f"{at}.function.arguments", f"{at}.function.arguments is not valid JSON") from None
        elif not isinstance(arguments, dict):
            arguments = {}
        calls.append({**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}})
    return calls


def template_inputs(template: str | None, messages: list[dict[str, Any]], plan: ToolPlan | None,
                    parser: type[ToolParser] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the request's tools."""
    if template_reads_tools(template):
        return messages, ({"tools": plan.tools} if plan is not None else {})
    fmt = parser or HermesToolParser
    rendered = [_flattened(m, fmt) for m in messages]
    if plan is not None and plan.mode != "none":
        prompt = fmt.default_prompt(plan.tools)
        if rendered and rendered[0].get("role") == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}".lstrip()}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, {}


def _flattened(message: dict[str, Any], fmt: type[ToolParser]) -> dict[str, Any]:
    """One message with its tool parts written as text (for a template without tool support)."""
    if message.get("role") == "tool":
        return {"role": "user", "content": fmt.render_result(message.get("content") or "")}
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        text = "\n".join(fmt.render_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
        content = message.get("content") or ""
        flat = {k: v for k, v in message.items() if k != "tool_calls"}
        return {**flat, "content": f"{content}\n{text}" if content else text}
    return message
