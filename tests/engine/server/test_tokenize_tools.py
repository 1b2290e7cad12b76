"""A chat request with tools has one prompt: the chat handler's prompt ids, /tokenize's tokens and
the router's ids (router/prompt_tokens.py, from kvmesh/common/chat_prompt.py) are the same list, so
the router's block keys are the ones the engine caches; /tokenize answers a 400 naming the field
for tools the chat handler refuses."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.common.block_keys import block_keys
from kvmesh.common.tokenizer import KVMeshTokenizer
from kvmesh.engine.server.protocol import ChatCompletionRequest
from kvmesh.engine.server.tool_prompt import chat_prompt_inputs
from kvmesh.router.fast_tokenize import FastEncoder
from kvmesh.router.prompt_tokens import PromptTokens
from tests.engine.server.conftest import ThreadServer

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, for the next days",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": None,
        "strict": True,
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC"]}}},
    },
    "x-vendor": "ignored",
}  # a null and an unknown key: the engine's request model drops both
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "12 C, rain"},
]
NAMED = {"type": "function", "function": {"name": "get_time"}}
REQUESTS = {
    "auto": {"messages": ASK, "tools": TOOLS},
    "auto-explicit-history": {"messages": HISTORY, "tools": TOOLS, "tool_choice": "auto"},
    "none": {"messages": ASK, "tools": TOOLS, "tool_choice": "none"},
    "none-history": {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"},
    "required": {"messages": ASK, "tools": TOOLS, "tool_choice": "required"},
    "required-one-call": {
        "messages": HISTORY,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
    },
    "named": {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED},
    "named-one-call": {
        "messages": HISTORY,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "parallel_tool_calls": False,
    },
    "required-no-tools": {"messages": ASK, "tools": [], "tool_choice": "required"},
    "history-without-tools": {"messages": HISTORY},
}
# a template that reads `tools` (as Hermes', Qwen 2.5's, Llama 3.1's do), and earlier calls' arguments
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
    "{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def server(hermes_tool_server):
    return hermes_tool_server


@pytest.fixture(scope="module")
def router_tokens(tiny_model):
    return PromptTokens(FastEncoder(KVMeshTokenizer(tiny_model)), MODEL, 16)


def engine_render_ids(
    tok: KVMeshTokenizer, req: dict, tool_call_parser: str | None = "hermes"
) -> list[int]:
    """The chat handler's render (serving_chat.tokenize_prompt), without a server."""
    body = ChatCompletionRequest.model_validate(req)
    messages, kwargs = chat_prompt_inputs(
        tok.chat_template,
        body.template_messages(),
        body.tool_plan(),
        tool_call_parser,
        body.chat_template_kwargs,
    )
    return tok.encode_chat(
        messages, body.add_generation_prompt, body.continue_final_message, kwargs
    )


