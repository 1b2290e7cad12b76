import json
import logging
import threading

import httpx
import pytest

from kvmesh.common import redis_layout as rl
from kvmesh.router.auth import hash_key
from kvmesh.router.scoring import Weights, rendezvous
from tests.conftest import wait_until

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega"
).split()


def text(seed: int, n: int = 200) -> str:
    return " ".join(
        WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] + str(seed) for i in range(n)
    )


def complete(base: str, prompt: str, **kw) -> httpx.Response:
    headers = kw.pop("headers", {})
    return httpx.post(
        base + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, **kw},
        headers=headers,
        timeout=20,
    )


def metric(base: str, name: str, **labels) -> float:
    from kvmesh.common.engine_load import parse_prometheus

    total = 0.0
    for n, lab, v in parse_prometheus(httpx.get(base + "/metrics", timeout=5).text):
        if n == name and all(lab.get(k) == v2 for k, v2 in labels.items()):
            total += v
    return total


def blocks_in_redis(r, model, pod) -> int:
    return r.scard(rl.blocks_key(model, pod))


def wait_blocks_settled(r, model, pod, timeout: float = 10.0) -> int:
    """Wait until the pod's block set in Redis is non-empty and has stopped growing (the sidecar
    has published every block of the last request), instead of sleeping a fixed time."""
    seen = []

    def settled():
        seen.append(blocks_in_redis(r, model, pod))
        return seen[-1] > 0 and len(seen) >= 4 and len(set(seen[-4:])) == 1

    wait_until(settled, timeout, interval=0.1, msg=f"{pod}'s blocks settled")
    return seen[-1]


def router_sees(router, pod: str, **fields) -> bool:
    p = router.router.discovery.pods.get(pod)
    return p is not None and all(getattr(p, k) == v for k, v in fields.items())


def test_routing_follows_the_longest_prefix(mesh, router_factory, redis_server, model_name):
    stubs, _ = mesh(3)
    r = redis_server.client()
    prompt = text(1, 300)
    # Seed: pod-1 holds a short prefix of the prompt, pod-2 a long one (requests straight to the engines).
    complete(stubs[1].url, prompt[:200])
    complete(stubs[2].url, prompt[:1200])
    wait_until(
        lambda: (
            blocks_in_redis(r, model_name, "pod-1") > 0
            and blocks_in_redis(r, model_name, "pod-2") > 5
        ),
        5,
        msg="seeded",
    )
    router = router_factory(model=model_name, redis_url=redis_server.url)
    resp = complete(router.url, prompt)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvmesh-pod"] == "pod-2"
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 5 * 16
    # the router's prediction equals what the engine reports
    assert metric(router.url, "kvmesh_router_predicted_cached_tokens_total") == cached
    assert metric(router.url, "kvmesh_router_engine_cached_tokens_total") == cached
    assert (
        metric(router.url, "kvmesh_router_decisions_total", policy="prefix", reason="prefix_match")
        == 1
    )
    # A request scoring its prompt reads nothing from the cache: no prefix is matched, none predicted.
    scored = complete(router.url, prompt, prompt_logprobs=1)
    assert scored.status_code == 200
    assert metric(router.url, "kvmesh_router_predicted_cached_tokens_total") == cached
    assert (
        metric(router.url, "kvmesh_router_decisions_total", policy="prefix", reason="scores_prompt")
        == 1
    )
    # A new prompt lands somewhere; its continuation follows it there.
    other = text(2, 200)
    first = complete(router.url, other).headers["x-kvmesh-pod"]
    wait_blocks_settled(r, model_name, first)
    again = complete(router.url, other + " and a continuation of the same conversation")
    assert again.headers["x-kvmesh-pod"] == first
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_cold_prompts_sharing_a_system_prompt_spread_over_pods(
    mesh, router_factory, redis_server, model_name
):
    """Every pod holds the shared system prompt, none holds the rest: the tie breaks on each prompt's
    own last block, so new conversations spread instead of all landing on one pod. (Load and KV
    weights are off, so only the match and the tie-break decide.)"""
    stubs, _ = mesh(3)
    r = redis_server.client()
    system = text(9, 120)
    for stub in stubs:
        complete(stub.url, system)
    wait_until(
        lambda: all(blocks_in_redis(r, model_name, f"pod-{i}") > 3 for i in range(3)),
        5,
        msg="seeded",
    )
    router = router_factory(
        model=model_name, redis_url=redis_server.url, weights=Weights(1.0, 0.0, 0.0)
    )
    pods = [
        complete(router.url, system + " " + text(100 + i, 40)).headers["x-kvmesh-pod"]
        for i in range(9)
    ]
    assert len(set(pods)) >= 2, pods


