"""Structured-output and tool-calling fields pass through the router untouched. The structured-output
fields do not change the prompt's block keys (the engine reads them, its prompt is the same); tools
do, as they change the prompt the engine renders (tests/router/test_tool_routing.py)."""

import httpx
import pytest

STRUCTURED = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "point",
            "schema": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
        },
    },
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": False,
    "structured_outputs": {"choice": ["yes", "no"]},
    "guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
    "guided_regex": r"\d{3}-[a-z]+",
    "guided_choice": ["red", "green", "blü"],
    "guided_grammar": 'root ::= "a" | "b"',
    "guided_decoding_backend": "xgrammar",
}
MESSAGES = [
    {"role": "system", "content": "You answer in JSON. " * 10},
    {"role": "user", "content": "A point?"},
]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
        ("/v1/completions", {"prompt": "Name a colour. " * 10, "max_tokens": 4}),
    ],
)
def test_the_engine_receives_every_structured_field_unchanged(
    stub_factory, router_factory, model_name, path, body
):
    stub = stub_factory(model_name, 1)[0]
    router = router_factory(model=model_name, static_backends=[f"pod-0={stub.url}"])
    sent = {"model": model_name, **body, **STRUCTURED}
    resp = httpx.post(router.url + path, json=sent, timeout=20)
    assert resp.status_code == 200, resp.text
    received = stub.stats()["last_body"]
    assert {k: received.get(k) for k in STRUCTURED} == STRUCTURED
    assert received == sent


TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def test_block_keys_ignore_the_structured_fields_and_follow_the_tools():
    from kvmesh.router import app

    router = app.Router(
        app.RouterConfig(model="smollm2-135m-instruct", redis_url=None)
    )  # its real tokenizer
    structured = {k: v for k, v in STRUCTURED.items() if k not in TOOL_FIELDS}
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "Name a colour. " * 40}),
    ):
        plain = router.prompt_tokens.tokens_and_keys(path, body, False, False)
        with_fields = router.prompt_tokens.tokens_and_keys(
            path, {**body, **structured}, False, False
        )
        assert plain[1], "the prompt is long enough for at least one full block"
        assert with_fields == plain
    chat = {"messages": MESSAGES}
    with_tools = router.prompt_tokens.tokens_and_keys(
        "/v1/chat/completions", {**chat, **STRUCTURED}, False, False
    )
    assert (
        with_tools[0]
        != router.prompt_tokens.tokens_and_keys("/v1/chat/completions", chat, False, False)[0]
    )
