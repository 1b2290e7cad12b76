"""The engine's request models: the shared models' fields (kvmesh.common.protocol) with what the engine reads from them.

Responses are plain dicts built in ``api.py``; their shapes follow OpenAI's API reference.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ValidationError

from kvmesh.common import protocol as fields
from kvmesh.common.cache_salt import InvalidCacheSalt, check_cache_salt
from kvmesh.common.prompts import prompt_batch
from kvmesh.common.request_limits import MAX_PROMPTS
from kvmesh.engine.model_limits import RESUME_PARAM
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams
from kvmesh.engine.server.tool_choice import ToolPlan, plan_tools
from kvmesh.engine.server.tool_prompt import decoded_tool_calls
from kvmesh.engine.structured.params import StructuredOutputsParams
from kvmesh.engine.structured.request_fields import GUIDED_FIELDS, structured_outputs_of


class _Generation:
    """The engine's reading of a generation request (completions and chat share it)."""

    def check_supported(self) -> None:
        """Fields this server does not implement, when they ask for something."""
        self.check_tool_fields()
        if self.functions:
            raise InvalidParameter("functions", "functions (function calling) are not supported")
        if self.function_call not in (None, "none"):
            raise InvalidParameter(
                "function_call", "function_call requires functions, which are not supported"
            )

    def check_tool_fields(self) -> None:
        """Tools are a chat feature (ChatCompletionRequest reads them): a completion refuses them."""
        if self.tools:
            raise InvalidParameter("tools", "tools (function calling) are for /v1/chat/completions")
        if self.tool_choice not in (None, "none"):
            raise InvalidParameter(
                "tool_choice", "tool_choice is for /v1/chat/completions, with tools"
            )

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: Mapping[str, Any],
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """``defaults``: the model's generation-config values for what the request leaves out."""
        self.check_supported()
        try:
            check_cache_salt(self.cache_salt)
        except InvalidCacheSalt as exc:
            raise InvalidParameter(exc.param, str(exc)) from None

        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise InvalidParameter(
                    "logit_bias", "logit_bias keys must be token ids (integers)"
                ) from None

        def pick(value, name: str, openai_default):
            return value if value is not None else defaults.get(name, openai_default)

        return SamplingParams(
            n=self.n,  # validated with the seed: the n samples are seeded seed .. seed + n - 1
            max_tokens=pick(max_tokens, "max_tokens", None),
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            presence_penalty=pick(self.presence_penalty, "presence_penalty", 0.0),
            frequency_penalty=pick(self.frequency_penalty, "frequency_penalty", 0.0),
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            logit_bias=logit_bias,
            prompt_logprobs=prompt_logprobs
            if prompt_logprobs is not None
            else self.prompt_logprobs,
            seed=self.seed,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs_of(
                self.response_format,
                self.structured_outputs,
                {name: getattr(self, name) for name in GUIDED_FIELDS},
            ),
        )

    def request_param(self, param: str) -> str:
        """The request field that carries an engine parameter (chat names some differently)."""
        return param

    def resume_token_ids(self) -> list[int] | None:
        """A one-choice continuation's already-generated ids (``resume.output_token_ids``), or None."""
        if self.resume is None or (isinstance(self.resume, dict) and "choices" in self.resume):
            return None
        ids = self.resume.get("output_token_ids") if isinstance(self.resume, dict) else None
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise InvalidParameter(
                RESUME_PARAM,
                f"{RESUME_PARAM} must be a non-empty list of token ids "
                '(resume: {"output_token_ids": [...]})',
            )
        if self.n != 1:
            raise InvalidParameter(
                "n",
                "a continuation (resume) continues one choice: n must be 1; "
                "several go on with resume.choices",
            )
        return ids

    def resume_choices(self, num_choices: int) -> dict[int, list[int]] | None:
        """A continuation of several choices (``resume.choices``): choice index -> its ids so far
        (possibly none yet), for the choices still running, in the order listed; None when the
        request is not one."""
        if not isinstance(self.resume, dict) or "choices" not in self.resume:
            return None
        if "output_token_ids" in self.resume:
            raise InvalidParameter(
                "resume", "resume holds either output_token_ids (one choice) or choices"
            )
        listed = self.resume["choices"]
        if not isinstance(listed, list) or not listed:
            raise InvalidParameter(
                "resume.choices",
                "resume.choices must be a non-empty list of "
                '{"index": i, "output_token_ids": [...]}',
            )
        plan: dict[int, list[int]] = {}
        for k, item in enumerate(listed):
            where = f"resume.choices.{k}"
            if not isinstance(item, dict):
                raise InvalidParameter(
                    where, f'{where} must be an object {{"index": i, "output_token_ids": [...]}}'
                )
            index = item.get("index")
            if type(index) is not int or not 0 <= index < num_choices:
                raise InvalidParameter(
                    f"{where}.index",
                    f"{where}.index must be a choice index, 0 to {num_choices - 1} (prompts x n)",
                )
            if index in plan:
                raise InvalidParameter(
                    f"{where}.index", f"{where}.index: choice {index} is listed twice"
                )
            ids = item.get("output_token_ids")
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise InvalidParameter(
                    f"{where}.output_token_ids",
                    f"{where}.output_token_ids must be a list of token ids",
                )
            plan[index] = ids
        return plan

    def renamed(self, exc: InvalidParameter) -> InvalidParameter:
        """``exc`` naming the field as this request sent it."""
        param = self.request_param(exc.param)
        if param == exc.param:
            return exc
        return InvalidParameter(param, str(exc).replace(exc.param, param, 1))

    def num_choices(self) -> int:
        """``n`` (bounded by the model): choices per prompt, each its own engine request (they
        share the prompt's full KV blocks through the prefix cache, even when admitted in the same step)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_Generation, fields.CompletionRequest):
    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts: one text or token-id list, or a batch of them (OpenAI's prompt array)."""
        batch = prompt_batch(self.prompt)
        if len(batch) > MAX_PROMPTS:
            raise InvalidParameter(
                "prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}"
            )
        for one in batch:
            if isinstance(one, list) and not one:
                raise InvalidParameter(
                    "prompt", "prompt is empty: it must contain at least one token"
                )
        return batch

    def sampling_params(self, defaults: Mapping[str, Any] = {}) -> SamplingParams:  # noqa: B006 - read only
        if self.suffix:
            raise InvalidParameter("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise InvalidParameter("best_of", "best_of must be 1")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidParameter("max_tokens", "max_tokens must be at least 1 (0 only with echo)")
        # echo with logprobs scores the prompt too (how evaluation harnesses get loglikelihoods)
        echo_lps = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.requested_max_tokens(), self.logprobs, defaults, echo_lps)

    def requested_max_tokens(self) -> int | None:
        # echo with max_tokens 0 returns the prompt alone: one token is generated and dropped
        return 1 if self.echo_only else self.max_tokens

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0