def test_chat_is_tokenized_like_the_engine(mesh, router_factory, redis_server, model_name):
    stubs, _ = mesh(2)
    router = router_factory(model=model_name, redis_url=redis_server.url)
    msgs = [
        {"role": "system", "content": "You are a meticulous assistant. " * 20},
        {"role": "user", "content": "Explain prefix caching."},
    ]
    first = httpx.post(router.url + "/v1/chat/completions", json={"messages": msgs}, timeout=20)
    assert first.status_code == 200
    pod = first.headers["x-kvmesh-pod"]
    r = redis_server.client()
    wait_blocks_settled(r, model_name, pod)
    msgs2 = msgs + [
        {"role": "assistant", "content": "It reuses KV blocks."},
        {"role": "user", "content": "More?"},
    ]
    second = httpx.post(router.url + "/v1/chat/completions", json={"messages": msgs2}, timeout=20)
    assert second.headers["x-kvmesh-pod"] == pod
    predicted = metric(router.url, "kvmesh_router_predicted_cached_tokens_total")
    assert predicted > 0 and predicted == metric(
        router.url, "kvmesh_router_engine_cached_tokens_total"
    )


def test_hotspot_guard_moves_load_off_a_saturated_pod(
    mesh, router_factory, redis_server, model_name
):
    stubs, _ = mesh(2)
    r = redis_server.client()
    prompt = text(3, 300)
    complete(stubs[0].url, prompt)
    wait_until(lambda: blocks_in_redis(r, model_name, "pod-0") > 5, 5)
    # Prefix only: the load terms of the score cannot move the request, only the guard can.
    router = router_factory(
        model=model_name, redis_url=redis_server.url, weights=Weights(1.0, 0.0, 0.0)
    )
    assert complete(router.url, prompt).headers["x-kvmesh-pod"] == "pod-0"
    stubs[0].config(waiting=40)  # saturated: far above pod-1's load
    wait_until(
        lambda: router_sees(router, "pod-0", waiting=40), 10, msg="router sees pod-0 saturated"
    )
    resp = complete(router.url, prompt)
    assert resp.status_code == 200 and resp.headers["x-kvmesh-pod"] == "pod-1"
    assert metric(router.url, "kvmesh_router_decisions_total", reason="hotspot_guard") >= 1


def test_killed_replica_is_routed_around(mesh, router_factory, redis_server, model_name):
    stubs, _ = mesh(3)
    router = router_factory(model=model_name, redis_url=redis_server.url)
    prompts = [text(10 + i, 120) for i in range(6)]
    pods = {complete(router.url, p).headers["x-kvmesh-pod"] for p in prompts}
    victim = sorted(pods)[0]
    stubs[int(victim.split("-")[1])].kill()
    results = [complete(router.url, p) for p in prompts * 3]  # half of these prefer the dead pod
    assert all(x.status_code == 200 for x in results), [
        x.text for x in results if x.status_code != 200
    ]
    assert all(x.headers["x-kvmesh-pod"] != victim for x in results)


