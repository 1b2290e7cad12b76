"""The router as a front door: bad input is a 400 naming the field, the retry policy
never runs a generation twice, an engine killed mid-stream ends the stream with an error event,
rate-limit charges are bounded and refunded, /metrics labels come from fixed sets, and a 4 MB
prompt is tokenised off the event loop after the cheap checks. Real HTTP on loopback, real
Redis, stub engines as separate processes (killed with SIGKILL where a test says so)."""

import json
import logging
import threading
import time

import httpx
import pytest

from kvmesh.common.ports import free_port
from kvmesh.router.metrics import ROUTES
from tests.conftest import wait_until
from tests.router.test_router import complete, metric, text

VOCAB = 49152  # smollm2-135m-instruct


def raw(base: str, body: bytes | str, path: str = "/v1/completions", **kw) -> httpx.Response:
    return httpx.post(
        base + path, content=body, headers={"content-type": "application/json"}, timeout=20, **kw
    )


BAD = [  # (body, the field the 400 must name)
    ('{"prompt": "hi", "max_tokens": Infinity}', "max_tokens"),
    ('{"prompt": "hi", "max_tokens": 1e999}', "max_tokens"),
    ('{"prompt": "hi", "max_tokens": -3}', "max_tokens"),
    ('{"prompt": "hi", "max_tokens": 2.5}', "max_tokens"),
    ('{"prompt": "hi", "max_tokens": "lots"}', "max_tokens"),
    ('{"prompt": "hi", "n": NaN}', "n"),
    ('{"prompt": "hi", "n": 2.5}', "n"),
    ('{"prompt": "hi", "n": 100000}', "n"),
    ('{"prompt": "hi", "n": 0}', "n"),
    ('{"prompt": [-1, 5, 6]}', "prompt"),
    ('{"prompt": [99999999999]}', "prompt"),
    (f'{{"prompt": [{VOCAB}]}}', "prompt"),
    ('{"prompt": [[1, 2], [3, -4]]}', "prompt"),
    ('{"prompt": [1, "two"]}', "prompt"),
    ('{"prompt": [1.5]}', "prompt"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": {"text": "hi"}}', "prompt"),
    ('{"max_tokens": 5}', "prompt"),
    ('{"prompt": "hi", "cache_salt": 5}', "cache_salt"),
    ('{"prompt": "hi", "cache_salt": ""}', "cache_salt"),
    ('{"prompt": ' + json.dumps(["x"] * 257) + "}", "prompt"),
]
BAD_CHAT = [
    ('{"messages": "hi"}', "messages"),
    ('{"messages": []}', "messages"),
    ('{"messages": ["hi"]}', "messages.0"),
    (
        '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": Infinity}',
        "max_completion_tokens",
    ),
    ('{"messages": [{"role": "user", "content": "hi"}], "cache_salt": ["a"]}', "cache_salt"),
]


def test_bad_input_is_a_json_400_naming_the_field(mesh, router_factory, redis_server, model_name):
    stubs, _ = mesh(1)
    router = router_factory(model=model_name, redis_url=redis_server.url, max_body_bytes=100_000)
    for body, param in BAD + [(b, p) for b, p in BAD_CHAT]:
        path = "/v1/chat/completions" if '"messages"' in body else "/v1/completions"
        resp = raw(router.url, body, path)
        assert resp.status_code == 400, (body, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert (
            err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
        ), (body, err)
    # not JSON, not an object, nested past the parser's recursion limit: 400, never a 500
    for body in ("{not json", "[1, 2]", "[" * 50_000 + "]" * 50_000, b"\xff\xfe"):
        resp = raw(router.url, body)
        assert (
            resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        ), resp.text
    big = raw(router.url, json.dumps({"prompt": "x" * 200_000}))
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    assert stubs[0].stats()["requests"] == 0  # none of that reached an engine
    # what the engine accepts, the router accepts too: the last token id, a numeric string, 5.0
    for body in (
        f'{{"prompt": [{VOCAB - 1}], "max_tokens": 2}}',
        '{"prompt": "hi", "max_tokens": "2"}',
        '{"prompt": [5.0, 6], "n": 1.0, "max_tokens": 2}',
        '{"prompt": "hi", "cache_salt": "tenant-a"}',
    ):
        assert raw(router.url, body).status_code == 200, body
    assert metric(router.url, "kvmesh_router_internal_errors_total") == 0
    assert metric(
        router.url, "kvmesh_router_requests_total", route="/v1/completions", status="400"
    ) >= len(BAD)


def test_router_limits_match_the_engines():
    import argparse

    from kvmesh.common import request_limits
    from kvmesh.engine.server.api import ServerConfig
    from kvmesh.engine.server.cli import add_arguments as engine_args
    from kvmesh.router import app, request_checks
    from kvmesh.router.cli import add_arguments as router_args

    assert (request_checks.MAX_N, request_checks.MAX_PROMPTS) == (
        request_limits.MAX_N,
        request_limits.MAX_PROMPTS,
    )
    assert request_checks.INT_FIELDS["/v1/completions"]["n"] == (1, request_limits.MAX_N)
    assert app.RouterConfig().max_body_bytes == ServerConfig("m").max_body_bytes
    pe, pr = argparse.ArgumentParser(), argparse.ArgumentParser()
    engine_args(pe)
    router_args(pr)
    assert pe.parse_args([]).max_body_bytes == pr.parse_args([]).max_body_bytes
    # the vocabulary bound is the model's own (config.json), as the engine's check_token_ids
    router = app.Router(app.RouterConfig(model="smollm2-135m-instruct", redis_url=None))
    assert router.vocab_size == VOCAB


# -- retries ------------------------------------------------------------------------------------
def test_a_5xx_caused_by_the_request_is_neither_retried_nor_counted(
    mesh, router_factory, redis_server, model_name
):
    stubs, _ = mesh(2)
    for s in stubs:
        s.config(fail_status=500)
    router = router_factory(model=model_name, redis_url=redis_server.url, eject_after=1)
    results = [complete(router.url, text(300 + i, 30)) for i in range(4)]
    assert [r.status_code for r in results] == [500] * 4
    assert sum(s.stats()["failed"] for s in stubs) == 4  # each generation ran once, nowhere else
    assert metric(router.url, "kvmesh_router_retries_total") == 0
    assert metric(router.url, "kvmesh_router_ejections_total") == 0


def test_a_429_goes_to_a_pod_with_room_else_back_to_the_client(
    mesh, router_factory, redis_server, model_name
):
    stubs, _ = mesh(2)
    stubs[0].config(fail_status=429)
    router = router_factory(model=model_name, redis_url=redis_server.url, eject_after=1)
    results = [complete(router.url, text(310 + i, 30)) for i in range(6)]
    assert all(r.status_code == 200 and r.headers["x-kvmesh-pod"] == "pod-1" for r in results), [
        (r.status_code, r.text) for r in results
    ]
    assert (
        stubs[0].stats()["failed"] >= 1
        and metric(router.url, "kvmesh_router_retries_total", reason="status_429") >= 1
    )
    assert metric(router.url, "kvmesh_router_ejections_total") == 0  # full is not broken
    stubs[1].config(fail_status=429)  # nobody has room: the client gets the 429 and its Retry-After
    full_until = router.router.traffic.full_until
    wait_until(
        lambda: all(not full_until.get(p, 0) > time.monotonic() for p in ("pod-0", "pod-1")),
        5,
        msg="429 marks expired",
    )
    busy = complete(router.url, text(320, 30))
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"


def _running_stub(stubs):
    return next((s for s in stubs if s.proc.poll() is None and s.stats()["running"] == 1), None)


def _kill_while_running(mesh, router_factory, redis_server, model_name, **router_kw):
    """A non-streamed request whose engine is killed while it generates: (response, the other stub, router)."""
    stubs, _ = mesh(2)
    for s in stubs:
        s.config(token_delay=1.0)  # a non-streamed answer after 8 tokens x 1 s
    router = router_factory(
        model=model_name, redis_url=redis_server.url, eject_after=1, **router_kw
    )
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("resp", complete(router.url, text(330, 30))))
    t.start()
    victim = wait_until(lambda: _running_stub(stubs), 10, msg="an engine runs the request")
    victim.kill()
    t.join(30)
    return out["resp"], next(s for s in stubs if s is not victim), router


def test_an_engine_dying_after_the_request_was_sent_is_not_retried_without_resumes(
    mesh, router_factory, redis_server, model_name
):
    resp, other, router = _kill_while_running(
        mesh, router_factory, redis_server, model_name, max_resumes=0
    )
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_disconnected", (
        resp.text
    )
    assert other.stats()["requests"] == 0  # never run twice
    assert metric(router.url, "kvmesh_router_upstream_failures_total", phase="before_response") == 1
    assert metric(router.url, "kvmesh_router_ejections_total") == 0


