"""API fuzzing of the router with schemathesis: bodies generated from the router's own OpenAPI
document (GET /openapi.json, kvmesh.common.openapi), sent over real HTTP to a router in front of
two stub engines (separate processes, sidecars, a real Redis); no 5xx, no hang, every response as
documented (see tests/fuzz_checks.py)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis

from kvmesh.router.auth import parse_keys
from tests.fuzz_checks import (
    check_unsupported_methods,
    config,
    documented_examples,
    fuzz,
    send_example,
)
from tests.router.test_router import metric

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPERATIONS = [
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("post", "/tokenize"),
    ("post", "/detokenize"),
    ("get", "/v1/models"),
    ("get", "/health"),
    ("get", "/ready"),
    ("get", "/metrics"),
]


@pytest.fixture
def fuzzed(mesh, router_factory, redis_server, model_name):
    stubs, _ = mesh(2)
    router = router_factory(
        model=model_name, redis_url=redis_server.url, api_keys=parse_keys(KEY), max_body_bytes=16384
    )
    schema = schemathesis.openapi.from_url(f"{router.url}/openapi.json", config=config())
    return router, stubs, schema


def test_router_api_fuzz(fuzzed, model_name):
    """One test (the mesh is per test): the document, its examples, then every operation fuzzed."""
    router, stubs, schema = fuzzed
    ops = {(op.method.lower(), op.path) for op in (r.ok() for r in schema.get_all_operations())}
    assert ops == set(OPERATIONS)
    assert schema.raw_schema["components"]["schemas"]["ChatCompletionRequest"]["properties"][
        "model"
    ]["enum"] == [model_name, None]
    assert schema.raw_schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]

    streamed = 0
    for method, path, name, body in documented_examples(schema):
        r = send_example(schema, method, path, body, AUTH)
        assert r.status_code == 200, (path, name, r.text)
        streamed += r.headers["content-type"][0].startswith("text/event-stream")
    assert streamed == 2
    before = sum(s.stats()["requests"] for s in stubs)
    assert before >= 7  # the generation examples reached the engines

    # the documented example "continue" (content parts) was a 500 from the stub engine, and what
    # the engine refuses to render the stub refuses as the engine does: a 400, not a 500
    r = httpx.post(
        router.url + "/v1/chat/completions", json=CONTENT_PARTS, headers=AUTH, timeout=20
    )
    assert r.status_code == 200, (
        r.text
    )  # the stub tokenizes it as the router does (continue_final_message)
    prompt = router.router.prompt_tokens.tokens("/v1/chat/completions", CONTENT_PARTS)
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    image = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]
    }
    r = httpx.post(router.url + "/v1/chat/completions", json=image, headers=AUTH, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    for path, body, status in STUB_INPUTS:  # straight to a stub engine
        r = httpx.post(stubs[0].url + path, json=body, timeout=20)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        if status == 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        elif "stream" in body:
            assert r.text.endswith("data: [DONE]\n\n"), r.text
    before = sum(s.stats()["requests"] for s in stubs)

    # found by schemathesis' unsupported-method check: GET /v1/completions was a 404, POST /health a 200
    assert check_unsupported_methods(router.url, schema, AUTH) >= 30
    assert stubs[0].stats()["requests"] + stubs[1].stats()["requests"] == before  # none was proxied

    for method, path in OPERATIONS:
        fuzz(schema, method, path, AUTH)
    assert metric(router.url, "kvmesh_router_internal_errors_total") == 0
    assert httpx.get(router.url + "/ready", timeout=5).json()["pods"] == 2


# -- regressions found by the fuzzing ------------------------------------------------------------
# The documented example "continue" (content parts, as OpenAI's clients send them) was a 500 from
# the stub engine, and the router routed it with no tokens at all: both handed the raw messages to
# the chat template, which cannot join a list of parts. The engine joins the text parts first.
CONTENT_PARTS = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Count:"}]},
        {"role": "assistant", "content": "1, 2,"},
    ],
    "continue_final_message": True,
    "add_generation_prompt": False,
    "max_tokens": 4,
    "presence_penalty": 0.5,
    "logit_bias": {"13": -100},
}


# What the stub engine answered with a 500 (or a 404, a truncated stream) before it read requests
# as the engine does: (path, body, the engine's status).
STUB_INPUTS = [
    ("/v1/chat/completions", CONTENT_PARTS, 200),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 200),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
    ),
    ("/v1/completions", [1, 2], 400),
    (
        "/v1/completions",
        {"prompt": "x", "stream": True, "stream_options": "yes", "max_tokens": 2},
        200,
    ),
    ("/tokenize", {"messages": "hi"}, 400),
    ("/tokenize", {"prompt": 5}, 400),
    ("/detokenize", {"tokens": [1, 2]}, 200),
    ("/detokenize", {"tokens": "x"}, 400),
]


def test_router_tokenizes_content_parts_and_null_content_as_the_engine_renders_them():
    from kvmesh.router.app import Router, RouterConfig
    from tests.conftest import shared_encoder

    router = Router(RouterConfig(model="m", redis_url=None), encoder=shared_encoder())
    path = "/v1/chat/completions"
    flat = {
        **CONTENT_PARTS,
        "messages": [
            {"role": "user", "content": "Count:"},
            {"role": "assistant", "content": "1, 2,"},
        ],
    }
    tokens_of = router.prompt_tokens.tokens
    tokens = tokens_of(path, CONTENT_PARTS)
    assert tokens and tokens == tokens_of(path, flat)
    two_parts = [{"type": "text", "text": "Cou"}, {"type": "text", "text": "nt:"}]
    assert (
        tokens_of(
            path,
            {
                **CONTENT_PARTS,
                "messages": [{"role": "user", "content": two_parts}, CONTENT_PARTS["messages"][1]],
            },
        )
        == tokens
    )
    # a null content is "" (the template would write "None")
    assert tokens_of(path, {"messages": [{"role": "user", "content": None}]}) == tokens_of(
        path, {"messages": [{"role": "user", "content": ""}]}
    )


def test_the_checks_catch_what_they_are_for():
    """The fuzz tests pass only if their checks can fail: each bad answer below is caught."""
    import datetime
    import json

    from schemathesis.core.failures import FailureGroup

    from kvmesh.common.openapi import router_document
    from tests.fuzz_checks import CHECKS

    schema = schemathesis.openapi.from_dict(router_document("m", 100, auth=False), config=config())
    op = schema["/v1/completions"]["POST"]
    case = op.Case(body={"prompt": "hi"}, media_type="application/json")
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    good = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "usage": usage,
        "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}],
    }
    chunk = {**good, "usage": None}

    def answer(
        status: int, body: bytes, ctype: str = "application/json", **headers
    ) -> httpx.Response:
        request = httpx.Request("POST", "http://127.0.0.1:1/v1/completions", json=case.body)
        response = httpx.Response(
            status, content=body, headers={"content-type": ctype, **headers}, request=request
        )
        response.elapsed = datetime.timedelta(milliseconds=1)
        return response

    def sse(*events: str) -> bytes:
        return "".join(f"data: {e}\n\n" for e in events).encode()

    def caught(response: httpx.Response) -> str | None:
        """The title of the first failure the checks report, or None."""
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:
            return group.exceptions[0].title
        return None

    error = {
        "error": {"message": "x", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert not caught(answer(200, json.dumps(good).encode()))
    assert not caught(answer(200, sse(json.dumps(chunk), "[DONE]"), "text/event-stream"))
    assert not caught(answer(429, json.dumps(error).encode(), **{"retry-after": "1"}))
    bad = [  # (the check's title, an answer it must catch)
        (
            "Server error",
            answer(500, json.dumps({"error": {**error["error"], "type": "server_error"}}).encode()),
        ),
        ("Undocumented status code", answer(418, json.dumps(error).encode())),
        ("Response violates schema", answer(200, json.dumps({**good, "usage": None}).encode())),
        (
            "Response violates schema",
            answer(400, json.dumps({"error": {**error["error"], "code": 400}}).encode()),
        ),
        (
            "Custom check failed: `strict_json`",
            answer(200, json.dumps({**good, "x": float("nan")}).encode()),
        ),
        ("Undocumented Content-Type", answer(200, b"ok", "text/plain")),
        ("Missing required response headers", answer(429, json.dumps(error).encode())),
        (
            "SSE event violates schema",
            answer(200, sse(json.dumps({**chunk, "choices": "x"}), "[DONE]"), "text/event-stream"),
        ),
        (
            "Custom check failed: `strict_json`",
            answer(200, sse(json.dumps(chunk)), "text/event-stream"),
        ),
        (
            "Custom check failed: `strict_json`",
            answer(200, sse(json.dumps(error), json.dumps(chunk), "[DONE]"), "text/event-stream"),
        ),
    ]
    assert [caught(r) for _, r in bad] == [title for title, _ in bad]