def test_redis_killed_mid_run_every_request_succeeds(own_redis, mesh, router_factory, model_name):
    stubs, _ = mesh(2, redis=own_redis)
    router = router_factory(model=model_name, redis_url=own_redis.url, redis_stale_after=1.0)
    prompts = [text(20 + i, 150) for i in range(5)]
    for p in prompts:
        assert complete(router.url, p).status_code == 200
    own_redis.kill()
    for p in prompts * 3:  # at once: the last known heartbeats, no block sets
        resp = complete(router.url, p)
        assert resp.status_code == 200, resp.text
    assert metric(router.url, "kvmesh_router_redis_errors_total") > 0
    assert (
        metric(router.url, "kvmesh_router_decisions_total", reason="redis_unavailable")
        == len(prompts) * 3
    )
    # After --redis-stale-after the Redis view expires: the platform's pods, by load only.
    wait_until(
        lambda: (
            httpx.get(router.url + "/ready").json()["discovery"]["fallback"] == "redis_unavailable"
        ),
        10,
        msg="router falls back to load-only routing",
    )
    assert metric(router.url, "kvmesh_router_discovery_fallback") == 1
    assert httpx.get(router.url + "/ready").json()["block_sets"] == "no current Redis view"
    after = [complete(router.url, p) for p in prompts + [text(200 + i, 60) for i in range(10)]]
    assert all(r.status_code == 200 for r in after), [r.text for r in after if r.status_code != 200]
    # Both pods still used: with the stale load figures dropped, equal scores are broken by the prompt.
    assert {r.headers["x-kvmesh-pod"] for r in after} == {"pod-0", "pod-1"}
    own_redis.start()
    wait_until(
        lambda: (lambda d: d["redis"] and d["discovery"]["fallback"] is None)(
            httpx.get(router.url + "/ready").json()
        ),
        10,
        msg="router sees redis again",
    )
    assert metric(router.url, "kvmesh_router_discovery_fallback") == 0
    wait_until(
        lambda: httpx.get(router.url + "/ready").json()["block_sets"] == "usable",
        5,
        msg="block sets usable again",
    )
    before = metric(router.url, "kvmesh_router_decisions_total", reason="redis_unavailable")
    assert all(complete(router.url, p).status_code == 200 for p in prompts)
    assert metric(router.url, "kvmesh_router_decisions_total", reason="redis_unavailable") == before


def test_redis_restart_fails_no_call_on_the_pooled_connections(
    own_redis, mesh, router_factory, model_name
):
    """After Redis restarts, every connection in the router's pool is dead. Each is reconnected on
    its first use (a connection error is retried once): no call fails, so the block sets are never
    paused (without the retry each dead connection failed one call and paused them for 1 s)."""
    from concurrent.futures import ThreadPoolExecutor

    mesh(2, redis=own_redis)
    # Discovery reads Redis every 2 s here, so that it rarely calls while Redis is down.
    router = router_factory(model=model_name, redis_url=own_redis.url, refresh_interval=2.0)
    prompts = [text(300 + i, 150) for i in range(8)]

    def burst():  # concurrent requests: concurrent prefix lookups, several pooled connections
        with ThreadPoolExecutor(8) as ex:
            return [r.status_code for r in ex.map(lambda p: complete(router.url, p), prompts)]

    assert burst() == [200] * 8
    own_redis.kill()
    own_redis.start()
    r = own_redis.client()
    wait_until(
        lambda: all(r.exists(rl.heartbeat_key(model_name, f"pod-{i}")) for i in range(2)),
        10,
        msg="the sidecars' heartbeats back in Redis",
    )
    errors = metric(router.url, "kvmesh_router_redis_errors_total")
    assert burst() == [200] * 8
    wait_until(
        lambda: httpx.get(router.url + "/ready").json()["discovery"]["redis_view_age_s"] < 1.0,
        10,
        msg="a discovery read after the restart",
    )
    assert metric(router.url, "kvmesh_router_redis_errors_total") == errors
    assert metric(router.url, "kvmesh_router_decisions_total", reason="redis_unavailable") == 0


def test_two_routers_on_one_redis_pick_the_same_pod(mesh, router_factory, redis_server, model_name):
    """Two routers agree because the tie-break is deterministic, not because the first request
    left blocks behind: the engines publish no KV events (--no-tokenize), so no block set ever
    holds a key and every pod scores the same; both routers must still pick the same pod, the
    rendezvous winner of the prompt's last block key, and different prompts spread."""
    mesh(3, "--no-tokenize")
    a = router_factory(model=model_name, redis_url=redis_server.url)
    b = router_factory(model=model_name, redis_url=redis_server.url)
    pods = [f"pod-{i}" for i in range(3)]
    r = redis_server.client()

    def idle():  # both routers see every pod unloaded (no heartbeat caught a request in flight)
        return all(router_sees(rt, p, running=0, waiting=0) for rt in (a, b) for p in pods)

    picks = []
    for i in range(10):
        p = text(30 + i, 100 + 10 * i)
        wait_until(idle, 10, msg="pods idle")
        pa = complete(a.url, p).headers["x-kvmesh-pod"]
        wait_until(idle, 10, msg="pods idle")
        pb = complete(b.url, p).headers["x-kvmesh-pod"]
        assert pa == pb, (i, pa, pb)
        _, keys = b.router.prompt_tokens.tokens_and_keys(
            "/v1/completions", {"prompt": p}, False, False
        )
        tie = keys[-1].to_bytes(8, "little")
        assert pa == max(pods, key=lambda name: rendezvous(tie, name)), i
        picks.append(pa)
    assert len(set(picks)) >= 2, picks  # not one pod for everything
    assert all(r.scard(rl.blocks_key(model_name, p)) == 0 for p in pods)  # no cache state to follow
    for rt in (a, b):
        assert metric(rt.url, "kvmesh_router_decisions_total", reason="no_match") == 10