def test_a_non_streamed_request_whose_engine_died_is_answered_by_another(
    mesh, router_factory, redis_server, model_name
):
    resp, other, router = _kill_while_running(mesh, router_factory, redis_server, model_name)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"].count(" tok") == 4, (
        resp.text
    )
    assert other.stats()["requests"] == 1  # sent again, once
    assert metric(router.url, "kvmesh_router_resumed_requests_total", phase="before_response") == 1
    assert metric(router.url, "kvmesh_router_upstream_failures_total", phase="before_response") == 1
    assert metric(router.url, "kvmesh_router_requests_total", status="200") == 1


@pytest.fixture
def asgi_errors(caplog):
    """Records of uvicorn's "Exception in ASGI application" (the app let something raise)."""
    caplog.set_level(logging.ERROR, logger="uvicorn.error")
    return lambda: [
        r for r in caplog.records if r.name.startswith("uvicorn") and r.levelno >= logging.ERROR
    ]


def test_an_engine_killed_mid_stream_ends_the_stream_with_an_error_event(
    mesh, router_factory, redis_server, model_name, asgi_errors
):
    stubs, _ = mesh(1)
    stubs[0].config(token_delay=0.2, response_tokens=100)
    # the only replica, and no waiting for it to come back (by default the stream would wait
    # --resume-timeout, 60 s, for a replica): the failure goes to the client
    router = router_factory(model=model_name, redis_url=redis_server.url, resume_timeout=0)
    body = {"prompt": "a long story", "max_tokens": 100, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] == " tok0"
        stubs[0].kill()
        rest = [line for line in lines if line.startswith("data: ")]  # the stream ends, cleanly
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["type"] == "upstream_error" and "mid-stream" in err["message"]
    assert metric(router.url, "kvmesh_router_upstream_failures_total", phase="mid_stream") == 1
    assert metric(router.url, "kvmesh_router_resume_given_up_total", reason="no_replica") == 1
    assert metric(router.url, "kvmesh_router_internal_errors_total") == 0
    assert asgi_errors() == []
    assert httpx.get(router.url + "/health").status_code == 200


