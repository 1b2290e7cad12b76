"""A chat request's prompt as the engine renders it, tools included: one contract for the engine
(its chat handler and /tokenize) and the router (its token ids and block keys), so a tool request
is routed to the replica that caches its tools prefix.

A template that reads ``tools`` (Hermes, Qwen 2.5, Llama 3.1, ...) gets them as a template variable
and the messages as the client sent them, with each earlier call's ``arguments`` decoded to an object
(as Hugging Face templates expect, and vLLM passes them).

A template that does not (SmolLM2's, for one) gets the documented default instead: the tools are
described in the system message by the tool format's prompt (Hermes' ``<tools>`` block and
``<tool_call>`` format without ``--tool-call-parser``), earlier calls are written into the assistant's
content in that format, and ``tool`` messages become user messages holding a ``<tool_response>``.

Torch-free, engine-free: the router imports it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from itertools import islice
from typing import Any


class ChatPromptError(ValueError):
    """A part of the request the prompt cannot be rendered from; ``param`` names it
    (``messages.1.tool_calls.0.function.arguments``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# -- the tool formats: how a template without tool support is told about tools ------------------


class ToolPrompt:
    """A tool-call format's prompt side (the engine's parsers read the other side)."""

    @classmethod
    def default_prompt(cls, tools: list[dict[str, Any]]) -> str:
        """The system prompt that describes ``tools`` to a model whose chat template does not."""
        raise NotImplementedError

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        """An earlier call, as this format writes it (for a template without tool support)."""
        raise NotImplementedError

    @classmethod
    def render_result(cls, content: str) -> str:
        """A tool's result, for a template without tool support (a user turn holds it)."""
        return f"<tool_response>\n{content}\n</tool_response>"


class HermesPrompt(ToolPrompt):
    @classmethod
    def default_prompt(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"


class Llama3JsonPrompt(ToolPrompt):
    @classmethod
    def default_prompt(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its "
            "proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name '
            "and its value}. Do not use variables.\n\n" + listed
        )

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


# the engine's --tool-call-parser names; no parser: Hermes
TOOL_PROMPTS: dict[str, type[ToolPrompt]] = {
    "hermes": HermesPrompt,
    "llama3_json": Llama3JsonPrompt,
}
DEFAULT_TOOL_PROMPT = HermesPrompt


def tool_call_parser_in(argv: list[str]) -> str | None:
    """The `--tool-call-parser` an engine command line names (the last one wins, as in argparse),
    for the router that must render tools as those engines do."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--tool-call-parser" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--tool-call-parser="):
            found = arg.split("=", 1)[1]
    return found if found in TOOL_PROMPTS else None


# -- the messages and the tools, into the template ------------------------------------------------


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
    ChatPromptError naming the part that is wrong (``messages.1.tool_calls.0.function.arguments``)."""
    if not isinstance(tool_calls, list):
        raise ChatPromptError(where, f"{where} must be a list of tool calls")
    calls = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.{j}"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ChatPromptError(
                f"{at}.function", f"{at}.function must be an object with a name and arguments"
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatPromptError(
                f"{at}.function.name", f"{at}.function.name must be a non-empty string"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ChatPromptError(
                    f"{at}.function.arguments", f"{at}.function.arguments is not valid JSON"
                ) from None
        elif not isinstance(arguments, dict):
            arguments = {}
        calls.append(
            {
                **call,
                "type": call.get("type", "function"),
                "function": {**function, "arguments": arguments},
            }
        )
    return calls


def tool_template_inputs(
    template: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    describe_tools: bool,
    fmt: type[ToolPrompt] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the request's ``tools`` (None or [] : none).
    ``describe_tools``: whether a template without tool support gets the tools' prompt (not for
    ``tool_choice: none``); ``fmt``: the format it is written in (the server's parser's)."""
    if template_reads_tools(template):
        return messages, ({"tools": tools} if tools else {})
    fmt = fmt or DEFAULT_TOOL_PROMPT
    rendered = [_flattened(m, fmt) for m in messages]
    if tools and describe_tools:
        prompt = fmt.default_prompt(tools)
        if rendered and rendered[0].get("role") == "system":
            rendered[0] = {
                **rendered[0],
                "content": f"{rendered[0]['content']}\n\n{prompt}".lstrip(),
            }
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, {}


def template_variables(
    tool_vars: dict[str, Any], chat_template_kwargs: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The template's extra variables: ``chat_template_kwargs`` may override ``tools``, as in vLLM."""
    return {**tool_vars, **(chat_template_kwargs or {})} or None


def _flattened(message: dict[str, Any], fmt: type[ToolPrompt]) -> dict[str, Any]:
    """One message with its tool parts written as text (for a template without tool support)."""
    if message.get("role") == "tool":
        return {"role": "user", "content": fmt.render_result(message.get("content") or "")}
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        text = "\n".join(
            fmt.render_call(c["function"]["name"], c["function"]["arguments"]) for c in calls
        )
        content = message.get("content") or ""
        flat = {k: v for k, v in message.items() if k != "tool_calls"}
        return {**flat, "content": f"{content}\n{text}" if content else text}
    return message


# -- a request body as JSON (the router): the same inputs the engine's validated request gives ----


def chat_request_prompt(
    req: dict[str, Any], template: str | None, fmt: type[ToolPrompt] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(messages, template variables) of a chat request body, exactly what the engine's chat handler
    hands its tokenizer's ``encode_chat`` (``fmt``: the engine's tool format, Hermes by default).
    ValueError (ChatPromptError naming the field, where one is to blame) for a body the engine refuses."""
    messages = chat_template_messages(req.get("messages"))
    tools = request_tools(req.get("tools"))
    kwargs = req.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ChatPromptError("chat_template_kwargs", "chat_template_kwargs must be an object")
    messages, tool_vars = tool_template_inputs(
        template, messages, tools, describes_tools(tools, req.get("tool_choice")), fmt
    )
    return messages, template_variables(tool_vars, kwargs)


_MESSAGE_FIELDS = (
    "role",
    "content",
    "tool_calls",
    "tool_call_id",
)  # the engine's ChatMessage, in order


def chat_template_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as the engine hands them to the chat template (its ChatMessage.as_template_dict):
    text content parts joined into one string, a missing or null content as "", an assistant's
    earlier calls with their arguments decoded. Raises ValueError for what the engine refuses (a
    message that is not an object, a part that is not text, a call that is not one)."""
    if not isinstance(messages, list):
        raise ChatPromptError("messages", "messages must be a list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatPromptError(f"messages.{i}", f"messages.{i} must be an object")
        # the engine's order: its model's fields, then the extra ones as sent (a template may list them)
        d = {k: msg[k] for k in _MESSAGE_FIELDS if msg.get(k) is not None}
        d.update((k, v) for k, v in msg.items() if v is not None and k not in d)
        if d.get("role") == "assistant" and d.get("tool_calls") is not None:
            d["tool_calls"] = decoded_tool_calls(d["tool_calls"], f"messages.{i}.tool_calls")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text", ""), str)
                ):
                    raise ChatPromptError(
                        f"messages.{i}.content",
                        f"messages.{i}: only text content parts are supported",
                    )
                texts.append(part.get("text", ""))
            content = "".join(texts)
        d["content"] = content or ""
        out.append(d)
    return out


_FUNCTION_FIELDS = (("description", str), ("parameters", dict), ("strict", bool))


def request_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A request's ``tools`` as the engine's request model hands them to the template (its
    ToolDefinition dumped without nulls: ``{"type": "function", "function": {name, description,
    parameters, strict}}``, unknown keys dropped), or None when absent. ChatPromptError for anything
    the engine would refuse or would coerce (it answers that request itself)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatPromptError("tools", "tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ChatPromptError(f"tools.{i}", "a tool must be an object of type function")
        function = tool.get("function")
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise ChatPromptError(
                f"tools.{i}.function.name", "a tool's function needs a non-empty name"
            )
        normal = {"name": function["name"]}
        for field, kind in _FUNCTION_FIELDS:
            value = function.get(field)
            if value is None:
                continue
            if not isinstance(value, kind):
                raise ChatPromptError(
                    f"tools.{i}.function.{field}", f"{field} must be a {kind.__name__}"
                )
            normal[field] = value
        out.append({"type": "function", "function": normal})
    return out


def tools_chars(tools: Any, cap: int = 1 << 15) -> int:
    """About how many characters ``tools`` add to a prompt (its strings, plus markup), read without
    serialising it and counted no further than ``cap``: enough to decide whether rendering it is
    work for a worker thread, in bounded time whatever the client sent."""
    if tools is None:
        return 0
    total, stack = 0, [tools]
    while stack and total < cap:
        value = stack.pop()
        total += 2  # quotes, brackets, separators: each item counts, so at most cap / 2 are read
        room = (cap - total) // 2 + 1
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            stack.extend(islice(value, room))  # the keys
            stack.extend(islice(value.values(), room))
        elif isinstance(value, list):
            stack.extend(value[:room])
        elif value is not None:
            total += 4  # a number or a boolean
    return min(total, cap)


def describes_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> bool:
    """Whether the tools' prompt goes into a template without tool support: there are tools and the
    request does not say ``tool_choice: none`` (no ``tool_choice`` with tools means auto)."""
    return bool(tools) and tool_choice != "none"
