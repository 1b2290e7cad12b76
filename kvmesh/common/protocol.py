"""The request models of the OpenAI surface (plus vLLM's extensions): the one source of its fields, types and bounds.

Torch-free: the engine server subclasses them with its behaviour (kvmesh.engine.server.protocol),
the OpenAPI document derives its request schemas from them (kvmesh.common.openapi) and the router's
admission checks read their bounds (router/request_checks.py). Unknown fields are ignored, as
OpenAI-compatible servers do. A field the models type loosely (``Any``: checked by the engine's
code) carries the schema of what that code accepts (``WithJsonSchema``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    field_validator,
)

from kvmesh.common.cache_salt import MAX_CACHE_SALT_CHARS
from kvmesh.common.request_limits import (
    INT64_MAX,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    SEED_MAX,
    SEED_MIN,
)


def field_bounds(model: type[BaseModel], name: str) -> tuple[Any, Any]:
    """(lowest, highest) a request model allows for its field ``name`` by its own ge/le, each
    None where it sets none: the router's checks and the engine's error messages both read it."""
    field = model.model_fields.get(name)
    meta = field.metadata if field is not None else ()
    lo = next((m.ge for m in meta if isinstance(m, Ge)), None)
    return lo, next((m.le for m in meta if isinstance(m, Le)), None)


# Bounds that need the served model: kvmesh.common.openapi fills them in from its vocabulary size.
VOCAB_KEY = "x-vocab"
TokenId = Annotated[int, Field(ge=0, json_schema_extra={VOCAB_KEY: "id"})]  # below vocab_size
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]


def _schema(schema: dict[str, Any], nullable: bool = True) -> Any:
    """The JSON schema of an ``Any`` field (or null)."""
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}]} if nullable else schema)


def _obj(required: list[str], props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


_JSON_SCHEMA = {"type": "object", "description": "a JSON schema"}
_CHOICES = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}
_EBNF = {"type": "string", "minLength": 1, "description": "an EBNF grammar (GBNF: root ::= ...)"}
_RESPONSE_FORMAT = {
    "anyOf": [
        _obj(["type"], {"type": {"enum": ["text", "json_object"]}}),
        _obj(
            ["type", "json_schema"],
            {
                "type": {"const": "json_schema"},
                "json_schema": _obj(
                    ["schema"],
                    {
                        "name": {"type": "string"},
                        "schema": _JSON_SCHEMA,
                        "strict": {"type": ["boolean", "null"]},
                    },
                ),
            },
        ),
    ]
}
_STRUCTURED_OUTPUTS = {
    "type": "object",
    "minProperties": 1,
    "maxProperties": 1,
    "additionalProperties": False,
    "properties": {
        "json": {"anyOf": [_JSON_SCHEMA, {"type": "string"}]},
        "regex": {"type": "string", "minLength": 1},
        "choice": _CHOICES,
        "grammar": _EBNF,
        "json_object": {"const": True},
    },
    "description": "vLLM's: exactly one of json, regex, choice, grammar, json_object",
}
_TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required", None]},
        _obj(
            ["function"],
            {
                "type": {"const": "function"},
                "function": _obj(["name"], {"name": {"type": "string"}}),
            },
        ),
    ],
    "description": "default: auto with tools (needs --enable-auto-tool-choice), else none; a named "
    "function must be one of tools",
}
_OFF = {"enum": ["none", None], "description": "not supported: only its off value"}
_NONE_LISTED = {"type": "array", "maxItems": 0}
_RESUME = {
    **_obj(
        ["output_token_ids"],
        {
            "output_token_ids": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, VOCAB_KEY: "id"},
                "minItems": 1,
            }
        },
    ),
    "description": "internal router -> engine extension (docs/engine-server.md): continue this request "
    "after the ids its client already got; n 1",
}
_CONTENT_PART = _obj(["type"], {"type": {"const": "text"}, "text": {"type": "string"}})
_TOOL_CALLS = {
    "type": "array",
    "items": _obj(
        ["function"],
        {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": _obj(
                ["name"],
                {
                    "name": {"type": "string", "minLength": 1},
                    "arguments": {"type": "string", "description": "JSON text"},
                },
            ),
        },
    ),
    "description": "an assistant's earlier calls (their arguments must be JSON)",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(BaseModel):
    """The fields of both generation requests (completions and chat)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(
        None, description="the served model name or a loaded LoRA adapter's (another one is a 404)"
    )
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(
        1,
        ge=1,
        le=MAX_N,
        description="choices per prompt; prompts x n must fit the requests the "
        "server admits at once",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: int | None = Field(
        None,
        ge=SEED_MIN,
        le=SEED_MAX,
        description="with n > 1, seed + n - 1 must stay within the bound",
    )
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: (
        dict[
            Annotated[str, StringConstraints(pattern=r"^[0-9]+$")],
            Annotated[float, Field(ge=-100, le=100)],
        ]
        | None
    ) = Field(
        None,
        description="token id (a decimal string, as OpenAI sends it) -> bias added to its logit",
    )
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1, json_schema_extra={VOCAB_KEY: "size"})] | None = Field(
        None, description="-1 or 0: off"
    )
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX, description="at most max_tokens")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(
        0,
        ge=-INT64_MAX,
        le=INT64_MAX,
        description="vLLM's: lower is scheduled first (the engine's --scheduling-policy priority; "
        "elsewhere only 0 is accepted)",
    )
    # the router and the engine check it first (kvmesh.common.cache_salt): their own 400
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    prompt_logprobs: Logprobs | None = Field(
        None, description="top-N logprobs of every prompt token"
    )
    return_token_ids: bool = Field(
        False,
        description="vLLM's: the prompt's token ids and each choice's generated "
        "ids in the response (per chunk when streaming)",
    )
    # The router's continuation of a stream whose replica died: {"output_token_ids": [...]}, the ids
    # the client has received of its one choice, or {"choices": [{"index": i, "output_token_ids": [...]}]}
    # for the choices of several still running (docs/engine-server.md, "Mid-stream resume")
    resume: Annotated[Any, _schema(_RESUME)] = None
    # Structured outputs (engine/structured/request_fields.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields; at most one of them per request.
    response_format: Annotated[Any, _schema(_RESPONSE_FORMAT)] = None
    structured_outputs: Annotated[Any, _schema(_STRUCTURED_OUTPUTS)] = None
    guided_json: Annotated[
        Any,
        _schema(
            {
                "anyOf": [_JSON_SCHEMA, {"type": "string"}],
                "description": "vLLM's older form of structured_outputs",
            }
        ),
    ] = None
    guided_regex: Annotated[Any, _schema({"type": "string", "minLength": 1})] = None
    guided_choice: Annotated[Any, _schema(_CHOICES)] = None
    guided_grammar: Annotated[Any, _schema(_EBNF)] = None
    # Tools are chat's (ChatCompletionRequest types them); a completion refuses them when they ask
    # for something. The deprecated functions are refused (400 naming the field), never ignored.
    tools: Annotated[
        list[Any] | None, _schema({**_NONE_LISTED, "description": "tools are for chat completions"})
    ] = None
    tool_choice: Annotated[Any, WithJsonSchema(_OFF)] = None
    functions: Annotated[
        list[Any] | None, _schema({**_NONE_LISTED, "description": "not supported"})
    ] = None
    function_call: Annotated[Any, WithJsonSchema(_OFF)] = None


