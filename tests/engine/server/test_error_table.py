"""The engine server's API error paths, as one table: every bounded or unsupported field gets
its exact status and OpenAI error body ``{"error": {"message", "type", "param", "code"}}``
with the exact ``param`` (and ``code`` where there is one); the limit cases just inside
the bounds are answered 200. Every error row is sent plain and with ``"stream": true``
(refused before the stream starts: the same JSON error, not an SSE event).

The same table goes through the router (tests/router/test_error_table.py), whose answer
must equal the engine's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvmesh.common.cache_salt import MAX_CACHE_SALT_CHARS
from tests.engine.server.conftest import ThreadServer

MODEL = "tiny"
MAX_LEN = 64  # --max-model-len
CAPACITY = 16  # --max-num-seqs 8 + --max-waiting 8: choices admitted at once
BODY_LIMIT = 65536  # --max-body-bytes
VOCAB = 49152
SERVER_ARGS = [
    "--served-model-name",
    MODEL,
    "--num-kv-blocks",
    "64",
    "--max-model-len",
    str(MAX_LEN),
    "--max-num-seqs",
    "8",
    "--max-waiting",
    "8",
    "--max-body-bytes",
    str(BODY_LIMIT),
]

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
HI = [{"role": "user", "content": "hi"}]
TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error"}


@dataclass
class Row:
    id: str
    path: str
    body: Any  # a JSON value, or bytes sent as they are
    status: int
    param: str | None = None
    code: str | None = None
    check: Any = None  # for 200 rows: a function of the response body
    says: str | None = None  # for error rows whose param alone is ambiguous: in the message
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def streamable(self) -> bool:
        return self.path in (C, CHAT) and isinstance(self.body, dict) and "stream" not in self.body


def _filled(prompt_len: int, completion: int):
    def check(body: dict) -> None:
        usage = body["usage"]
        assert usage["prompt_tokens"] == prompt_len and usage["completion_tokens"] == completion, (
            usage
        )
        assert body["choices"][0]["finish_reason"] == "length"

    return check


def _content(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


TEXT = {"type": "text", "text": "hi"}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
F_TOOL = {"type": "function", "function": {"name": "f"}}

ROWS: list[Row] = [
    # -- the body itself
    Row("not-json", C, b"{not json", 400, None, "invalid_json"),
    Row("not-an-object", C, b"[1, 2]", 400, None),
    Row(
        "body-over-limit",
        C,
        json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode(),
        413,
        None,
        "body_too_large",
    ),
    Row("lone-surrogate", C, b'{"prompt": "a\\ud800b"}', 400, "prompt", "invalid_text"),
    Row("nan-temperature", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    # -- model
    Row("unknown-model", C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    Row(
        "unknown-model-chat",
        CHAT,
        {"messages": HI, "model": "gpt-4"},
        404,
        "model",
        "model_not_found",
    ),
    Row("served-model", C, {"prompt": "x", "model": MODEL, "max_tokens": 1}, 200),
    # -- unsupported completion fields
    Row("suffix", C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    Row("best_of-2", C, {"prompt": "x", "best_of": 2}, 400, "best_of"),
    Row("best_of-0", C, {"prompt": "x", "best_of": 0}, 400, "best_of"),
    Row("best_of-1", C, {"prompt": "x", "best_of": 1, "max_tokens": 1}, 200),
    Row("echo-chat", CHAT, {"messages": HI, "echo": True}, 400, "echo"),
    Row("echo-max_tokens-0", C, {"prompt": "x", "echo": True, "max_tokens": 0}, 200),
    # -- asked-for features this server does not have: refused, never ignored
    # -- structured outputs (docs/structured-outputs.md): a spec the backend cannot compile is a 400
    # naming the field as sent, before anything runs
    Row(
        "response_format-json",
        CHAT,
        {"messages": HI, "response_format": {"type": "json_object"}, "max_tokens": 4},
        200,
    ),
    Row(
        "response_format-schema",
        CHAT,
        {
            "messages": HI,
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        },
        200,
    ),
    Row(
        "response_format-completion",
        C,
        {"prompt": "x", "response_format": {"type": "json_object"}, "max_tokens": 4},
        200,
    ),
    Row(
        "response_format-not-object",
        CHAT,
        {"messages": HI, "response_format": "json"},
        400,
        "response_format",
    ),
    Row(
        "response_format-type",
        CHAT,
        {"messages": HI, "response_format": {"type": "yaml"}},
        400,
        "response_format.type",
    ),
    Row(
        "response_format-no-json_schema",
        CHAT,
        {"messages": HI, "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
    ),
    Row(
        "response_format-no-schema",
        CHAT,
        {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format.json_schema.schema",
    ),
    Row(
        "response_format-bad-schema",
        CHAT,
        {
            "messages": HI,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            },
        },
        400,
        "response_format.json_schema.schema",
        says="cannot be compiled",
    ),
    Row(
        "response_format-unsatisfiable",
        C,
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "integer", "minimum": 5, "maximum": 1},
                },
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    Row(
        "response_format-schema-not-object",
        C,
        {
            "prompt": "x",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        },
        400,
        "response_format.json_schema.schema",
    ),
    Row(
        "response_format-text",
        CHAT,
        {"messages": HI, "response_format": {"type": "text"}, "max_tokens": 1},
        200,
    ),
    Row(
        "structured_outputs-choice",
        CHAT,
        {"messages": HI, "structured_outputs": {"choice": ["a", "b"]}},
        200,
        check=lambda b: b["choices"][0]["message"]["content"] in ("a", "b"),
    ),
    Row(
        "structured_outputs-regex",
        C,
        {"prompt": "x", "structured_outputs": {"regex": "[a-"}},
        400,
        "structured_outputs.regex",
        says="cannot be compiled",
    ),
    Row(
        "structured_outputs-grammar",
        C,
        {"prompt": "x", "structured_outputs": {"grammar": 'root ::= "a'}},
        400,
        "structured_outputs.grammar",
    ),
    Row(
        "structured_outputs-json-text",
        C,
        {"prompt": "x", "structured_outputs": {"json": "{not json"}},
        400,
        "structured_outputs.json",
    ),
    Row(
        "structured_outputs-choice-empty",
        C,
        {"prompt": "x", "structured_outputs": {"choice": []}},
        400,
        "structured_outputs.choice",
    ),
    Row(
        "structured_outputs-two-kinds",
        C,
        {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
        400,
        "structured_outputs",
    ),
    Row(
        "structured_outputs-none",
        C,
        {"prompt": "x", "structured_outputs": {}},
        400,
        "structured_outputs",
    ),
    Row(
        "structured_outputs-not-object",
        C,
        {"prompt": "x", "structured_outputs": "a+"},
        400,
        "structured_outputs",
    ),
    Row(
        "structured_outputs-structural_tag",
        C,
        {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}},
        400,
        "structured_outputs.structural_tag",
    ),
    Row(
        "structured-two-fields",
        C,
        {"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a+"},
        400,
        "guided_regex",
        says="send one",
    ),
    # tools: auto (the default with tools) needs the server's flags, as in vLLM (docs/tool-calling.md)
    Row(
        "tools-auto-without-flags",
        CHAT,
        {"messages": HI, "tools": [F_TOOL]},
        400,
        "tool_choice",
        says="--enable-auto-tool-choice",
    ),
    Row(
        "tools-name-missing",
        CHAT,
        {"messages": HI, "tools": [{"type": "function", "function": {}}]},
        400,
        "tools.0.function.name",
    ),
    Row(
        "tool_choice-unknown-function",
        CHAT,
        {
            "messages": HI,
            "tools": [F_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice.function.name",
    ),
    Row("tools-completion", C, {"prompt": "x", "tools": [F_TOOL]}, 400, "tools"),
    Row("tool_choice", CHAT, {"messages": HI, "tool_choice": "auto"}, 400, "tool_choice"),
    Row(
        "tool_choice-none",
        CHAT,
        {"messages": HI, "tool_choice": "none", "tools": [], "max_tokens": 1},
        200,
    ),
    Row("functions", CHAT, {"messages": HI, "functions": [{"name": "f"}]}, 400, "functions"),
    Row("function_call", CHAT, {"messages": HI, "function_call": "auto"}, 400, "function_call"),
    Row("guided_json", C, {"prompt": "x", "guided_json": {"type": "object"}, "max_tokens": 4}, 200),
    Row(
        "guided_choice",
        CHAT,
        {"messages": HI, "guided_choice": ["a", "b"]},
        200,
        check=lambda b: b["choices"][0]["message"]["content"] in ("a", "b"),
    ),
    Row(
        "guided_regex",
        C,
        {"prompt": "x", "guided_regex": "a+", "max_tokens": 4},
        200,
        check=lambda b: set(b["choices"][0]["text"]) == {"a"},
    ),
    Row("guided_json-bad", C, {"prompt": "x", "guided_json": {"type": "foo"}}, 400, "guided_json"),
    Row("guided_choice-empty", CHAT, {"messages": HI, "guided_choice": []}, 400, "guided_choice"),
    Row("guided_regex-bad", C, {"prompt": "x", "guided_regex": "(a"}, 400, "guided_regex"),
    Row(
        "guided_grammar-bad",
        C,
        {"prompt": "x", "guided_grammar": "root ::= "},
        400,
        "guided_grammar",
    ),
    # -- prompts and batches
    Row("prompt-missing", C, {}, 400, "prompt"),
    Row("prompt-empty-text", C, {"prompt": ""}, 400, "prompt"),
    Row("prompt-empty-ids", C, {"prompt": []}, 400, "prompt"),
    Row("prompt-empty-in-batch", C, {"prompt": [[1, 2], []]}, 400, "prompt"),
    Row("prompt-number", C, {"prompt": 5}, 400, "prompt"),
    Row("prompt-mixed-batch", C, {"prompt": ["text", [1, 2]]}, 400, "prompt"),
    Row("prompt-float-id", C, {"prompt": [1.5]}, 400, "prompt"),
    Row("prompt-id-outside-vocab", C, {"prompt": [VOCAB]}, 400, "prompt"),
    Row("prompt-last-id", C, {"prompt": [VOCAB - 1], "max_tokens": 1}, 200),
    Row("prompt-bool-id", C, {"prompt": [True, 5], "max_tokens": 1}, 400, "prompt"),
    Row("prompt-integral-float-id", C, {"prompt": [1.0, 5], "max_tokens": 1}, 200),
    Row(
        "n-integral-float",
        C,
        {"prompt": "x", "n": 2.0, "max_tokens": 1},
        200,
        check=lambda b: len(b["choices"]) == 2,
    ),
    Row(
        "max_tokens-numeric-text",
        C,
        {"prompt": "x", "max_tokens": "2", "ignore_eos": True},
        200,
        check=lambda b: b["usage"]["completion_tokens"] == 2,
    ),
    Row("batch-257-texts", C, {"prompt": ["a"] * 257}, 400, "prompt", says="at most 256 prompts"),
    Row(
        "batch-257-id-lists", C, {"prompt": [[1]] * 257}, 400, "prompt", says="at most 256 prompts"
    ),
    Row(
        "batch-over-capacity",
        C,
        {"prompt": ["a"] * (CAPACITY + 1), "max_tokens": 1},
        400,
        "prompt",
        says=f"exceed the {CAPACITY} requests",
    ),
    Row(
        "batch-at-capacity",
        C,
        {"prompt": ["a"] * CAPACITY, "max_tokens": 1},
        200,
        check=lambda b: len(b["choices"]) == CAPACITY,
    ),
    # -- n
    Row("n-0", C, {"prompt": "x", "n": 0}, 400, "n"),
    Row("n-129", C, {"prompt": "x", "n": 129}, 400, "n", says="between 1 and 128"),
    Row("n-not-int", C, {"prompt": "x", "n": "abc"}, 400, "n"),
    Row(
        "n-over-capacity",
        C,
        {"prompt": "x", "n": CAPACITY + 1, "max_tokens": 1},
        400,
        "n",
        says=f"exceed the {CAPACITY} requests",
    ),
    Row(
        "n-times-prompts-over-capacity", C, {"prompt": ["a"] * 4, "n": 5, "max_tokens": 1}, 400, "n"
    ),
    Row(
        "n-at-capacity",
        CHAT,
        {"messages": HI, "n": CAPACITY, "max_tokens": 1},
        200,
        check=lambda b: len(b["choices"]) == CAPACITY,
    ),
    # -- cache_salt
    Row("cache_salt-empty", C, {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    Row("cache_salt-number", C, {"prompt": "x", "cache_salt": 5}, 400, "cache_salt"),
    Row("cache_salt-chat-empty", CHAT, {"messages": HI, "cache_salt": ""}, 400, "cache_salt"),
    Row(
        "cache_salt-list",
        C,
        {"prompt": "x", "cache_salt": ["a"]},
        400,
        "cache_salt",
        says="must be a string",
    ),
    Row(
        "cache_salt-bool",
        CHAT,
        {"messages": HI, "cache_salt": True},
        400,
        "cache_salt",
        says="must be a string",
    ),
    Row(
        "cache_salt-too-long",
        C,
        {"prompt": "x", "cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)},
        400,
        "cache_salt",
        says=f"at most {MAX_CACHE_SALT_CHARS}",
    ),
    Row(
        "cache_salt-chat-too-long",
        CHAT,
        {"messages": HI, "cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)},
        400,
        "cache_salt",
        says=f"at most {MAX_CACHE_SALT_CHARS}",
    ),
    Row(
        "cache_salt-longest",
        C,
        {"prompt": "x", "cache_salt": "s" * MAX_CACHE_SALT_CHARS, "max_tokens": 1},
        200,
    ),
    Row(
        "cache_salt-non-ascii",
        CHAT,
        {"messages": HI, "cache_salt": "t\u00e9nant-\U0001f600", "max_tokens": 1},
        200,
    ),
    # a lone surrogate cannot be encoded into the block-key root: escaped, or as UTF-8 bytes
    Row(
        "cache_salt-surrogate",
        C,
        b'{"prompt": "x", "cache_salt": "a\\ud800"}',
        400,
        "cache_salt",
        "invalid_text",
    ),
    Row(
        "cache_salt-chat-surrogate",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "\\udfff"}',
        400,
        "cache_salt",
        "invalid_text",
    ),
    Row(
        "cache_salt-surrogate-bytes",
        C,
        b'{"prompt": "x", "cache_salt": "\xed\xa0\x80"}',
        400,
        "cache_salt",
        "invalid_text",
    ),
    # -- chat messages and content parts
    Row("messages-missing", CHAT, {}, 400, "messages"),
    Row("messages-empty", CHAT, {"messages": []}, 400, "messages"),
    Row("messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    Row("message-not-object", CHAT, {"messages": ["hi"]}, 400, "messages.0"),
    Row("message-without-role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    Row(
        "message-role-number",
        CHAT,
        {"messages": [{"role": 5, "content": "x"}]},
        400,
        "messages.0.role",
    ),
    Row(
        "content-number",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages.0.content",
    ),
    Row(
        "content-part-image", CHAT, {"messages": _content(IMAGE)}, 400, "messages.0.content.0.type"
    ),
    Row(
        "content-part-audio-later",
        CHAT,
        {"messages": HI + _content(TEXT, {"type": "input_audio"})},
        400,
        "messages.1.content.1.type",
    ),
    Row(
        "content-part-text-number",
        CHAT,
        {"messages": _content({"type": "text", "text": 5})},
        400,
        "messages.0.content.0.text",
    ),
    Row("content-parts-text", CHAT, {"messages": _content(TEXT, TEXT), "max_tokens": 1}, 200),
    Row(
        "continue-and-generation-prompt",
        CHAT,
        {"messages": HI + [{"role": "assistant", "content": "a"}], "continue_final_message": True},
        400,
        "messages",
    ),
    # -- the context: a prompt of exactly max_model_len, max_tokens filling it exactly vs one over
    Row(
        "prompt-exactly-max-len",
        C,
        {"prompt": [5] * MAX_LEN, "max_tokens": 1},
        400,
        "prompt",
        says=f"maximum context length is {MAX_LEN}",
    ),
    Row(
        "prompt-max-len-minus-1",
        C,
        {"prompt": [5] * (MAX_LEN - 1), "max_tokens": 1, "ignore_eos": True},
        200,
        check=_filled(MAX_LEN - 1, 1),
    ),
    Row(
        "max_tokens-fills-context",
        C,
        {"prompt": [5] * 10, "max_tokens": MAX_LEN - 10, "ignore_eos": True},
        200,
        check=_filled(10, MAX_LEN - 10),
    ),
    Row(
        "max_tokens-one-over",
        C,
        {"prompt": [5] * 10, "max_tokens": MAX_LEN - 9},
        400,
        "max_tokens",
        "context_length_exceeded",
        says=f"requested {MAX_LEN + 1} tokens",
    ),
    Row(
        "default-max_tokens-over",
        C,
        {"prompt": [5] * (MAX_LEN - 8)},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),  # OpenAI's default of 16 does not fit
    Row(
        "chat-max_tokens-over",
        CHAT,
        {"messages": HI, "max_tokens": MAX_LEN},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    Row(
        "chat-max_completion_tokens-over",
        CHAT,
        {"messages": HI, "max_completion_tokens": MAX_LEN},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    Row(
        "chat-min_tokens-over-room",
        CHAT,
        {"messages": HI, "min_tokens": MAX_LEN},
        400,
        "min_tokens",
        "context_length_exceeded",
    ),
    Row(
        "chat-messages-over-context",
        CHAT,
        {"messages": [{"role": "user", "content": "word " * MAX_LEN}]},
        400,
        "messages",
    ),
    # -- max_tokens and min_tokens
    Row("max_tokens-0", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    Row("max_tokens-negative", C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    Row("max_tokens-text", C, {"prompt": "x", "max_tokens": "abc"}, 400, "max_tokens"),
    Row("max_tokens-fraction", C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    Row(
        "max_completion_tokens-0",
        CHAT,
        {"messages": HI, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    Row(
        "min_tokens-over-max_tokens",
        C,
        {"prompt": "x", "min_tokens": 5, "max_tokens": 2},
        400,
        "min_tokens",
    ),
    # -- logprobs
    Row("logprobs-21", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    Row("logprobs-negative", C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    Row(
        "logprobs-20",
        C,
        {"prompt": "x", "logprobs": 20, "max_tokens": 1},
        200,
        check=lambda b: len(b["choices"][0]["logprobs"]["top_logprobs"][0]) >= 20,
    ),
    Row(
        "top_logprobs-21",
        CHAT,
        {"messages": HI, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    Row(
        "top_logprobs-without-logprobs",
        CHAT,
        {"messages": HI, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    Row("prompt_logprobs-21", C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    # -- stop
    Row("stop-number", C, {"prompt": "x", "stop": 5}, 400, "stop"),
    Row("stop-empty-string", C, {"prompt": "x", "stop": ""}, 400, "stop"),
    Row("stop-empty-in-list", C, {"prompt": "x", "stop": ["a", ""]}, 400, "stop"),
    Row("stop-number-in-list", C, {"prompt": "x", "stop": [1]}, 400, "stop"),
    Row("stop-nested-list", C, {"prompt": "x", "stop": [["a"]]}, 400, "stop"),
    Row("stop-object", CHAT, {"messages": HI, "stop": {"a": 1}}, 400, "stop"),
    Row(
        "stop_token_ids-negative", C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"
    ),
    Row(
        "stop_token_ids-outside-vocab",
        C,
        {"prompt": "x", "stop_token_ids": [VOCAB]},
        400,
        "stop_token_ids",
    ),
    Row("stop_token_ids-not-list", C, {"prompt": "x", "stop_token_ids": 5}, 400, "stop_token_ids"),
    # -- sampling numbers
    Row("temperature-negative", C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    Row("top_p-over-1", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    Row("top_k-over-vocab", C, {"prompt": "x", "top_k": VOCAB + 1}, 400, "top_k"),
    Row(
        "presence_penalty", CHAT, {"messages": HI, "presence_penalty": 2.5}, 400, "presence_penalty"
    ),
    Row(
        "repetition_penalty-0",
        C,
        {"prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    Row("seed-over-64-bit", C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    Row("logit_bias-key", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    Row("logit_bias-value", C, {"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    Row("logit_bias-value-text", C, {"prompt": "x", "logit_bias": {"1": "a"}}, 400, "logit_bias.1"),
    Row(
        "logit_bias-outside-vocab",
        C,
        {"prompt": "x", "logit_bias": {str(VOCAB): 1}},
        400,
        "logit_bias",
    ),
    # -- other types
    Row("stream-not-bool", C, {"prompt": "x", "stream": "maybe"}, 400, "stream"),
    Row(
        "stream_options-not-object", C, {"prompt": "x", "stream_options": 5}, 400, "stream_options"
    ),
    Row("user-number", C, {"prompt": "x", "user": 5}, 400, "user"),
    Row(
        "chat_template_kwargs-list",
        CHAT,
        {"messages": HI, "chat_template_kwargs": [1]},
        400,
        "chat_template_kwargs",
    ),
    # -- the tokenizer routes (engine only)
    Row("tokenize-neither", TOK, {}, 400, "prompt"),
    Row(
        "tokenize-unknown-model",
        TOK,
        {"prompt": "x", "model": "gpt-4"},
        404,
        "model",
        "model_not_found",
    ),
    Row(
        "tokenize-content-part-image",
        TOK,
        {"messages": _content(IMAGE)},
        400,
        "messages.0.content.0.type",
    ),
    Row("detokenize-outside-vocab", DETOK, {"tokens": [VOCAB]}, 400, "tokens"),
]


def send(
    base_url: str, row: Row, stream: bool = False, client: httpx.Client | None = None
) -> httpx.Response:
    if isinstance(row.body, bytes):
        content = row.body
    else:
        content = json.dumps({**row.body, "stream": True} if stream else row.body).encode()
    headers = {"content-type": "application/json", **row.headers}
    return (client or httpx).post(base_url + row.path, content=content, headers=headers, timeout=60)


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object, checked for its exact shape."""
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def check_row(r: httpx.Response, row: Row) -> None:
    assert r.status_code == row.status, (row.id, r.status_code, r.text[:500])
    if row.status == 200:
        if row.check is not None:
            assert row.check(r.json()) is not False, (row.id, r.text[:500])
        return
    err = error_of(r)
    assert (err["type"], err["param"], err["code"]) == (TYPES[row.status], row.param, row.code), (
        row.id,
        err,
    )
    assert row.says is None or row.says in err["message"], (row.id, err)


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ThreadServer(["--model", tiny_model, *SERVER_ARGS]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(timeout=60) as c:
        yield c


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_error_table(server, http, row):
    check_row(send(server.url, row, client=http), row)


ERROR_STREAM_ROWS = [r for r in ROWS if r.status != 200 and r.streamable]


@pytest.mark.parametrize("row", ERROR_STREAM_ROWS, ids=[r.id for r in ERROR_STREAM_ROWS])
def test_error_table_streaming_is_refused_before_the_stream(server, http, row):
    check_row(send(server.url, row, stream=True, client=http), row)