def test_auth_rate_limits_body_limit_and_no_secrets_in_logs(
    mesh, router_factory, redis_server, model_name, caplog
):
    mesh(1)
    keys = {hash_key("sk-alpha"): None, hash_key("sk-beta"): None}
    from kvmesh.router.auth import parse_keys

    parsed = parse_keys(f"sk-alpha rpm=3\nsha256:{hash_key('sk-beta')} tpm=300\n")
    assert set(parsed) == set(keys)
    router = router_factory(
        model=model_name, redis_url=redis_server.url, api_keys=parsed, max_body_bytes=20000
    )
    caplog.set_level(logging.INFO)
    assert complete(router.url, "hi").status_code == 401
    assert complete(router.url, "hi", headers={"Authorization": "Bearer nope"}).status_code == 401
    alpha = {"Authorization": "Bearer sk-alpha"}
    assert [complete(router.url, "hi", headers=alpha).status_code for _ in range(3)] == [200] * 3
    limited = complete(router.url, "hi", headers=alpha)
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["type"] == "rate_limit_error"
    beta = {"Authorization": "Bearer sk-beta"}
    assert complete(router.url, text(40, 60), headers=beta).status_code == 200  # ~120 tokens
    tok = complete(router.url, text(41, 200), headers=beta)  # ~400 tokens > what is left of 300/min
    assert tok.status_code == 429 and "tokens" in tok.json()["error"]["message"]
    big = complete(router.url, "x" * 30000, headers=alpha)
    assert big.status_code == 413
    assert httpx.get(router.url + "/v1/models", timeout=5).status_code == 401
    assert (
        httpx.get(router.url + "/v1/models", headers=beta, timeout=5).json()["data"][0]["id"]
        == model_name
    )
    logged = "\n".join(
        r.getMessage() + json.dumps(getattr(r, "fields", {})) for r in caplog.records
    )
    assert "sk-alpha" not in logged and "sk-beta" not in logged
    assert metric(router.url, "kvmesh_router_rate_limited_total") == 2


def test_streaming_passthrough_and_request_id(mesh, router_factory, redis_server, model_name):
    stubs, _ = mesh(1)
    router = router_factory(model=model_name, redis_url=redis_server.url)
    body = {
        "prompt": text(50, 100),
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        router.url + "/v1/completions",
        json=body,
        headers={"X-Request-Id": "req-abc.1"},
        timeout=20,
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(
            "text/event-stream"
        )
        assert resp.headers["x-request-id"] == "req-abc.1"
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:5]] == [
        f" tok{i}" for i in range(5)
    ]
    assert "req-abc.1" in stubs[0].stats()["request_ids"]
    # the usage chunk of the stream feeds the prediction metrics too
    assert (
        metric(router.url, "kvmesh_router_requests_total", route="/v1/completions", status="200")
        == 1
    )
    # a generated id when the client sends none (or an unsafe one)
    resp = complete(router.url, "hello", headers={"X-Request-Id": "bad id\twith spaces"})
    assert len(resp.headers["x-request-id"]) == 32
    assert resp.headers["x-request-id"] in stubs[0].stats()["request_ids"]
    # vLLM's /tokenize goes through to an engine like the /v1 routes
    tok = httpx.post(router.url + "/tokenize", json={"prompt": "hello world"}, timeout=20)
    assert tok.status_code == 200 and tok.headers["x-kvmesh-pod"] == "pod-0"
    assert tok.json()["tokens"] == router.router.encoder.encode("hello world")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_engine_request(
    mesh, router_factory, redis_server, model_name, stream
):
    stubs, _ = mesh(1)
    stubs[0].config(token_delay=0.2, response_tokens=100)
    router = router_factory(model=model_name, redis_url=redis_server.url)
    body = {"prompt": "tell me a long story", "max_tokens": 100, "stream": stream}
    if stream:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=20) as resp:
            next(resp.iter_lines())  # the first token arrived: now hang up
    else:

        def go():
            try:
                httpx.post(router.url + "/v1/completions", json=body, timeout=0.5)
            except httpx.TimeoutException:
                pass  # the client gives up: the connection closes

        t = threading.Thread(target=go)
        t.start()
        t.join()
    wait_until(lambda: stubs[0].stats()["cancelled"] == 1, 5, msg="engine saw the cancellation")
    assert stubs[0].stats()["running"] == 0
    wait_until(lambda: metric(router.url, "kvmesh_router_client_disconnects_total") == 1, 5)