def test_an_engine_killed_before_the_first_event_is_a_502(
    mesh, router_factory, redis_server, model_name, asgi_errors
):
    stubs, _ = mesh(1)
    stubs[0].config(token_delay=5.0)  # the status line is out at once, the first event in 5 s
    # the only replica, and no waiting for it to come back: the failure goes to the client
    router = router_factory(model=model_name, redis_url=redis_server.url, resume_timeout=0)
    out = {}

    def go():
        body = {"prompt": "hello", "max_tokens": 4, "stream": True}
        out["resp"] = httpx.post(router.url + "/v1/completions", json=body, timeout=20)

    t = threading.Thread(target=go)
    t.start()
    wait_until(lambda: stubs[0].stats()["running"] == 1, 10, msg="the engine runs it")
    stubs[0].kill()
    t.join(20)
    resp = out["resp"]
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "upstream_error", resp.text
    assert metric(router.url, "kvmesh_router_upstream_failures_total", phase="before_response") == 1
    assert asgi_errors() == []


# -- rate limits ----------------------------------------------------------------------------------
def test_rate_limit_charge_is_refunded_when_the_engine_refuses_or_uses_less(
    mesh, router_factory, redis_server, model_name
):
    stubs, _ = mesh(1)
    router = router_factory(model=model_name, redis_url=redis_server.url, rate_limit_tpm=1000)
    stubs[0].config(fail_status=400, fail_count=1)  # the engine refuses the first request
    assert complete(router.url, "hello", max_tokens=900).status_code == 400
    # refunded: the same request fits again; the stub answers 8 tokens, the rest is refunded too
    assert complete(router.url, "hello", max_tokens=900).status_code == 200
    assert complete(router.url, "hello", max_tokens=900).status_code == 200
    assert metric(router.url, "kvmesh_router_rate_limited_total") == 0


