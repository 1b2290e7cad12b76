"""The OpenAPI description of the OpenAI-compatible surface, shared by the engine server and the router.

No torch (the router imports this). The request bodies are derived from the request models
(kvmesh.common.protocol), the one source of the request surface; the responses are plain JSON
schemas of every answer an engine can give. A client generator or a fuzzer (schemathesis, in
``make test``) gets real request bodies from it.

- :func:`components` -- ``components`` of a document: the schemas, and the bearer scheme.
- :func:`operation` -- one operation's request body, responses and security (the engine's
  FastAPI routes take it as ``openapi_extra``).
- :func:`router_document` -- the router's whole document (it serves it at ``/openapi.json``).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from kvmesh.common.lora import MODEL_CARD_DIGEST
from kvmesh.common.protocol import REQUEST_MODELS, VOCAB_KEY

REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF + name}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null (JSON Schema 2020-12, as OpenAPI 3.1 uses)."""
    t = schema.get("type")
    if isinstance(t, str) and set(schema) <= {
        "type",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "minLength",
        "maxLength",
        "description",
        "pattern",
        "const",
    }:
        return {**schema, "type": [t, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def _int(
    lo: int | None = None, hi: int | None = None, nullable: bool = True, **extra
) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer", **extra}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return _nullable(s) if nullable else s


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_STR_OR_NULL = {"type": ["string", "null"]}


def request_schemas(
    model: str | None = None, vocab_size: int | None = None
) -> dict[str, dict[str, Any]]:
    """The request bodies, derived from the request models (kvmesh.common.protocol) as FastAPI
    derives them, with what the served model adds on top: ``model``, the one model name the server
    accepts (others get 404); ``vocab_size``, the bound of token ids. Unknown fields are ignored
    (not refused). The nested models (ChatMessage, ToolDefinition, ...) are components too."""
    _, doc = models_json_schema(
        [(m, "validation") for m in REQUEST_MODELS.values()], ref_template=REF + "{model}"
    )
    schemas = doc["$defs"]
    for schema in schemas.values():
        _tailor(schema, vocab_size)
        if model and "model" in schema.get("properties", {}):
            schema["properties"]["model"] = {
                "enum": [model, None],
                "description": "the served model name (another one is a 404)",
            }
    return schemas


_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "not", "contentSchema")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _tailor(schema: dict[str, Any], vocab_size: int | None) -> None:
    """``schema`` (in place, and every schema in it) as the document serves it: token ids bounded
    by the vocabulary, pydantic's titles dropped, nullable scalars written ``type: [t, "null"]``."""
    schema.pop("title", None)
    vocab = schema.pop(VOCAB_KEY, None)
    if vocab and vocab_size:
        schema["maximum"] = vocab_size - 1 if vocab == "id" else vocab_size
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            _tailor(schema[key], vocab_size)
    for key in _SUBSCHEMA_MAPS:
        for sub in schema.get(key, {}).values():
            _tailor(sub, vocab_size)
    for key in _SUBSCHEMA_LISTS:
        for sub in schema.get(key, ()):
            _tailor(sub, vocab_size)
    keys = schema.get("patternProperties")
    if (
        keys and len(keys) == 1 and "properties" not in schema
    ):  # pydantic's dict with constrained keys
        ((pattern, value),) = schema.pop("patternProperties").items()
        schema.update(propertyNames={"pattern": pattern}, additionalProperties=value)
    branches = schema.get("anyOf")
    if (
        branches
        and len(branches) == 2
        and branches[1] == {"type": "null"}
        and set(schema) <= {"anyOf", "default", "description"}
    ):
        nullable = _nullable(branches[0])
        if (
            "anyOf" not in nullable
        ):  # a scalar or null: one schema, as JSON Schema 2020-12 writes it
            del schema["anyOf"]
            schema.update(nullable)


def _obj(required: list[str], props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


_USAGE = _obj(
    ["prompt_tokens", "completion_tokens", "total_tokens"],
    {
        "prompt_tokens": _int(0, nullable=False),
        "completion_tokens": _int(0, nullable=False),
        "total_tokens": _int(0, nullable=False),
        "prompt_tokens_details": _nullable(
            _obj(["cached_tokens"], {"cached_tokens": _int(0, nullable=False)})
        ),
    },
)
_FINISH = {"enum": ["stop", "length", "tool_calls", "abort", "error", None]}
_STOP_REASON = {"type": ["integer", "string", "null"]}
_LOGPROB = {"type": "number", "maximum": 0}  # finite: JSON has no -Infinity
_COMPLETION_LOGPROBS = _nullable(
    _obj(
        ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        {
            "tokens": {"type": "array", "items": _STR},
            "token_logprobs": {"type": "array", "items": _nullable(_LOGPROB)},
            "top_logprobs": {
                "type": "array",
                "items": _nullable({"type": "object", "additionalProperties": _LOGPROB}),
            },
            "text_offset": {"type": "array", "items": _int(0, nullable=False)},
        },
    )
)
_TOP = _obj(
    ["token", "logprob", "bytes"],
    {
        "token": _STR,
        "logprob": _LOGPROB,
        "bytes": {"type": "array", "items": _int(0, 255, nullable=False)},
    },
)
_CHAT_LOGPROBS = _nullable(
    _obj(
        ["content"],
        {
            "content": {
                "type": "array",
                "items": {
                    **_TOP,
                    "required": ["token", "logprob", "bytes", "top_logprobs"],
                    "properties": {
                        **_TOP["properties"],
                        "top_logprobs": {"type": "array", "items": _TOP},
                    },
                },
            }
        },
    )
)
_PROMPT_LOGPROBS = {
    "type": "array",
    "items": _nullable(
        {
            "type": "object",
            "additionalProperties": _obj(
                ["logprob", "rank"],
                {"logprob": _LOGPROB, "rank": _int(1, nullable=False), "decoded_token": _STR},
            ),
        }
    ),
}
_IDS = {"type": "array", "items": _int(0, nullable=False)}  # return_token_ids


def _completion(chunk: bool) -> dict[str, Any]:
    choice = _obj(
        ["index", "text", "finish_reason"],
        {
            "index": _int(0, nullable=False),
            "text": _STR,
            "logprobs": _COMPLETION_LOGPROBS,
            "finish_reason": _FINISH,
            "stop_reason": _STOP_REASON,
            "prompt_logprobs": _PROMPT_LOGPROBS,
            "token_ids": _IDS,
            "prompt_token_ids": _IDS,
        },
    )
    return _obj(
        ["id", "object", "created", "model", "choices"] + ([] if chunk else ["usage"]),
        {
            "id": _STR,
            "object": {"const": "text_completion"},
            "created": _int(0, nullable=False),
            "model": _STR,
            "choices": {"type": "array", "items": choice},
            "usage": _nullable(_ref("Usage")) if chunk else _ref("Usage"),
        },
    )


_TOOL_CALL = _obj(
    ["id", "type", "function"],
    {
        "id": _STR,
        "type": {"const": "function"},
        "function": _obj(["name", "arguments"], {"name": _STR, "arguments": _STR}),
    },
)
_TOOL_CALL_DELTA = _obj(
    ["index", "function"],
    {  # a call's first delta has its id, type and name
        "index": _int(0, nullable=False),
        "id": _STR,
        "type": {"const": "function"},
        "function": _obj([], {"name": _STR, "arguments": _STR}),
    },
)


def _chat(chunk: bool) -> dict[str, Any]:
    if chunk:
        body = {
            "delta": _obj(
                [],
                {
                    "role": {"const": "assistant"},
                    "content": _STR_OR_NULL,
                    "tool_calls": {"type": "array", "items": _TOOL_CALL_DELTA},
                },
            )
        }
    else:
        body = {
            "message": _obj(
                ["role", "content"],
                {
                    "role": {"const": "assistant"},
                    "content": _STR_OR_NULL,
                    "tool_calls": {"type": "array", "items": _TOOL_CALL},
                },
            )
        }
    choice = _obj(
        ["index", *body, "finish_reason"],
        {
            "index": _int(0, nullable=False),
            **body,
            "logprobs": _CHAT_LOGPROBS,
            "finish_reason": _FINISH,
            "stop_reason": _STOP_REASON,
            "prompt_logprobs": _PROMPT_LOGPROBS,
            "token_ids": _IDS,
        },
    )
    return _obj(
        ["id", "object", "created", "model", "choices"] + ([] if chunk else ["usage"]),
        {
            "id": _STR,
            "object": {"const": "chat.completion.chunk" if chunk else "chat.completion"},
            "created": _int(0, nullable=False),
            "model": _STR,
            "choices": {"type": "array", "items": choice},
            "prompt_token_ids": _IDS,
            "usage": _nullable(_ref("Usage")) if chunk else _ref("Usage"),
        },
    )


def _stream(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream: a JSON chunk, an error (a failure after the status
    line: the stream then ends), or the final ``[DONE]``."""
    return _obj(
        ["data"],
        {
            "data": {
                "oneOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]},
                    },
                ]
            }
        },
    )


RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": _obj(
        ["error"],
        {
            "error": _obj(
                ["message", "type", "param", "code"],
                {"message": _STR, "type": _STR, "param": _STR_OR_NULL, "code": _STR_OR_NULL},
            )
        },
    ),
    "Usage": _USAGE,
    "Completion": _completion(False),
    "CompletionChunk": _completion(True),
    "CompletionEvent": _stream("CompletionChunk"),
    "ChatCompletion": _chat(False),
    "ChatCompletionChunk": _chat(True),
    "ChatCompletionEvent": _stream("ChatCompletionChunk"),
    "ModelList": _obj(
        ["object", "data"],
        {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": _obj(
                    ["id", "object", "created", "owned_by"],
                    {
                        "id": _STR,
                        "object": {"const": "model"},
                        "created": _int(0, nullable=False),
                        "owned_by": _STR,
                        "root": _STR,
                        "parent": _STR_OR_NULL,
                        "max_model_len": _int(1),
                        # an adapter's (kvmesh engines): the digest of its files
                        MODEL_CARD_DIGEST: _STR,
                    },
                ),
            },
        },
    ),
    "TokenizeResponse": _obj(
        ["count", "tokens"],
        {
            "count": _int(0, nullable=False),
            "max_model_len": _int(0),
            "tokens": {"type": "array", "items": _int(0, nullable=False)},
            "token_strs": _nullable({"type": "array", "items": _STR}),
        },
    ),
    "DetokenizeResponse": _obj(["prompt"], {"prompt": _STR}),
    "Status": _obj(["status"], {"status": _STR, "error": _STR}),
}

# What each status means, for every route that can give it.
STATUS_TEXT = {
    200: "OK",
    400: "invalid request; `error.param` names the field",
    401: "missing or wrong API key (`Authorization: Bearer <key>`)",
    404: "the model is not served here (`error.param` is `model`)",
    413: "request body over the size limit",
    429: "over capacity or over the rate limit; retry after `Retry-After` seconds",
    500: "the engine failed on this request",
    502: "no engine could take the request, or one failed before answering (router)",
    503: "not ready: loading, draining, or no engine ready (`Retry-After` when retrying will help)",
    504: "the engine did not answer in time (router)",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}


def _responses(ok: dict[str, Any] | None, codes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for code in codes:
        if code == 200:
            out["200"] = {
                "description": "OK",
                "content": ok or {"application/json": {"schema": _ref("Status")}},
            }
            continue
        r: dict[str, Any] = {
            "description": STATUS_TEXT[code],
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        if code == 429:
            r["headers"] = {"Retry-After": {**_RETRY_AFTER["Retry-After"], "required": True}}
        elif code == 503:
            r["headers"] = _RETRY_AFTER
        out[str(code)] = r
    return out


def _json_content(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


# Request examples (documentation; the fuzz tests send each one and check its answer).
_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
EXAMPLES: dict[str, dict[str, Any]] = {
    "CompletionRequest": {
        "text": {
            "summary": "one text prompt",
            "value": {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        },
        "stream": {
            "summary": "a stream of n samples, with top logprobs and usage in every chunk",
            "value": {
                "prompt": "Once upon a time",
                "max_tokens": 4,
                "n": 2,
                "seed": 7,
                "logprobs": 2,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        },
        "batch_echo": {
            "summary": "a batch of token-id prompts, echoed, with prompt logprobs",
            "value": {
                "prompt": [[1, 2, 3, 4], [5, 6]],
                "max_tokens": 2,
                "echo": True,
                "logprobs": 1,
                "prompt_logprobs": 1,
                "stop": ["\n"],
            },
        },
        "echo_only": {
            "summary": "the prompt alone, scored (max_tokens 0 with echo)",
            "value": {"prompt": "Score me", "max_tokens": 0, "echo": True, "logprobs": 0},
        },
    },
    "ChatCompletionRequest": {
        "chat": {
            "summary": "a chat turn",
            "value": {"messages": _CHAT, "max_tokens": 4, "temperature": 0},
        },
        "stream": {
            "summary": "a streamed turn with logprobs",
            "value": {
                "messages": _CHAT,
                "max_completion_tokens": 4,
                "stream": True,
                "logprobs": True,
                "top_logprobs": 2,
                "stream_options": {"include_usage": True},
                "min_p": 0.1,
                "top_k": 20,
            },
        },
        "continue": {
            "summary": "continue the assistant's message, with content parts",
            "value": {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Count:"}]},
                    {"role": "assistant", "content": "1, 2,"},
                ],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": 4,
                "presence_penalty": 0.5,
                "logit_bias": {"13": -100},
            },
        },
    },
    "TokenizeRequest": {
        "prompt": {"value": {"prompt": "Hello world", "return_token_strs": True}},
        "messages": {"value": {"messages": _CHAT, "add_generation_prompt": True}},
        "tools": {
            "summary": "a chat request's prompt with its tools",
            "value": {
                "messages": _CHAT,
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "parameters": {
                                "type": "object",
                                "properties": {"city": {"type": "string"}},
                            },
                        },
                    }
                ],
            },
        },
    },
    "DetokenizeRequest": {"tokens": {"value": {"tokens": [1, 2, 3, 4]}}},
}

# The routes of the OpenAI surface: method, request schema, 200 content, statuses an engine gives.
_GENERATE_CODES = [200, 400, 401, 404, 413, 429, 500, 503]
ROUTES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/completions"): {
        "summary": "OpenAI completions (vLLM's extensions included)",
        "request": "CompletionRequest",
        "ok": {
            **_json_content("Completion"),
            "text/event-stream": {"schema": _ref("CompletionEvent")},
        },
        "codes": _GENERATE_CODES,
    },
    ("post", "/v1/chat/completions"): {
        "summary": "OpenAI chat completions (the model's chat template)",
        "request": "ChatCompletionRequest",
        "ok": {
            **_json_content("ChatCompletion"),
            "text/event-stream": {"schema": _ref("ChatCompletionEvent")},
        },
        "codes": _GENERATE_CODES,
    },
    ("get", "/v1/models"): {
        "summary": "the served model",
        "ok": _json_content("ModelList"),
        "codes": [200, 401, 503],
    },
    ("post", "/tokenize"): {
        "summary": "vLLM's /tokenize: the token ids the engine would see",
        "request": "TokenizeRequest",
        "ok": _json_content("TokenizeResponse"),
        "codes": [200, 400, 401, 404, 413, 503],
    },
    ("post", "/detokenize"): {
        "summary": "vLLM's /detokenize",
        "request": "DetokenizeRequest",
        "ok": _json_content("DetokenizeResponse"),
        "codes": [200, 400, 401, 404, 413, 503],
    },
}
AUTH_EXEMPT = {"/health", "/ready", "/metrics", "/load", "/openapi.json"}


def operation(
    method: str,
    path: str,
    *,
    auth: bool = False,
    extra_codes: tuple[int, ...] = (),
    summary: str | None = None,
) -> dict[str, Any]:
    """One operation of :data:`ROUTES` (``openapi_extra`` of a FastAPI route): its request body,
    its responses, and the bearer scheme when ``auth``."""
    spec = ROUTES[(method, path)]
    op: dict[str, Any] = {"summary": summary or spec["summary"]}
    if "request" in spec:
        op["parameters"] = [
            {
                "name": "X-Request-Id",
                "in": "header",
                "required": False,
                "description": "the request's id (logs, the response's X-Request-Id and id)",
                "schema": {"type": "string", "maxLength": 128},
            }
        ]
        op["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {
                    "schema": _ref(spec["request"]),
                    "examples": copy.deepcopy(EXAMPLES[spec["request"]]),
                }
            },
        }
    codes = sorted(set(spec["codes"]) | set(extra_codes))
    if not auth:
        codes = [c for c in codes if c != 401]
    op["responses"] = _responses(spec["ok"], codes)
    if auth:
        op["security"] = [{"bearer": []}]
    return op


def components(
    model: str | None = None, vocab_size: int | None = None, auth: bool = False
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "schemas": {**request_schemas(model, vocab_size), **copy.deepcopy(RESPONSE_SCHEMAS)}
    }
    if auth:
        out["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return out


def simple_get(
    summary: str, codes: list[int], content: dict[str, Any] | None = None, status_body: bool = False
) -> dict[str, Any]:
    """A GET without a body; ``status_body``: its errors answer ``{"status": ...}`` (probes),
    not an OpenAI error."""
    responses = _responses(content, codes)
    if status_body:
        for code, r in responses.items():
            if code != "200":
                r["content"] = _json_content("Status")
    return {"summary": summary, "responses": responses}


# The engine's /load.
LOAD = _obj(
    ["model", "kv_cache_usage", "num_running", "num_waiting", "num_in_flight", "draining", "ready"],
    {
        "model": _STR,
        "kv_cache_usage": {"type": "number", "minimum": 0},
        "num_running": _int(0, nullable=False),
        "num_waiting": _int(0, nullable=False),
        "num_total_blocks": _int(0),
        "num_in_flight": _int(0, nullable=False),
        "draining": _BOOL,
        "ready": _BOOL,
        "timestamp": {"type": "number"},
    },
)


def router_document(
    model: str, vocab_size: int | None = None, auth: bool = False
) -> dict[str, Any]:
    """The router's OpenAPI document: the engines' routes it proxies (with its own statuses: 502,
    504 upstream failures, 503 with no ready engine, 429 its rate limit), and its own probes."""
    paths: dict[str, Any] = {}
    for method, path in ROUTES:
        extra = (429, 502, 503, 504) if method == "post" else ()
        op = operation(method, path, auth=auth, extra_codes=extra)
        if path == "/v1/models":  # answered by the router itself
            op["responses"] = _responses(
                ROUTES[(method, path)]["ok"], [200, 401] if auth else [200]
            )
        paths.setdefault(path, {})[method] = op
    paths["/health"] = {"get": simple_get("liveness: the router process answers", [200])}
    ready = {
        "application/json": {
            "schema": _obj(
                ["status"],
                {
                    "status": _STR,
                    "pods": _int(0, nullable=False),
                    "redis": _BOOL,
                    "discovery": {},
                    "held_requests": _int(0, nullable=False),
                    "max_pending_requests": _int(0, nullable=False),
                },
            )
        }
    }
    paths["/ready"] = {
        "get": simple_get(
            "readiness: an engine is routable, or requests are held until one is (scale from zero)",
            [200, 503],
            ready,
        )
    }
    paths["/ready"]["get"]["responses"]["503"]["content"] = ready
    paths["/metrics"] = {
        "get": simple_get("Prometheus metrics", [200], {"text/plain": {"schema": _STR}})
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvmesh router", "version": "0.1.0"},
        "paths": paths,
        "components": components(model, vocab_size, auth),
    }