def test_not_me_answers_are_retried_then_the_pod_ejected(
    mesh, router_factory, redis_server, model_name
):
    """A 503 ("not me": draining, loading) goes to the next pod and counts against the breaker."""
    stubs, _ = mesh(2)
    stubs[0].config(fail_status=503)
    router = router_factory(
        model=model_name, redis_url=redis_server.url, eject_after=2, eject_seconds=30
    )
    results = [complete(router.url, text(60 + i, 50)) for i in range(8)]
    assert all(x.status_code == 200 and x.headers["x-kvmesh-pod"] == "pod-1" for x in results)
    assert metric(router.url, "kvmesh_router_ejections_total", pod="pod-0") == 1
    assert (
        1 <= metric(router.url, "kvmesh_router_retries_total", reason="status_503") <= 2
    )  # ejected after two
    assert stubs[0].stats()["failed"] == 2
    # every pod failing: the last answer is passed through, not hidden
    stubs[1].config(fail_status=503)
    bad = complete(router.url, "x")
    assert bad.status_code == 503 and bad.headers["retry-after"] == "1"


def test_draining_pod_is_not_routed_to(mesh, router_factory, redis_server, model_name):
    stubs, _ = mesh(2)
    r = redis_server.client()
    stubs[1].config(draining=True)
    wait_until(lambda: r.hget(rl.heartbeat_key(model_name, "pod-1"), "state") == "draining", 5)
    router = router_factory(model=model_name, redis_url=redis_server.url)
    assert {complete(router.url, text(70 + i, 40)).headers["x-kvmesh-pod"] for i in range(6)} == {
        "pod-0"
    }


def test_policies_round_robin_session_least_load_and_static(
    mesh, router_factory, redis_server, model_name
):
    stubs, _ = mesh(2)
    rr = router_factory(model=model_name, redis_url=redis_server.url, policy="round-robin")
    seen = [complete(rr.url, "same prompt " * 40).headers["x-kvmesh-pod"] for _ in range(4)]
    assert seen in (["pod-0", "pod-1"] * 2, ["pod-1", "pod-0"] * 2)
    sess = router_factory(model=model_name, redis_url=redis_server.url, policy="session")
    by_session = {}
    for sid in ("user-0", "user-1", "user-2", "user-3", "user-4"):
        # Different prompts (which the prefix policy would spread) stay on the session's pod: the
        # rendezvous winner of the session id; and the sessions spread over both pods.
        pods = {
            complete(sess.url, text(80 + i, 30), headers={"X-Session-Id": sid}).headers[
                "x-kvmesh-pod"
            ]
            for i in range(3)
        }
        assert len(pods) == 1
        by_session[sid] = pods.pop()
        assert by_session[sid] == max(
            ["pod-0", "pod-1"], key=lambda name: rendezvous(sid.encode(), name)
        ), sid
    assert set(by_session.values()) == {"pod-0", "pod-1"}, by_session
    assert metric(sess.url, "kvmesh_router_decisions_total", reason="session") == 15
    stubs[0].config(running_extra=3)
    r = redis_server.client()
    wait_until(lambda: r.hget(rl.heartbeat_key(model_name, "pod-0"), "running") == "3", 5)
    ll = router_factory(model=model_name, redis_url=redis_server.url, policy="least-load")
    wait_until(lambda: router_sees(ll, "pod-0", running=3), 10, msg="router sees pod-0's load")
    assert {complete(ll.url, text(90 + i, 30)).headers["x-kvmesh-pod"] for i in range(3)} == {
        "pod-1"
    }
    static = router_factory(
        model=model_name, redis_url=None, static_backends=[s.url for s in stubs]
    )
    assert httpx.get(static.url + "/ready").status_code == 200
    assert {complete(static.url, text(95 + i, 30)).status_code for i in range(3)} == {200}
