"""One bad request never hurts anyone else.

- Every number of the request surface is checked against what the engine can hold (64-bit
  seeds, top_k within the vocabulary, no NaN or infinity anywhere): a 400 naming the field,
  never a crash in an engine step.
- Text that is not valid Unicode (a lone surrogate) is a 400 naming the field, on every route.
- A fault that still happens inside an engine step fails only the request that causes it (the
  server runs the engine core in its own process: the fault is injected there, through a hook).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvmesh_testing.core_hooks import HookedCoreLoop
from tests.engine.server.conftest import ThreadServer, wait_for
from tests.engine.server.test_api import metrics

MODEL = "tiny"
POISON = 7777
HOOKS = "kvmesh_testing.core_hooks"


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            "512",
            "--max-num-seqs",
            "16",
        ],
        core_loop=HookedCoreLoop,
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _err(r: httpx.Response, status: int, param: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"], (
        body
    )
    return body


def _raw(http, path: str, body: str) -> httpx.Response:
    """A body as written (NaN, Infinity, \\ud800 escapes: what json.dumps would not send)."""
    return http.post(path, content=body.encode(), headers={"content-type": "application/json"})


# -- numbers ---------------------------------------------------------------------------------
OUT_OF_RANGE = [
    ('"seed": 18446744073709551616', "seed"),  # 2**64
    ('"seed": -9223372036854775809', "seed"),  # -2**63 - 1
    ('"seed": 18446744073709551615, "n": 2', "seed"),  # sample 1 would be seeded 2**64
    ('"top_k": 1000000', "top_k"),  # above the vocabulary
    ('"top_k": 1000000000000000000000000000000', "top_k"),
    ('"top_k": -2', "top_k"),
    ('"temperature": NaN', "temperature"),
    ('"temperature": Infinity', "temperature"),
    ('"top_p": NaN', "top_p"),
    ('"min_p": -Infinity', "min_p"),
    ('"presence_penalty": NaN', "presence_penalty"),
    ('"frequency_penalty": Infinity', "frequency_penalty"),
    ('"repetition_penalty": Infinity', "repetition_penalty"),
    ('"repetition_penalty": 1e400', "repetition_penalty"),
    ('"logit_bias": {"5": NaN}', "logit_bias"),
    ('"max_tokens": 100000000000000000000000000000000000', "max_tokens"),
    ('"min_tokens": 100000000000000000000000000000000000', "min_tokens"),
    ('"min_tokens": -1', "min_tokens"),
    ('"logprobs": 100000000000000000000000', "logprobs"),
    ('"prompt_logprobs": -1', "prompt_logprobs"),
    ('"n": 100000000000000000000000', "n"),
]


@pytest.mark.parametrize("fields, param", OUT_OF_RANGE)
def test_out_of_range_numbers_are_400_naming_the_field(http, fields, param):
    _err(
        _raw(http, "/v1/completions", '{"prompt": "hi", "max_tokens": 2, ' + fields + "}"),
        400,
        param,
    )


def test_chat_names_its_own_fields(http):
    msgs = [{"role": "user", "content": "hi"}]
    _err(
        http.post(
            "/v1/chat/completions", json={"messages": msgs, "logprobs": True, "top_logprobs": 50}
        ),
        400,
        "top_logprobs",
    )
    _err(
        http.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 0}),
        400,
        "max_completion_tokens",
    )
    _err(
        _raw(
            http,
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "seed": 1e30}',
        ),
        400,
        "seed",
    )


def test_the_edges_of_every_range_are_served(http, server):
    vocab = server.state.engine.vocab_size
    for extra in (
        {"seed": 2**64 - 1, "temperature": 1.0},
        {"seed": -(2**63), "temperature": 1.0},
        {"seed": 2**64 - 3, "n": 3, "temperature": 1.0},
        {"top_k": vocab, "temperature": 1.0},
        {"top_k": -1},
        {"max_tokens": 2**63 - 1},
        {"logprobs": 20},
    ):
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, **extra})
        if (
            "max_tokens" in extra
        ):  # the client's own max_tokens: refused for the context, not the range
            _err(r, 400, "max_tokens")
            assert r.json()["error"]["code"] == "context_length_exceeded"
            continue
        assert r.status_code == 200, (extra, r.text)
        assert len(r.json()["choices"]) == extra.get("n", 1)


# -- text ------------------------------------------------------------------------------------
def test_lone_surrogates_are_400_naming_the_field_on_every_route(http):
    cases = [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["fine", "\\udfff"], "max_tokens": 2}', "prompt.1"),
        (
            "/v1/completions",
            '{"prompt": "x", "stop": ["ok", "\\ud800"], "max_tokens": 2}',
            "stop.1",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages.0.content.0.text",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "\\ud800", "content": "x"}]}',
            "messages.0.role",
        ),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        (
            "/tokenize",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
    ]
    for path, body, param in cases:
        _err(_raw(http, path, body), 400, param)
    # surrogate bytes straight in the UTF-8 body (json.loads would decode them with surrogatepass)
    r = http.post(
        "/v1/completions",
        content=b'{"prompt": "a\xed\xa0\x80b"}',
        headers={"content-type": "application/json"},
    )
    _err(r, 400, "prompt")
    # a surrogate pair is one valid character; an escaped backslash is text
    ok = _raw(
        http, "/v1/completions", '{"prompt": "\\ud83d\\ude00 and \\\\ud800", "max_tokens": 2}'
    )
    assert ok.status_code == 200, ok.text
    stream = _raw(
        http,
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2, "stream": true}',
    )
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")


# -- a fault inside a step ---------------------------------------------------------------------
def test_a_fault_one_request_triggers_fails_it_alone(server, http):
    prompts = [[11 + i, 400 + i, 900 + i, 77, 3000 + i] for i in range(3)]
    body = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    expected = [
        http.post("/v1/completions", json={"prompt": p, **body}).json()["choices"][0]["text"]
        for p in prompts
    ]
    before = metrics(http)

    # The fault, in the engine core's process: any model run that holds the poisoned prompt raises.
    # Steps slowed to 10 ms: the others' 200 tokens last 2 s, so they are still generating when
    # the poisoned requests arrive, however late a loaded machine runs this test's client.
    engine = server.state.engine
    engine.call_utility("hook", f"{HOOKS}:slow_steps", 0.01)
    engine.call_utility("hook", f"{HOOKS}:poison_prompt_token", POISON)

    async def stream(client, prompt, started=None):
        text, error, finish = "", None, None
        async with client.stream(
            "POST", "/v1/completions", json={"prompt": prompt, "stream": True, **body}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    error = obj["error"]
                    continue
                text += obj["choices"][0]["text"]
                finish = obj["choices"][0]["finish_reason"] or finish
                if started is not None:
                    started.set()
        return text, finish, error

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            flags = [asyncio.Event() for _ in prompts]
            others = [asyncio.create_task(stream(client, p, f)) for p, f in zip(prompts, flags)]
            for f in flags:  # all three generating before the poisoned requests arrive
                await f.wait()
            bad, bad_stream = await asyncio.gather(
                client.post("/v1/completions", json={"prompt": [POISON, 5, 6], **body}),
                stream(client, [POISON, 8, 9]),
            )
            return bad, bad_stream, await asyncio.gather(*others)

    try:
        bad, bad_stream, results = asyncio.run(main())
        failed_batches = engine.call_utility("hook", f"{HOOKS}:hook_log")
    finally:
        engine.call_utility("hook", f"{HOOKS}:restore")
    assert bad.status_code == 500, bad.text
    assert (
        bad.json()["error"]["code"] == "engine_error"
        and "injected fault" in bad.json()["error"]["message"]
    )
    assert bad_stream[2] is not None and "injected fault" in bad_stream[2]["message"]
    assert max(failed_batches) > 1  # the poisoned requests shared steps with the others
    for (text, finish, error), want in zip(results, expected):
        assert error is None and finish == "length" and text == want
    after = metrics(http)
    assert after["kvmesh:engine_step_failures_total{scope=request}"] == (
        before["kvmesh:engine_step_failures_total{scope=request}"] + 2
    )
    assert (
        after["kvmesh:engine_step_failures_total{scope=batch}"]
        == before["kvmesh:engine_step_failures_total{scope=batch}"]
    )
    wait_for(lambda: server.state.engine.num_in_flight == 0)
    assert (
        http.post("/v1/completions", json={"prompt": prompts[0], **body}).json()["choices"][0][
            "text"
        ]
        == (expected[0])
    )


def test_a_failure_while_one_output_is_detokenised_ends_that_request_alone(
    server, http, monkeypatch
):
    body = {"prompt": [21, 22, 23, 24], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    expected = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    llm_engine = server.state.engine.engine
    real = llm_engine.process_output

    def process_output(out):
        if out.request_id.startswith("poison"):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(out)

    monkeypatch.setattr(llm_engine, "process_output", process_output)
    before = metrics(http)["kvmesh:engine_step_failures_total{scope=request}"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(
                client.post("/v1/completions", json=body, headers={"X-Request-Id": "poison-1"}),
                *(client.post("/v1/completions", json=body) for _ in range(3)),
            )

    bad, *good = asyncio.run(main())
    assert bad.status_code == 500 and "injected" in bad.json()["error"]["message"]
    assert [r.json()["choices"][0]["text"] for r in good] == [expected] * 3
    wait_for(
        lambda: (
            server.state.engine.num_in_flight == 0 and server.state.engine.stats.num_running == 0
        )
    )
    assert metrics(http)["kvmesh:engine_step_failures_total{scope=request}"] == before + 1
