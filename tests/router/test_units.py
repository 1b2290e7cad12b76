"""Unit tests of the pure parts: scoring, auth and rate limits, metrics parsing, layout."""

import asyncio
import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.common import redis_layout as rl
from kvmesh.common.engine_load import engine_load
from kvmesh.router.auth import ApiKeys, RateLimiter, hash_key, load_keys, parse_keys
from kvmesh.router.scoring import Candidate, Weights, check_hotspot_params, rank


def cands(*specs):
    return [
        Candidate(name, f"http://{name}", kv_usage=kv, load=load, matched_blocks=m)
        for name, kv, load, m in specs
    ]


def test_score_prefers_the_longest_prefix_then_load():
    ordered = rank(cands(("a", 0.1, 0, 2), ("b", 0.1, 0, 8), ("c", 0.1, 0, 0)), 10, Weights(), b"k")
    assert [c.name for c in ordered] == ["b", "a", "c"]
    # equal prefix: the less loaded / less full pod wins
    ordered = rank(cands(("a", 0.9, 2, 5), ("b", 0.2, 2, 5)), 10, Weights(), b"k")
    assert ordered[0].name == "b"
    # the score formula itself
    (c,) = rank(cands(("a", 0.4, 3, 5)), 10, Weights(prefix=1.0, kv=0.5, queue=0.5), b"k")
    assert c.score == pytest.approx(0.5 - 0.2 - 0.5)


def test_hotspot_guard_skips_a_far_hotter_pod_unless_all_are():
    # The hot pod holds the whole prefix (the best score) and still goes last.
    ordered = rank(
        cands(("hot", 0.5, 30, 10), ("cool", 0.5, 1, 0), ("cool2", 0.5, 2, 0)), 10, Weights(), b"k"
    )
    assert ordered[0].name == "cool" and ordered[-1].name == "hot" and ordered[-1].hot
    assert max(ordered, key=lambda c: c.score).name == "hot"
    # Just over the line (30 > 2 x 14 + 1) is hot, on it (29 = 2 x 14 + 1) is not.
    assert [
        c.hot
        for c in rank(cands(("a", 0, 30, 0), ("b", 0, 14, 0)), 1, Weights(), b"k", 2.0, 1)
        if c.name == "a"
    ] == [True]
    assert not any(
        c.hot for c in rank(cands(("a", 0, 29, 0), ("b", 0, 14, 0)), 1, Weights(), b"k", 2.0, 1)
    )
    ordered = rank(cands(("a", 0.5, 30, 10), ("b", 0.5, 29, 0)), 10, Weights(), b"k")
    assert ordered[0].name == "a" and not any(c.hot for c in ordered)
    # "Unless all are": with the guard's parameters not every pod can be hot (the least-loaded one
    # never is: property below), so there is no all-hot fallback; parameters that would let every
    # pod be hot are refused at start-up.
    for ratio, low in (
        (0.5, 2),
        (float("nan"), 2),
        (float("inf"), 2),
        (2.0, -1),
        (2.0, 1.5),
        ("2", 1),
    ):
        with pytest.raises(ValueError):
            check_hotspot_params(ratio, low)
    check_hotspot_params(1.0, 0)
    import argparse

    from kvmesh.router import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit, match="hotspot"):
        cli.config_from_args(
            parser.parse_args(["--static-backends", "http://a:1", "--hotspot-ratio", "0.9"])
        )
    with pytest.raises(SystemExit, match="hotspot"):
        cli.config_from_args(
            parser.parse_args(["--static-backends", "http://a:1", "--hotspot-min-load", "-1"])
        )


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 10_000), min_size=2, max_size=8),
    ratio=st.floats(1.0, 50.0),
    low=st.integers(0, 20),
    matched=st.lists(st.integers(0, 10), min_size=8, max_size=8),
)
def test_hotspot_guard_always_leaves_a_pod_in_front(loads, ratio, low, matched):
    """For every load pattern and allowed parameters, the least-loaded pod is not hot and the
    first choice is never a hot pod: the guard can skip pods, never all of them."""
    cs = cands(*[(f"p{i}", 0.1, load, matched[i]) for i, load in enumerate(loads)])
    ordered = rank(cs, 10, Weights(), b"k", ratio, low)
    assert not ordered[0].hot
    assert not min(ordered, key=lambda c: c.load).hot
    assert sum(c.hot for c in ordered) < len(ordered)


