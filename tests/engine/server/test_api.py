"""The OpenAI API of one engine replica, through the official client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh_testing.core_hooks import HookedCoreLoop
from tests.engine.server.conftest import ThreadServer, wait_for

KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            "256",
            "--max-num-seqs",
            "64",
            "--api-key",
            KEY,
            "--max-body-bytes",
            "65536",
        ],
        core_loop=HookedCoreLoop,
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as c:
        yield c


def metrics(http) -> dict[str, float]:
    text = http.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# -- happy paths ------------------------------------------------------------------------------
def test_completion_and_usage(client):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_matches_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_stream_and_not(client):
    messages = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_prefix_cache_reports_cached_tokens(client):
    prompt = "kvmesh shares prefixes " * 20  # many full blocks
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < r.usage.prompt_tokens
    # A different cache salt must not share the blocks (contract 1).
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"cache_salt": "tenant-b"},
    )
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_sampling_parameters(client, server):
    kw = dict(
        model=MODEL,
        prompt="Pick a word:",
        max_tokens=10,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50, "min_p": 0.01},
    )
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b  # seeded sampling is reproducible
    r = client.completions.create(
        model=MODEL,
        prompt="Pick a word:",
        max_tokens=10,
        temperature=0,
        extra_body={"min_tokens": 10, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 10
    # OpenAI's penalties and vLLM's repetition_penalty are applied, not refused.
    plain = (
        client.completions.create(
            model=MODEL,
            prompt="Pick a word:",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    penalised = (
        client.completions.create(
            model=MODEL,
            prompt="Pick a word:",
            max_tokens=12,
            temperature=0,
            frequency_penalty=-2.0,
            presence_penalty=-2.0,
            extra_body={"ignore_eos": True, "repetition_penalty": 0.05},
        )
        .choices[0]
        .text
    )
    assert penalised != plain  # penalties below 0 (and 1) favour what was seen: the text changes
    forced = client.completions.create(
        model=MODEL,
        prompt="Pick a word:",
        max_tokens=4,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == server.state.engine.tokenizer.decode([42] * 4)


def test_continue_final_message_and_chat_template_kwargs(http, server):
    tok = server.state.engine.tokenizer
    msgs = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": msgs,
            "max_tokens": 2,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert r.status_code == 200, r.text
    # the prompt ends inside the assistant's message: no end-of-turn after "The colour is"
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode_chat(msgs, False, True))
    assert len(tok.encode_chat(msgs, False, True)) < len(tok.encode_chat(msgs, False, False))
    both = http.post(
        "/v1/chat/completions", json={"messages": msgs, "continue_final_message": True}
    )
    _err(both, 400, "messages")
    assert "cannot both be true" in both.json()["error"]["message"]
    # template variables pass through (this template has none to change); reserved names are refused
    plain = http.post("/v1/chat/completions", json={"messages": msgs[:1], "max_tokens": 1}).json()
    extra = http.post(
        "/v1/chat/completions",
        json={
            "messages": msgs[:1],
            "max_tokens": 1,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ).json()
    assert extra["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    _err(
        http.post(
            "/v1/chat/completions",
            json={"messages": msgs[:1], "chat_template_kwargs": {"messages": []}},
        ),
        400,
        "messages",
    )
    _err(
        http.post("/v1/chat/completions", json={"messages": msgs[:1], "chat_template_kwargs": [1]}),
        400,
        "chat_template_kwargs",
    )


def test_stop_strings(client):
    base = (
        client.completions.create(model=MODEL, prompt="Count:", max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    words = base.split()
    assert len(words) >= 3
    # A stop string whose first occurrence has text before it: the output is exactly that text
    # (not empty, not the whole base, nothing of the stop string).
    stop = next(w for w in words[1:] if base.find(w) > 0 and base[: base.find(w)].strip())
    head = base[: base.find(stop)]
    r = client.completions.create(
        model=MODEL, prompt="Count:", max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == head and r.choices[0].text.strip()
    # Several stop strings: the earliest in the text wins; one that never occurs changes nothing.
    r = client.completions.create(
        model=MODEL, prompt="Count:", max_tokens=12, temperature=0, stop=["\x00never\x00", stop]
    )
    assert r.choices[0].text == head and r.choices[0].finish_reason == "stop"
    # Streamed, the deltas add up to the same text.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Count:", max_tokens=12, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == head
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["stop"]


def test_token_id_and_list_prompts(client, server):
    tok = server.state.engine.tokenizer
    ids = tok.encode("Hello world")
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    b = client.completions.create(model=MODEL, prompt=["Hello world"], max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs) == 4
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for val, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert val == pytest.approx(max(top.values()))
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    streamed = [
        c
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert [c.token for c in streamed] == [c.token for c in content]


def test_request_id_is_honoured(http):
    r = http.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"X-Request-Id": "rid-123"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-123"
    assert r.json()["id"] == "cmpl-rid-123"
    r = http.post(
        "/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"X-Request-Id": "rid-9"}
    )
    assert r.status_code == 404 and r.headers["x-request-id"] == "rid-9"


def test_models_health_ready_load(http, client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed outside /v1
    assert httpx.get(f"{server.url}/ready").status_code == 200
    load = httpx.get(f"{server.url}/load").json()
    assert load["num_total_blocks"] == 256 and load["draining"] is False
    assert 0.0 <= load["kv_cache_usage"] <= 1.0


# -- errors -----------------------------------------------------------------------------------
def _err(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["message"] and body["type"]
    if param is not None:
        assert body["param"] == param, body
    return body


def test_auth_required_on_v1(server):
    for path in ("/v1/models",):
        assert httpx.get(server.url + path).status_code == 401
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": "Bearer bad"},
    )
    assert _err(r, 401)["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_invalid_json_and_fields(http):
    r = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    _err(r, 400)
    _err(http.post("/v1/completions", json=[1, 2]), 400)
    _err(http.post("/v1/completions", json={"max_tokens": 3}), 400, "prompt")
    _err(
        http.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400, "temperature"
    )
    _err(http.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400, "temperature")
    _err(http.post("/v1/completions", json={"prompt": "x", "top_p": 1.5}), 400, "top_p")
    _err(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _err(http.post("/v1/completions", json={"prompt": "x", "logprobs": 50}), 400, "logprobs")
    _err(http.post("/v1/completions", json={"prompt": "x", "n": 0}), 400, "n")
    _err(http.post("/v1/completions", json={"prompt": "x", "n": 1000}), 400, "n")
    _err(http.post("/v1/completions", json={"prompt": [[1, 2], []]}), 400, "prompt")
    _err(
        http.post("/v1/completions", json={"prompt": "x", "presence_penalty": 2.5}),
        400,
        "presence_penalty",
    )
    _err(
        http.post("/v1/completions", json={"prompt": "x", "frequency_penalty": -3}),
        400,
        "frequency_penalty",
    )
    _err(
        http.post("/v1/completions", json={"prompt": "x", "repetition_penalty": 0}),
        400,
        "repetition_penalty",
    )
    _err(
        http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"abc": 1}}),
        400,
        "logit_bias",
    )
    _err(
        http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 500}}),
        400,
        "logit_bias",
    )
    _err(
        http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"999999999": 1}}),
        400,
        "logit_bias",
    )
    _err(http.post("/v1/completions", json={"prompt": ""}), 400, "prompt")
    _err(http.post("/v1/completions", json={"prompt": [10**9]}), 400, "prompt")
    _err(
        http.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [10**9]}),
        400,
        "stop_token_ids",
    )
    _err(http.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    _err(
        http.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]}),
        400,
        "messages.0.role",
    )
    _err(
        http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        ),
        400,
        "top_logprobs",
    )


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-2)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_prompt_too_long(http, server):
    limit = server.state.engine.max_model_len
    body = _err(
        http.post("/v1/completions", json={"prompt": [5] * (limit + 1), "max_tokens": 1}),
        400,
        "prompt",
    )
    assert str(limit) in body["message"]
    body = _err(
        http.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": limit}),
        400,
        "max_tokens",
    )
    assert str(limit) in body["message"] and body["code"] == "context_length_exceeded"
    body = _err(
        http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "word " * (limit + 10)}]},
        ),
        400,
        "messages",
    )
    assert str(limit) in body["message"]


def test_body_too_large(http):
    r = http.post("/v1/completions", json={"prompt": "x" * 70_000})
    _err(r, 413)

    def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'"}'

    _err(
        http.post(
            "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
        ),
        413,
    )


def test_queue_full_gets_429(http, server, client):
    cfg = server.state.config
    saved = cfg.max_num_seqs, cfg.max_waiting
    cfg.max_num_seqs, cfg.max_waiting = 1, 0
    try:
        with client.completions.create(
            model=MODEL,
            prompt="long",
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ) as stream:
            next(iter(stream))
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            body = _err(r, 429)
            assert body["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    finally:
        cfg.max_num_seqs, cfg.max_waiting = saved
    wait_for(lambda: server.state.engine.num_in_flight == 0)
    assert metrics(http)["kvmesh:requests_rejected_total{reason=queue_full}"] >= 1


HOOKS = "kvmesh_testing.core_hooks"


@pytest.fixture()
def core_hook(server):
    """Run a kvmesh_testing.core_hooks function in the engine core (its process); undone after."""
    engine = server.state.engine
    yield lambda fn, *args: engine.call_utility("hook", f"{HOOKS}:{fn}", *args)
    engine.call_utility("hook", f"{HOOKS}:restore")


def test_engine_failure_is_500_and_server_survives(http, server, core_hook):
    core_hook("fail_step", 2)  # the core's second step from now raises, outside the model run
    r = http.post("/v1/completions", json={"prompt": "boom", "max_tokens": 8})
    assert _err(r, 500)["type"] == "server_error"
    core_hook("restore")
    r = http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_for(lambda: metrics(http)["vllm:kv_cache_usage_perc"] == 0.0)


def test_engine_failure_mid_stream_reports_in_band(http, server, core_hook):
    core_hook("fail_step", 3)
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "boom", "max_tokens": 20, "stream": True}
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2][6:])


# -- cancellation and metrics ------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_blocks(server, client, http):
    before = metrics(http)
    stream = client.completions.create(
        model=MODEL,
        prompt="cancel me " * 30,
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert metrics(http)["vllm:kv_cache_usage_perc"] > 0
    stream.close()  # drop the connection mid-stream
    wait_for(
        lambda: (
            (m := metrics(http))["vllm:num_requests_running"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0.0
        ),
        timeout=15,
    )
    after = metrics(http)
    assert (
        after["vllm:request_success_total{finished_reason=abort}"]
        == before["vllm:request_success_total{finished_reason=abort}"] + 1
    )
    # Far fewer than 1500 tokens were generated for it.
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1000


def test_non_streaming_disconnect_aborts(server, http):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=0.5,
            json={"prompt": "abandon", "max_tokens": 1500, "ignore_eos": True},
        )
    wait_for(lambda: server.state.engine.num_in_flight == 0, timeout=15)
    # The abort reaches the engine between steps: its blocks are freed soon after.
    wait_for(
        lambda: (
            (m := metrics(http))["vllm:num_requests_running"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0.0
        ),
        timeout=15,
    )


def test_metrics_parse_with_vllm_names(http, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=5, temperature=0)
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert name in families, name
        for s in families[name].samples:
            assert s.labels.get("model_name") == MODEL
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:prompt_tokens"].type == "counter"
    m = metrics(http)
    assert m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:inter_token_latency_seconds_count"] >= 4
    assert m["vllm:e2e_request_latency_seconds_count"] >= 1
    assert m["vllm:request_success_total{finished_reason=length}"] >= 1
    assert m["vllm:prefix_cache_hits_total"] <= m["vllm:prefix_cache_queries_total"]
    # What the sidecar's heartbeat reads besides the vLLM gauges: total blocks and restarts.
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels["num_gpu_blocks"] == "256" and info.labels["block_size"] == "16"
    assert families["process_start_time_seconds"].samples[0].value > 0


def test_hundreds_of_concurrent_streams_and_responsive_http(server):
    import asyncio
    import time

    async def one(client, i):
        text, finish = "", None
        async with client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": f"stream {i}", "max_tokens": 8, "temperature": 0, "stream": True},
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return finish

    async def probe(client, stop):
        worst = 0.0
        while not stop.is_set():
            t = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            worst = max(worst, time.perf_counter() - t)
            await asyncio.sleep(0.05)
        return worst

    async def main():
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(
            base_url=server.url,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
            limits=limits,
        ) as client:
            stop = asyncio.Event()
            prober = asyncio.create_task(probe(client, stop))
            finishes = await asyncio.gather(*(one(client, i) for i in range(200)))
            stop.set()
            return finishes, await prober

    finishes, worst_health = asyncio.run(main())
    assert finishes == ["length"] * 200
    assert worst_health < 2.0  # the HTTP side answers while the engine steps


def test_tokenize_and_detokenize(http, server):
    tok = server.state.engine.tokenizer
    r = http.post(
        "/tokenize", json={"prompt": "Hello there, world", "return_token_strs": True}
    ).json()
    assert r["tokens"] == tok.encode("Hello there, world") and r["count"] == len(r["tokens"])
    assert (
        r["max_model_len"] == server.state.engine.max_model_len
        and len(r["token_strs"]) == r["count"]
    )
    msgs = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == tok.encode_chat(msgs) and chat["token_strs"] is None
    # what /tokenize says is what a completion counts
    done = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(
        r["tokens"], skip_special_tokens=False
    )
    _err(http.post("/tokenize", json={}), 400, "prompt")
    _err(http.post("/tokenize", json={"prompt": "x", "messages": msgs}), 400, "prompt")
    _err(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    _err(http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, "model")
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_priority_needs_the_priority_policy(http):
    """`serve` runs sjf by default: a request's non-zero `priority` would mean nothing there, so
    it is refused naming the field (as vLLM's); 0 is every request's default."""
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = {"model": MODEL, "max_tokens": 2, **body}
        _err(http.post(path, json={**body, "priority": 3}), 400, "priority")
        assert http.post(path, json={**body, "priority": 0}).status_code == 200