def template_message(message: fields.ChatMessage, index: int | None = None) -> dict[str, Any]:
    """A message for the chat template; ``index``: its place in ``messages`` (errors name
    the part, e.g. ``messages.0.content.1.type``)."""
    d = message.model_dump(exclude_none=True)
    if (
        message.role == "assistant" and d.get("tool_calls") is not None
    ):  # earlier calls, arguments decoded
        d["tool_calls"] = decoded_tool_calls(
            d["tool_calls"], "messages" if index is None else f"messages.{index}.tool_calls"
        )
    content = message.content
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for j, part in enumerate(content):
            where = "messages" if index is None else f"messages.{index}.content.{j}"
            if part.get("type") != "text":
                raise InvalidParameter(
                    where if index is None else f"{where}.type",
                    f"unsupported content part type {str(part.get('type'))[:40]!r}: "
                    "only 'text' parts are supported",
                )
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidParameter(
                    where if index is None else f"{where}.text",
                    "a text content part's text must be a string",
                )
            texts.append(text)
        content = "".join(texts)
    d["content"] = content or ""
    return d


def tool_plan_of(
    tools: list[fields.ToolDefinition] | None, tool_choice: Any, parallel: bool | None
) -> ToolPlan | None:
    """A request's tools planned (the tools as the template gets them: their definitions without nulls)."""
    listed = [t.model_dump(exclude_none=True) for t in tools] if tools is not None else None
    return plan_tools(listed, tool_choice, parallel)


class ChatCompletionRequest(_Generation, fields.ChatCompletionRequest):
    def template_messages(self) -> list[dict[str, Any]]:
        return [template_message(m, i) for i, m in enumerate(self.messages)]

    def check_tool_fields(self) -> None:
        self.tool_plan()

    def tool_plan(self) -> ToolPlan | None:
        """What the request asks of tools (engine/server/tool_choice.py); None: no tools."""
        return tool_plan_of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _with_tool_schema(self, params: SamplingParams) -> SamplingParams:
        """``required`` and a named function: the output constrained to the tools' JSON schema."""
        plan = self.tool_plan()
        schema = plan.schema() if plan is not None else None
        if schema is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidParameter(
                "tool_choice",
                f"tool_choice {plan.mode!r} constrains the output to the tools' "
                "schemas: it cannot be combined with a structured output",
            )
        return replace(
            params, structured_outputs=StructuredOutputsParams(json=schema, field_name="tools")
        )

    def sampling_params(self, defaults: Mapping[str, Any] = {}) -> SamplingParams:  # noqa: B006 - read only
        if self.echo:
            raise InvalidParameter("echo", "echo is not supported for chat completions")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        n_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._with_tool_schema(
            self._sampling_params(self.requested_max_tokens(), n_logprobs, defaults)
        )

    def request_param(self, param: str) -> str:
        if param == "prompt":
            return "messages"
        if param == "logprobs":
            return "top_logprobs"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