def test_ties_break_deterministically_and_spread():
    firsts = set()
    for i in range(40):
        a = rank(cands(("p0", 0, 0, 0), ("p1", 0, 0, 0), ("p2", 0, 0, 0)), 4, Weights(), bytes([i]))
        b = rank(cands(("p2", 0, 0, 0), ("p0", 0, 0, 0), ("p1", 0, 0, 0)), 4, Weights(), bytes([i]))
        assert [c.name for c in a] == [c.name for c in b]  # input order does not matter
        firsts.add(a[0].name)
    assert firsts == {"p0", "p1", "p2"}


def test_weights_parse():
    assert Weights.parse("prefix=2,kv=0.1,queue=0") == Weights(2.0, 0.1, 0.0)
    assert Weights.parse("") == Weights()
    with pytest.raises(ValueError):
        Weights.parse("speed=1")


def test_keys_are_hashed_and_loaded_from_file_or_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text(
        "# team keys\nsk-one name=team-a rpm=10\nsha256:" + hash_key("sk-two") + " tpm=500\n"
    )
    keys = load_keys(str(f))
    assert all("sk-" not in k for k in keys)  # only digests are kept
    api = ApiKeys(keys)
    assert api.check("Bearer sk-one").name == "team-a" and api.check("Bearer sk-one").rpm == 10
    assert api.check("Bearer sk-two").tpm == 500
    assert (
        api.check("Bearer sk-three") is None
        and api.check(None) is None
        and api.check("sk-one") is None
    )
    assert set(load_keys(None, env_value="k1,k2")) == {hash_key("k1"), hash_key("k2")}
    assert set(load_keys(None, env_value=str(f))) == set(keys)
    assert load_keys(None, env_value="") is None