@pytest.mark.parametrize("name", list(REQUESTS))
def test_the_router_the_chat_handler_and_tokenize_agree_on_a_tool_request(
    server, router_tokens, name
):
    req = {"model": MODEL, **REQUESTS[name]}
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**req, "max_tokens": 1, "return_token_ids": True},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    prompt_ids = chat.json()["prompt_token_ids"]
    tokenized = httpx.post(f"{server.url}/tokenize", json=req, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == prompt_ids
    routed, keys = router_tokens.tokens_and_keys("/v1/chat/completions", req, False, False)
    assert routed == prompt_ids
    assert keys == block_keys(prompt_ids, MODEL, 16) and keys
    # the large-prompt path (worker thread, chunked encoding) gives the same ids
    assert router_tokens.tokens("/v1/chat/completions", req, large=True) == prompt_ids


def test_the_tools_are_in_the_prompt(server, router_tokens):
    """The ids above are not equal by leaving the tools out everywhere."""
    tok = server.state.engine.tokenizer
    with_tools = router_tokens.tokens("/v1/chat/completions", REQUESTS["required"])
    without = router_tokens.tokens("/v1/chat/completions", {"messages": ASK})
    assert len(with_tools) > len(without) + 50
    text = tok.decode(with_tools, skip_special_tokens=False)
    assert (
        "<tools>" in text
        and '"name": "get_time"' in text
        and "x-vendor" not in text
        and '"description": null' not in text
    )
    # tool_choice none: no tools' prompt (the template does not read tools), the history still written out
    none = tok.decode(
        router_tokens.tokens("/v1/chat/completions", REQUESTS["none-history"]),
        skip_special_tokens=False,
    )
    assert "<tools>" not in none and "<tool_response>\n12 C, rain\n</tool_response>" in none


@pytest.mark.parametrize(
    "name", ["auto", "auto-explicit-history", "none", "named-one-call", "history-without-tools"]
)
def test_a_template_that_reads_tools_renders_the_same_for_router_and_engine(tiny_model, name):
    tok = KVMeshTokenizer(tiny_model)
    tok.chat_template = TOOL_TEMPLATE
    router = PromptTokens(FastEncoder(tok), MODEL, 16)
    req = REQUESTS[name]
    ids = engine_render_ids(tok, req)
    assert router.tokens("/v1/chat/completions", req) == ids
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("TOOLS:") == ("tools" in req)
    if "tool_calls" in str(req["messages"]):
        assert (
            'CALL get_weather {"city": "Paris", "days": 1}' in text
        )  # the arguments decoded, as the engine does
    # chat_template_kwargs may override the tools variable, for both
    override = {
        **req,
        "chat_template_kwargs": {"tools": [{"type": "function", "function": {"name": "other"}}]},
    }
    assert router.tokens("/v1/chat/completions", override) == engine_render_ids(tok, override)


def test_a_template_that_lists_a_messages_fields_sees_them_in_the_engines_order(tiny_model):
    tok = KVMeshTokenizer(tiny_model)
    tok.chat_template = "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}\n{% endfor %}"
    router = PromptTokens(FastEncoder(tok), MODEL, 16)
    req = {
        "messages": [
            {"name": "ann", "content": "hi", "role": "user", "lang": None},
            {"tool_call_id": "call-1", "content": None, "role": "tool", "name": "f"},
        ]
    }
    ids = engine_render_ids(tok, req)
    assert router.tokens("/v1/chat/completions", req) == ids
    assert tok.decode(ids, skip_special_tokens=False).startswith(
        "role=user;content=hi;name=ann;role=user;"
    )


def test_the_engines_tool_call_parser_sets_the_format_the_router_must_know(tiny_model):
    """An engine started with --tool-call-parser llama3_json describes tools in Llama 3's format; a router
    told the same format agrees, one left at the default (Hermes) does not."""
    from kvmesh.common.chat_prompt import Llama3JsonPrompt

    tok = KVMeshTokenizer(tiny_model)
    req = REQUESTS["required"]
    ids = engine_render_ids(tok, req, "llama3_json")
    assert (
        PromptTokens(FastEncoder(tok), MODEL, 16, Llama3JsonPrompt).tokens(
            "/v1/chat/completions", req
        )
        == ids
    )
    assert PromptTokens(FastEncoder(tok), MODEL, 16).tokens("/v1/chat/completions", req) != ids


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_tokenize_refuses_bad_tools_naming_the_field(server, router_tokens, fields, param):
    req = {"messages": ASK, **fields}
    resp = httpx.post(f"{server.url}/tokenize", json=req, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    # the chat handler refuses it the same way
    chat = httpx.post(
        f"{server.url}/v1/chat/completions", json={**req, "max_tokens": 1}, timeout=30
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == param
    # the router does not raise on it (the engine answers the 400); tools or messages it cannot render
    # give no ids (routed by load), a bad tool_choice is the engine's alone to refuse
    tokens, keys = router_tokens.tokens_and_keys("/v1/chat/completions", req, False, False)
    assert (tokens == [] and keys == []) == (not param.startswith("tool_choice"))


def test_tokenize_counts_tools_with_a_prompt_ignored(server):
    """As vLLM's: tools belong to chat messages; with a plain prompt they change nothing."""
    plain = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello"}, timeout=30).json()
    with_tools = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "hello", "tools": TOOLS}, timeout=30
    ).json()
    assert plain["tokens"] == with_tools["tokens"]


def test_tokenize_counts_an_auto_request_on_a_server_without_auto_tool_choice(
    tiny_model, router_tokens
):
    """Nothing is generated, so /tokenize needs no --enable-auto-tool-choice (the chat handler's 400);
    without --tool-call-parser the tools are described in Hermes' format, the router's default."""
    srv = ThreadServer(
        ["--model", tiny_model, "--served-model-name", MODEL, "--num-kv-blocks", "64"]
    ).start()
    try:
        req = REQUESTS["auto-explicit-history"]
        resp = httpx.post(f"{srv.url}/tokenize", json=req, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["tokens"] == router_tokens.tokens("/v1/chat/completions", req)
        chat = httpx.post(
            f"{srv.url}/v1/chat/completions", json={**req, "max_tokens": 1}, timeout=30
        )
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "tool_choice"
    finally:
        srv.stop()
