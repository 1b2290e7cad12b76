"""Tools and tool messages into the chat template: the engine's side of kvmesh/common/chat_prompt.py
(the contract the router renders with too, so its block keys are the engine's).

A template that reads ``tools`` gets them as a template variable, and earlier calls' ``arguments``
decoded; one that does not gets the tool format's default prompt and history written as text (the
server's ``--tool-call-parser`` format, Hermes without one). docs/tool-calling.md.
"""

from __future__ import annotations

from typing import Any

from kvmesh.common.chat_prompt import (
    ChatPromptError,
    template_reads_tools,
    template_variables,
    tool_template_inputs,
    tools_chars,
)
from kvmesh.common.chat_prompt import decoded_tool_calls as _decoded_tool_calls
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.tool_choice import ToolPlan
from kvmesh.engine.server.tool_parsers import TOOL_PARSERS, ToolParser

__all__ = [
    "chat_prompt_inputs",
    "decoded_tool_calls",
    "prompt_size",
    "template_inputs",
    "template_reads_tools",
]


def decoded_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` with each ``function.arguments`` (JSON text) decoded;
    InvalidParameter naming the part that is wrong (``messages.1.tool_calls.0.function.arguments``)."""
    try:
        return _decoded_tool_calls(tool_calls, where)
    except ChatPromptError as exc:
        raise InvalidParameter(exc.param, str(exc)) from None


def template_inputs(
    template: str | None,
    messages: list[dict[str, Any]],
    plan: ToolPlan | None,
    parser: type[ToolParser] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the request's tools (``parser``: the server's, whose
    format a template without tool support is told)."""
    if plan is None:
        return tool_template_inputs(template, messages, None, False, parser)
    return tool_template_inputs(template, messages, plan.tools, plan.mode != "none", parser)


def chat_prompt_inputs(
    template: str | None,
    messages: list[dict[str, Any]],
    plan: ToolPlan | None,
    tool_call_parser: str | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(messages, template variables) a chat request's prompt is rendered from, by the chat handler
    and /tokenize alike (``tool_call_parser``: the server's)."""
    parser = TOOL_PARSERS.get(tool_call_parser) if tool_call_parser else None
    messages, tool_vars = template_inputs(template, messages, plan, parser)
    return messages, template_variables(tool_vars, chat_template_kwargs)


def prompt_size(messages: list[dict[str, Any]], plan: ToolPlan | None) -> int:
    """About how long the rendered prompt is (characters): whether it is rendered off the event loop."""
    return sum(len(m["content"]) for m in messages) + (
        tools_chars(plan.tools) if plan is not None else 0
    )