def test_rate_limiter_token_buckets(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("kvmesh.router.auth.time.monotonic", lambda: now[0])
    rl_ = RateLimiter(rpm=2, tpm=100)
    assert rl_.admit("a", 10)[0] and rl_.admit("a", 10)[0]
    ok, retry, which = rl_.admit("a", 10)
    assert not ok and which == "requests" and retry == 30
    assert rl_.admit("b", 10)[0]  # per client
    now[0] += 30
    assert rl_.admit("a", 10)[0]
    ok, retry, which = rl_.admit("b", 95)  # 90 tokens left, refilled 50 in 30 s -> capped at 100
    assert ok
    ok, retry, which = rl_.admit("b", 50)
    assert not ok and which == "tokens" and retry >= 1
    assert RateLimiter().admit("x", 10**9)[0]  # no limits configured


def test_engine_metrics_parsing():
    text = """# HELP vllm:kv_cache_usage_perc x
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1.0
process_start_time_seconds 1.7e9
"""
    load = engine_load(text)
    assert (load.kv_usage, load.running, load.waiting, load.total_blocks) == (0.25, 3, 2, 1024)
    assert (load.prefix_cache_queries, load.prefix_cache_hits, load.process_start_time) == (
        100,
        40,
        1.7e9,
    )


def test_heartbeat_roundtrip_and_layout_names():
    hb = rl.Heartbeat(
        pod="p",
        url="http://x:8000",
        model="m",
        kv_usage=0.5,
        running=2,
        waiting=1,
        total_blocks=9,
        state="draining",
        ts=12.5,
    )
    back = rl.Heartbeat.from_mapping(
        "p", {k.encode(): v.encode() for k, v in hb.to_mapping().items()}
    )
    assert (back.url, back.kv_usage, back.load, back.state, back.ts) == (
        "http://x:8000",
        0.5,
        3,
        "draining",
        12.5,
    )
    assert {"url", "model", "kv_usage", "running", "waiting", "total_blocks", "state", "ts"} <= set(
        hb.to_mapping()
    )
    assert rl.heartbeat_key("m", "p") == "kvmesh:v1:m:pod:p"
    assert rl.pods_key("m") == "kvmesh:v1:m:pods"
    assert rl.blocks_key("m", "p") == "kvmesh:v1:m:blocks:p"
    assert rl.Heartbeat.from_mapping("p", {}) is None


def test_prefix_match_lua_and_orphan_cleanup(redis_server):
    r = redis_server.client()
    keys = [f"{i:016x}" for i in range(1, 6)]
    r.sadd("t:blocks:a", *keys[:3])
    r.sadd("t:blocks:b", keys[0], keys[2], keys[3])  # a hole after the first key
    match = r.register_script(rl.PREFIX_MATCH_LUA)
    assert match(keys=["t:blocks:a", "t:blocks:b", "t:blocks:none"], args=["".join(keys)]) == [
        3,
        1,
        0,
    ]
    cleanup = r.register_script(rl.ORPHAN_CLEANUP_LUA)
    r.sadd("t:pods", "a")
    r.hset("t:hb:a", "url", "x")
    assert cleanup(keys=["t:hb:a", "t:blocks:a", "t:pods"], args=["a"]) == 0  # alive: untouched
    r.delete("t:hb:a")
    assert cleanup(keys=["t:hb:a", "t:blocks:a", "t:pods"], args=["a"]) == 1
    assert not r.exists("t:blocks:a") and not r.sismember("t:pods", "a")


def test_endpoint_slices_filter_pods():
    """A fake Kubernetes API: only pods whose IP is a ready endpoint stay routable."""
    import uvicorn

    from kvmesh.router.discovery import Discovery, EndpointSlices, Pod
    from kvmesh.router.metrics import RouterMetrics
    from tests.conftest import free_port, wait_until

    seen = {}

    async def api(scope, receive, send):
        if scope["type"] != "http":
            return
        seen["path"] = scope["path"] + "?" + scope["query_string"].decode()
        seen["auth"] = dict(scope["headers"]).get(b"authorization")
        body = {
            "items": [
                {
                    "endpoints": [
                        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                        {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                    ]
                }
            ]
        }
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    server.install_signal_handlers = lambda: None
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_until(lambda: server.started, 10)
    try:
        slices = EndpointSlices(
            "engine-svc", "ns1", api_url=f"http://127.0.0.1:{port}", token="tok"
        )
        asyncio.run(slices.poll_once())
        assert slices.ready_hosts == {"10.0.0.1"}
        assert seen["path"].startswith(
            "/apis/discovery.k8s.io/v1/namespaces/ns1/endpointslices?labelSelector="
        )
        assert "engine-svc" in seen["path"] and seen["auth"] == b"Bearer tok"
        d = Discovery("m", None, RouterMetrics(), endpoint_slices=slices)
        d.pods = {"a": Pod("a", "http://10.0.0.1:8000"), "b": Pod("b", "http://10.0.0.2:8000")}
        assert [p.name for p in d.routable()] == ["a"]
    finally:
        server.should_exit = True
        t.join(5)


def test_router_tokenizes_every_prompt_shape():
    from kvmesh.router.app import Router, RouterConfig
    from tests.conftest import shared_encoder

    router = Router(RouterConfig(model="m", redis_url=None), encoder=shared_encoder())
    text = router.prompt_tokens.tokens("/v1/completions", {"prompt": "hello world"})
    assert text and text == router.encoder.encode("hello world")
    assert (
        router.prompt_tokens.tokens("/v1/completions", {"prompt": ["hello world", "other"]}) == text
    )
    assert router.prompt_tokens.tokens("/v1/completions", {"prompt": [5, 6, 7]}) == [
        5,
        6,
        7,
    ]  # token ids, not a batch
    assert router.prompt_tokens.tokens("/v1/completions", {"prompt": [[5, 6, 7], [8]]}) == [5, 6, 7]
    assert (
        router.prompt_tokens.tokens("/v1/completions", {"prompt": 42}) == []
    )  # malformed: the engine answers it
    chat = router.prompt_tokens.tokens(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat  # rendered with the chat template, then encoded


def test_rate_limit_estimate_counts_batches_and_choices():
    from kvmesh.router.request_checks import estimate_tokens

    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    assert estimate_tokens(cmpl, {"prompt": "x", "max_tokens": 10}, 5) == 15
    assert estimate_tokens(cmpl, {"prompt": "x", "max_tokens": 10, "n": 3}, 5) == 35
    assert estimate_tokens(cmpl, {"prompt": ["a", "b"], "max_tokens": 10, "n": 2}, 5) == 50
    assert (
        estimate_tokens(cmpl, {"prompt": [1, 2, 3], "max_tokens": 4}, 3) == 7
    )  # token ids, not a batch
    assert estimate_tokens(chat, {"messages": [], "max_completion_tokens": 8}, 2) == 10
    assert (
        estimate_tokens(chat, {"messages": [], "max_tokens": 4, "max_completion_tokens": 8}, 2)
        == 10
    )
    # a completion has no max_completion_tokens (vLLM's CompletionRequest): max_tokens is charged
    assert (
        estimate_tokens(cmpl, {"prompt": "x", "max_tokens": 4, "max_completion_tokens": 8}, 2) == 6
    )
    assert estimate_tokens(cmpl, {"prompt": "x", "n": "many"}, 2) == 2


def test_a_key_file_line_is_the_whole_key_and_a_missing_file_is_an_error(tmp_path):
    from kvmesh.router.auth import KeyFileError

    f = tmp_path / "keys"
    f.write_text("# a comment line\n  sk-a#b rpm=5\nsk-c,d\nsk with spaces name=team\n\n")
    api = ApiKeys(load_keys(str(f)))
    assert (
        api.check("Bearer sk-a#b").rpm == 5 and api.check("Bearer sk-a") is None
    )  # no comment truncation
    assert (
        api.check("Bearer sk-c,d") is not None and api.check("Bearer sk-c") is None
    )  # no comma split
    assert api.check("Bearer sk with spaces").name == "team"
    assert len(api.keys) == 3
    with pytest.raises(KeyFileError, match="No such file"):
        load_keys(str(tmp_path / "missing"))
    with pytest.raises(
        KeyFileError, match="No such file"
    ):  # an env value naming a file that is not there
        load_keys(None, env_value=str(tmp_path / "missing"))
    with pytest.raises(KeyFileError, match="rpm"):
        parse_keys("sk-x rpm=fast")
    with pytest.raises(KeyFileError, match="64 hex"):
        parse_keys("sha256:abc")


def test_router_cli_refuses_to_start_without_its_key_file(tmp_path):
    import argparse

    from kvmesh.router import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    with pytest.raises(SystemExit, match="API key file"):
        cli.config_from_args(p.parse_args(["--api-keys-file", str(tmp_path / "nope")]))
    cfg = cli.config_from_args(
        p.parse_args(["--max-pending-requests", "3", "--scale-from-zero-timeout", "9"])
    )
    assert (cfg.max_pending_requests, cfg.scale_from_zero_timeout) == (3, 9.0)


def test_urls_with_passwords_are_redacted_wholly_in_logs():
    import logging

    from kvmesh.common.logging_setup import JsonFormatter, _Redacting, redact_url

    for url, secret in [
        ("redis://user:p@ss/w0rd@host:6379/0", ("p@ss", "w0rd", "ss/")),
        ("redis://:s3cret@redis:6379", ("s3cret",)),
        ("rediss://default:a:b#c@r.example.com:6380/1", ("a:b", "#c")),
        ("redis://r:6379/0?password=hunter2&db=1", ("hunter2",)),
    ]:
        red = redact_url(url)
        assert not any(s in red for s in secret), red
        assert "***" in red
    assert redact_url("http://10.0.0.1:8000/v1") == "http://10.0.0.1:8000/v1"
    record = logging.LogRecord(
        "kvmesh.router",
        logging.INFO,
        __file__,
        1,
        "connecting to %s",
        ("redis://admin:pa@ss@redis:6379/0",),
        None,
    )
    record.fields = {"upstream": "http://u:tok3n@engine:8000"}
    line = _Redacting(JsonFormatter()).format(record)
    assert "pa@ss" not in line and "tok3n" not in line and "redis:6379" in line


def test_rate_limit_charges_are_bounded_so_no_key_is_locked_out_past_its_window(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("kvmesh.router.auth.time.monotonic", lambda: now[0])
    lim = RateLimiter(tpm=1000)
    ok, _, _, charged = lim.admit_charge("a", 10**12)  # max_tokens absurdly large
    assert ok and charged == 1000  # at most one minute's budget
    ok, retry, which = lim.admit("a", 10)
    assert not ok and which == "tokens" and retry <= 60
    lim.adjust("a", 10**12)  # usage far beyond the estimate: the bucket empties, no further
    assert lim.admit("a", 1000)[1] <= 60
    assert lim.adjust("a", -(10**12)) <= 1000  # a refund never grants more than the bucket holds
    now[0] += 60
    assert lim.admit("a", 1000)[0]  # a window later the key is whole again
    from kvmesh.router.request_checks import estimate_tokens

    cmpl = "/v1/completions"
    assert estimate_tokens(cmpl, {"prompt": "x", "max_tokens": float("inf")}, 5) == 5
    assert estimate_tokens(cmpl, {"prompt": "x", "max_tokens": -7, "n": 10**9}, 5) == 5
    assert estimate_tokens(cmpl, {"prompt": "x", "max_tokens": 10**30}, 1) == 1 + (1 << 31)


def test_metric_labels_come_from_fixed_sets():
    from kvmesh.router.metrics import route_label, status_label

    assert route_label("/v1/completions") == "/v1/completions"
    assert (
        route_label("/v1/completions/../../etc") == "other" and route_label("/x" * 100) == "other"
    )
    assert status_label(200) == "200" and status_label(429) == "429"
    assert (
        status_label(418) == "4xx" and status_label(299) == "2xx" and status_label(999) == "other"
    )


def test_a_refusal_whose_body_breaks_off_does_not_stop_the_next_try():
    """Before retrying a 429/502/503 on the next pod, the router reads the refusal's body; a
    body cut short (the engine died while answering) must not raise out of the request."""
    import socket

    import aiohttp

    from kvmesh.router.proxy import drain_body as _drain_body

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def broken_engine():
        for _ in range(2):
            conn, _ = srv.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nnot me")
            conn.close()  # 94 bytes short

    threading.Thread(target=broken_engine, daemon=True).start()

    async def main():
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"http://127.0.0.1:{port}/v1/completions", data=b"{}")
            assert resp.status == 503
            with pytest.raises(aiohttp.ClientPayloadError):  # what the router read before
                await resp.read()
            resp = await session.post(f"http://127.0.0.1:{port}/v1/completions", data=b"{}")
            await _drain_body(resp)  # returns: the next pod is tried

    try:
        asyncio.run(main())
    finally:
        srv.close()


def test_the_routers_queue_depths_sum_only_fresh_well_formed_entries():
    now = 1000.0
    entries = {
        b"r1": rl.queued_entry(3, now - 1).encode(),
        "r2": rl.queued_entry(4, now),
        "old": rl.queued_entry(100, now - rl.ROUTER_QUEUE_STALE_S - 1),
        "future": rl.queued_entry(100, now + 60),
        "junk": "many",
        "neg": "-5 1000",
        "huge": f"{1 << 40} 1000",
    }
    assert rl.queued_at_routers(entries, now) == 7
