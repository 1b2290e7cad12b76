"""A chat request with tools is routed by its real prefix: the router renders the tools into the
prompt as the engine does (kvmesh/common/chat_prompt.py; tests/engine/server/test_tokenize_tools.py
checks the ids against a real engine), so a second request with the same tools goes to the replica
that caches them, and a tools list the router cannot render costs it nothing."""

from __future__ import annotations

import httpx

from kvmesh.common.chat_prompt import tools_chars
from kvmesh.router.request_checks import prompt_chars
from tests.conftest import shared_encoder, wait_until
from tests.router.test_router import blocks_in_redis, metric, wait_blocks_settled

# ten tools, as an agent sends with every turn: the long, shared part of its prompts
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Tool number {i}: looks up the {i}th kind of record in the archive",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look up"},
                    "limit": {"type": "integer", "minimum": 1},
                },
                "required": ["query"],
            },
        },
    }
    for i in range(10)
]


def chat(base: str, question: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 4, **fields}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=20)


def test_a_tool_request_goes_to_the_replica_holding_its_tools(
    mesh, router_factory, redis_server, model_name
):
    stubs, _ = mesh(3)
    r = redis_server.client()
    # pod-1 holds the question without tools; pod-2 an earlier turn with the tools (straight to the engines)
    assert chat(stubs[1].url, "Find the invoices of March.").status_code == 200
    assert chat(stubs[2].url, "Find the orders of May.", tools=TOOLS).status_code == 200
    wait_until(lambda: blocks_in_redis(r, model_name, "pod-2") > 20, 5, msg="seeded")
    router = router_factory(model=model_name, redis_url=redis_server.url)
    resp = chat(router.url, "Find the invoices of March.", tools=TOOLS, tool_choice="auto")
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvmesh-pod"] == "pod-2"
    assert (
        metric(router.url, "kvmesh_router_decisions_total", policy="prefix", reason="prefix_match")
        == 1
    )
    # the tools' blocks were matched, and the engine read them from its cache
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 20 * 16
    assert metric(router.url, "kvmesh_router_predicted_cached_tokens_total") == cached


def test_a_new_tool_conversation_follows_its_first_turn(
    mesh, router_factory, redis_server, model_name
):
    mesh(3)
    router = router_factory(model=model_name, redis_url=redis_server.url)
    first = chat(router.url, "Which records mention Oslo?", tools=TOOLS, tool_choice="required")
    assert first.status_code == 200
    pod = first.headers["x-kvmesh-pod"]
    wait_blocks_settled(redis_server.client(), model_name, pod)
    second = chat(router.url, "And which mention Bergen?", tools=TOOLS, tool_choice="required")
    assert second.headers["x-kvmesh-pod"] == pod
    assert (
        metric(router.url, "kvmesh_router_decisions_total", policy="prefix", reason="prefix_match")
        == 1
    )
    predicted = metric(router.url, "kvmesh_router_predicted_cached_tokens_total")
    assert predicted > 20 * 16 and predicted == metric(
        router.url, "kvmesh_router_engine_cached_tokens_total"
    )


def test_tools_the_router_cannot_render_give_no_ids_and_no_error():
    from kvmesh.router.prompt_tokens import PromptTokens

    tokens = PromptTokens(shared_encoder(), "m", 16)
    ask = [{"role": "user", "content": "hi"}]
    nested: list = []
    for _ in range(50_000):  # deeper than any JSON the router would have parsed; still no exception
        nested = [nested]
    for tools in (
        "all of them",
        [1],
        [{"type": "function"}],
        [{"function": {"name": 7}}],
        [{"function": {"name": "f", "parameters": "not a schema"}}],
        [{"function": {"name": "f", "strict": "yes"}}],
        {"name": "f"},
        nested,
    ):
        assert tokens.tokens_and_keys(
            "/v1/chat/completions", {"messages": ask, "tools": tools}, False, False
        ) == ([], [])
    # an empty list, or null, is no tools
    plain = tokens.tokens("/v1/chat/completions", {"messages": ask})
    assert plain and tokens.tokens("/v1/chat/completions", {"messages": ask, "tools": []}) == plain
    assert tokens.tokens("/v1/chat/completions", {"messages": ask, "tools": None}) == plain


def test_tools_count_in_the_prompt_size_up_to_a_cap():
    """The size decides whether the router tokenises off its event loop (and the rate limit's first
    charge): tools count, and a hostile tools list is read only up to a cap (bounded time)."""
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    with_tools = prompt_chars("/v1/chat/completions", {**ask, "tools": TOOLS})
    assert with_tools >= prompt_chars("/v1/chat/completions", ask) + 0.8 * len(str(TOOLS))
    assert tools_chars(None) == 0 and tools_chars([]) == 2
    hostile = [[{"k": "v"}] * 1000] * 4000  # four million objects: read up to the cap, no further
    assert tools_chars(hostile) == tools_chars(hostile, cap=1 << 15) == 1 << 15
    assert tools_chars(hostile, cap=100) == 100


def test_the_router_reads_the_tool_call_parser_off_an_engine_command_line():
    from kvmesh.common.chat_prompt import tool_call_parser_in

    assert tool_call_parser_in(["--tool-call-parser", "llama3_json"]) == "llama3_json"
    assert (
        tool_call_parser_in(["--tool-call-parser=hermes", "--tool-call-parser", "llama3_json"])
        == "llama3_json"
    )
    assert (
        tool_call_parser_in(["--tool-call-parser"]) is None
    )  # no value: argparse refuses it anyway
    assert (
        tool_call_parser_in(["--tool-call-parser", "pythonic"]) is None
    )  # no prompt format: the default
    assert tool_call_parser_in([]) is None


def test_a_router_started_with_a_tool_call_parser_renders_tools_in_that_format():
    import argparse

    from kvmesh.common.chat_prompt import Llama3JsonPrompt
    from kvmesh.router import app
    from kvmesh.router.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(
        parser.parse_args(
            [
                "--tool-call-parser",
                "llama3_json",
                "--model",
                "smollm2-135m-instruct",
                "--static-backends",
                "a=http://127.0.0.1:1",
            ]
        )
    )
    assert cfg.tool_call_parser == "llama3_json"
    assert app.Router(cfg).prompt_tokens.tool_format is Llama3JsonPrompt