# A lone surrogate can only come from a \\uD800-\\uDFFF escape or from UTF-8-encoded surrogate bytes
# (json.loads decodes bytes with surrogatepass): a body with neither is not walked. Two searches,
# each led by a literal byte that re skips to quickly: one alternation scans a 4 MB body 30x slower.
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_UTF8_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def invalid_text_field(body: bytes, data: Any) -> str | None:
    """The dotted path (``messages.0.content``) of the first string of ``data`` that is not valid
    Unicode (a lone surrogate, which cannot be encoded, tokenised or sent back), or None."""
    if not (_ESCAPED_SURROGATE.search(body) or _UTF8_SURROGATE.search(body)):
        return None

    def bad(text: str) -> bool:
        try:
            text.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True

    stack: list[tuple[Any, list[str]]] = [
        (data, [])
    ]  # depth-first, in document order; no recursion
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if bad(value):
                return ".".join(path) or "body"
        elif isinstance(value, dict):
            for key in value:
                if bad(key):
                    return ".".join(path + [key.encode("utf-8", "backslashreplace").decode()])
            stack.extend((item, path + [key]) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(
                (item, path + [str(i)])
                for i, item in reversed(list(enumerate(value)))
                if isinstance(item, (str, dict, list))
            )
    return None


# pydantic's error types for a value of the right type outside a field's bounds
_BOUND_ERRORS = {
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "string_too_short",
    "string_too_long",
    "too_short",
    "too_long",
}

# an item that should have been an object (messages: ["hi"]) keeps its index: messages.0
_OBJECT_ERRORS = {"model_type", "model_attributes_type", "dict_type"}


def first_error_param(exc: ValidationError, model_cls: type[BaseModel]) -> tuple[str, str]:
    """(param, message) of a pydantic error, param in OpenAI's dotted style (messages.0.role).

    A value outside its bounds names the request field that holds it (``logit_bias``, not
    ``logit_bias.5``), as the sampling parameters' own checks do; a value of the wrong type keeps
    its path into objects and maps (``logit_bias.5``, ``messages.0.role``), not into a list of values
    (``stop``, not ``stop.0``)."""
    # the deepest error: of a union's branches, the one that got furthest (stop: ["a", ""] is a list
    # with an empty string, not "not a string")
    err = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
    # pydantic puts union members' tags into loc ("str", "list[int]", "constrained-str"): drop them
    parts = [x for x in err.get("loc", ()) if not _is_union_tag(x)]
    if (
        len(parts) > 1
        and all(isinstance(x, int) for x in parts[1:])
        and err.get("type") not in _OBJECT_ERRORS
    ):
        parts = parts[:1]  # an item of a list of values (stop: [1]) names the list
    loc = [str(x) for x in parts]
    if "[key]" in loc:  # a bad dict key (logit_bias.abc.[key]): name the dict, not the client's key
        loc = loc[: max(loc.index("[key]") - 1, 0)]
    # a field of a nested object (tools.0.function.name) keeps its path: it is no bound of the request's
    if err.get("type") in _BOUND_ERRORS and 0 < len(loc) <= 2:
        name = loc[0]
        lo, hi = fields.field_bounds(model_cls, name)
        if lo is not None and hi is not None:
            return name, f"{name} must be between {lo} and {hi}, got {err.get('input')}"
        loc = [name]
    param = ".".join(loc) or "body"
    return param, f"{param}: {err.get('msg', 'invalid value')}"


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part.startswith(("function-", "union["))
        or part in ("str", "int", "list[int]", "list[str]", "list[list[int]]")
        or "constrained-" in part
    )


class TokenizeRequest(fields.TokenizeRequest):
    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParameter("prompt", "send exactly one of prompt and messages")

    def tool_plan(self) -> ToolPlan | None:
        """The tools as the chat handler plans them (InvalidParameter naming the field); the server's
        ``--enable-auto-tool-choice`` is the chat handler's to check, not the tokenizer's."""
        return tool_plan_of(self.tools, self.tool_choice, None)


class DetokenizeRequest(fields.DetokenizeRequest):
    pass