_PROMPT = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, VOCAB_KEY: "id"},
            "minItems": 1,
        },
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_PROMPTS},
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, VOCAB_KEY: "id"},
                "minItems": 1,
            },
            "minItems": 1,
            "maxItems": MAX_PROMPTS,
        },
    ],
    "description": "a text, a list of token ids, or a batch of either",
}


class CompletionRequest(GenerationRequest):
    # typed loosely for speed and for the engine's messages (CompletionRequest.prompt_inputs)
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], WithJsonSchema(_PROMPT)]
    max_tokens: int | None = Field(
        16,
        ge=0,
        le=INT64_MAX,
        description="default 16; 0 only with echo (the "
        "prompt alone); prompt + max_tokens must fit the context",
    )
    logprobs: Logprobs | None = None
    echo: bool = False
    best_of: Annotated[int | None, WithJsonSchema({"enum": [1, None], "description": "only 1"})] = (
        None
    )
    suffix: Annotated[
        str | None,
        WithJsonSchema(
            {"type": ["string", "null"], "maxLength": 0, "description": "not supported"}
        ),
    ] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_not_booleans(cls, value: Any) -> Any:
        """``true`` is not token id 1 (pydantic's lax mode would take it; the router refuses it too)."""
        if isinstance(value, list):  # set(map(type, ...)): C speed over a million ids
            kinds = set(map(type, value))
            if bool in kinds or (
                list in kinds
                and any(bool in set(map(type, item)) for item in value if type(item) is list)
            ):
                raise ValueError("token ids must be integers, not booleans")
        return value


def _message_name(schema: dict[str, Any]) -> None:
    schema["properties"]["name"] = {"type": "string", "description": "passed to the chat template"}


class ChatMessage(BaseModel):
    # other fields (``name``) go to the chat template as they are
    model_config = ConfigDict(extra="allow", json_schema_extra=_message_name)
    role: str
    content: Annotated[
        str | list[dict[str, Any]] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": _CONTENT_PART},
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    tool_calls: Annotated[list[Any] | None, WithJsonSchema(_TOOL_CALLS)] = (
        None  # an assistant's earlier calls
    )
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Annotated[Any, WithJsonSchema(_TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None  # false: one call at most
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=INT64_MAX,
        description="the model's default when absent; prompt + max_tokens must fit the context",
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, le=INT64_MAX, description="overrides max_tokens"
    )
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(None, description="requires logprobs")
    add_generation_prompt: bool = True
    continue_final_message: bool = (
        False  # vLLM's: the model continues the final (assistant) message
    )
    chat_template_kwargs: dict[str, Any] | None = (
        None  # vLLM's: extra variables for the chat template
    )
    echo: Annotated[
        bool, WithJsonSchema({"const": False, "description": "vLLM's chat echo: not supported"})
    ] = False


def _one_of_prompt_and_messages(schema: dict[str, Any]) -> None:
    schema["description"] = "exactly one of prompt and messages"
    schema["oneOf"] = [
        {
            "required": ["prompt"],
            "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
        },
        {
            "required": ["messages"],
            "properties": {"prompt": {"type": "null"}, "messages": {"type": "array"}},
        },
    ]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_one_of_prompt_and_messages)
    model: str | None = Field(
        None, description="the served model name or a loaded LoRA adapter's (another one is a 404)"
    )
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = (
        None  # with messages: rendered as the chat handler renders them
    )
    tool_choice: Annotated[Any, WithJsonSchema(_TOOL_CHOICE)] = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(
        None, description="the served model name or a loaded LoRA adapter's (another one is a 404)"
    )
    tokens: list[TokenId]


# The request body of each route of the OpenAI surface, by its schema name.
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    model.__name__: model
    for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
}