# -- /metrics ---------------------------------------------------------------------------------------
def test_junk_paths_do_not_grow_metrics(mesh, router_factory, redis_server, model_name):
    from kvmesh.router.auth import parse_keys

    mesh(1)
    open_router = router_factory(model=model_name, redis_url=redis_server.url)
    locked = router_factory(
        model=model_name, redis_url=redis_server.url, api_keys=parse_keys("sk-x")
    )
    for i in range(15):
        assert (
            httpx.post(open_router.url + f"/v1/junk-{i}", json={}).status_code == 404
        )  # the engine's 404
        assert httpx.post(locked.url + f"/v1/junk-{i}", json={}).status_code == 401
        assert httpx.get(locked.url + f"/junk-{i}").status_code == 404
        assert httpx.post(locked.url + f"/v1/completions?x={i}", json={}).status_code == 401
    from kvmesh.common.engine_load import parse_prometheus

    for router in (open_router, locked):
        page = httpx.get(router.url + "/metrics").text
        assert "junk" not in page
        routes = {lab["route"] for n, lab, _ in parse_prometheus(page) if "route" in lab}
        assert routes <= ROUTES | {"other"} and "other" in routes
        statuses = {lab["status"] for n, lab, _ in parse_prometheus(page) if "status" in lab}
        assert statuses <= {"401", "404"}, statuses
    assert metric(locked.url, "kvmesh_router_requests_total", route="other", status="401") == 15


# -- tokenisation off the loop, after the cheap checks -------------------------------------------------
def test_a_4mb_prompt_does_not_stall_health_and_a_limited_client_costs_no_tokenizing(
    router_factory,
):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the request ends in a 502 after tokenizing
    # (no holding: with it, a request no engine accepted waits for one to come back)
    router = router_factory(
        model="m",
        redis_url=None,
        static_backends=[dead],
        rate_limit_rpm=1,
        max_retries=0,
        scale_from_zero_timeout=0,
    )
    words = text(7, 60).split()
    prompt = " ".join(words[i % len(words)] + str(i % 1000) for i in range(450_000))[:3_900_000]
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("resp", complete(router.url, prompt)))
    latencies = []
    t.start()
    while t.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(router.url + "/health", timeout=10).status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.02)
    assert out["resp"].status_code == 502
    tokenizing = metric(router.url, "kvmesh_router_tokenize_seconds_sum")
    assert metric(router.url, "kvmesh_router_tokenize_seconds_count") == 1
    # it took a while, and /health was asked throughout (how many times depends on the machine's
    # speed). Had the tokenizer run on the event loop, the probe in flight when it started would have
    # waited for all of it but the probe interval (20 ms): no probe may take most of that time.
    assert tokenizing > 0.15 and len(latencies) >= 2, (tokenizing, latencies)
    assert max(latencies) < tokenizing * 0.7, (max(latencies), tokenizing)
    # over its limit (1 request a minute): refused before the tokenizer runs
    limited = complete(router.url, prompt)
    assert limited.status_code == 429
    assert metric(router.url, "kvmesh_router_tokenize_seconds_count") == 1
