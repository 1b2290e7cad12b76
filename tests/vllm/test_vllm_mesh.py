"""kvmesh in front of the real vLLM (CPU build): heartbeats, KV events and replay, prefix routing with
vLLM's own cached-token count, a SIGKILLed replica's greedy stream resumed token-exact on the other,
and the sidecar's block index after that replica restarts.

The tests share the two servers of conftest.py and run in this order (the last two kill and
restart vllm-1)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex
from kvmesh.common.kv_events import KVEventSubscriber
from kvmesh.common.vllm_args import VLLM_BLOCK_SIZE
from tests.conftest import wait_until
from tests.vllm.conftest import ADAPTER

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BS = VLLM_BLOCK_SIZE
SYSTEM = (
    "You are a meticulous assistant for a railway company. Answer in one short sentence. "
    "Timetables: the 07:10 to Lyon stops at Dijon; the 08:45 to Geneva is direct; the 12:30 "
    "to Turin changes at Chambery; the 17:05 to Marseille stops at Avignon and Aix. "
) * 4


def _hb(mesh, pod: str) -> dict:
    return mesh.redis.hgetall(rl.heartbeat_key(mesh.served, pod))


def _blocks(mesh, pod: str) -> set[str]:
    return mesh.redis.smembers(rl.blocks_key(mesh.served, pod))


def _keys(mesh, token_ids: list[int]) -> set[str]:
    return {key_hex(k) for k in block_keys(token_ids, mesh.served, BS)}


def _complete(url: str, served: str, prompt, max_tokens: int = 8, **extra) -> dict:
    body = {
        "model": served,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_sidecars_heartbeat_the_vllm_engines_ready(vllm_mesh):
    mesh = vllm_mesh
    for s in mesh.servers:
        hb = wait_until(
            lambda s=s: (lambda h: h if h.get("state") == "ready" else None)(_hb(mesh, s.name)),
            20,
            msg=f"{s.name} heartbeat ready",
        )
        assert hb["url"] == s.url and hb["block_size"] == str(BS) and hb["index"] == "ok"
        assert int(hb["total_blocks"]) > 0, hb  # vllm:cache_config_info's num_gpu_blocks
    for sc in mesh.sidecars:
        body = httpx.get(f"http://127.0.0.1:{sc.health_port}/ready", timeout=2).json()
        assert body["status"] == "ok" and body["engine_problem"] is None, body
        assert body["events_problem"] is None, body


def test_events_and_replay_are_read_with_no_malformed_message(vllm_mesh):
    mesh = vllm_mesh
    server, sidecar = mesh.servers[0], mesh.sidecars[0]
    out = _complete(server.url, mesh.served, SYSTEM + "Which train is direct?")
    prompt_ids = out["choices"][0]["prompt_token_ids"]
    want = _keys(mesh, prompt_ids)
    assert len(want) >= 4
    wait_until(lambda: want <= _blocks(mesh, server.name), 10, msg="prompt blocks indexed")
    # A fresh subscriber catches up from vLLM's replay socket alone: the same blocks.
    sub = KVEventSubscriber(server.events_endpoint, server.replay_endpoint)
    try:
        stored = []
        for d in sub.poll(100):
            stored += [e for e in (d.batch.events if d.batch else []) if hasattr(e, "token_ids")]
        assert sub.stats["replays"] >= 1 and sub.stats["replay_failures"] == 0
        assert sub.stats["decode_errors"] == 0 and sub.replay_problem is None
        assert any(e.token_ids[:BS] == prompt_ids[:BS] for e in stored)
    finally:
        sub.close()
    stats = sidecar.events.subscriber.stats
    assert stats["decode_errors"] == 0 and stats["replay_failures"] == 0, stats
    assert sidecar.events.subscriber.last_decode_error is None


def _router_cached(mesh) -> tuple[float, float]:
    """Predicted and engine-reported cached tokens, summed over the adapter label."""
    m = mesh.router.router.metrics

    def total(counter) -> float:
        return sum(
            s.value
            for metric in counter.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        )

    return total(m.predicted_cached), total(m.engine_cached)


def test_follow_up_turn_goes_to_the_replica_with_its_prefix_and_vllm_confirms_the_prediction(
    vllm_mesh,
):
    mesh = vllm_mesh
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which train goes to Geneva?"},
    ]
    url = mesh.router.url + "/v1/chat/completions"
    body = {"model": mesh.served, "messages": messages, "max_tokens": 12, "temperature": 0}
    first = httpx.post(url, json=body, timeout=120)
    assert first.status_code == 200, first.text
    pod = first.headers["x-kvmesh-pod"]
    answer = first.json()["choices"][0]["message"]["content"]
    # The sidecar has indexed the first turn's prompt before the follow-up is routed.
    prompt_len = first.json()["usage"]["prompt_tokens"]
    wait_until(
        lambda: len(_blocks(mesh, pod)) >= prompt_len // BS, 10, msg="first turn's blocks indexed"
    )
    follow = {
        **body,
        "messages": messages
        + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And which one changes at Chambery?"},
        ],
    }
    predicted0, cached0 = _router_cached(mesh)
    second = httpx.post(url, json=follow, timeout=120)
    assert second.status_code == 200, second.text
    assert second.headers["x-kvmesh-pod"] == pod
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (prompt_len // BS - 1) * BS > 0
    # The router settles a request (its metrics) as the answer's last byte goes out.
    wait_until(lambda: _router_cached(mesh)[1] - cached0 == cached, 5, msg="request settled")
    assert _router_cached(mesh)[0] - predicted0 == cached


def _stream_ids(resp: httpx.Response, on_ids) -> tuple[list[int], str, list[str]]:
    """The generated ids and text of a completions stream, and its finish reasons."""
    ids: list[int] = []
    text, reasons = "", []
    for line in resp.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        for choice in event.get("choices") or ():
            ids += choice.get("token_ids") or []
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
        on_ids(ids)
    return ids, text, reasons


def test_an_adapters_blocks_have_its_own_keys_and_its_follow_up_is_routed_to_them(vllm_mesh):
    """vLLM tags an adapter's blocks with `lora_name`: the sidecar chains them from the adapter's
    root, the router computes the same keys for a request naming the adapter."""
    mesh = vllm_mesh
    url = mesh.router.url + "/v1/completions"
    prompt = "Adapter check. " + SYSTEM[:600]
    body = {"model": ADAPTER, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = httpx.post(url, json={**body, "return_token_ids": True}, timeout=120)
    assert first.status_code == 200, first.text
    pod = first.headers["x-kvmesh-pod"]
    ids = first.json()["choices"][0]["prompt_token_ids"]
    adapter_keys = {key_hex(k) for k in block_keys(ids, ADAPTER, BS)}
    wait_until(lambda: adapter_keys <= _blocks(mesh, pod), 10, msg="the adapter's blocks indexed")
    assert not _keys(mesh, ids) & _blocks(mesh, pod)  # never as the base model's
    predicted0, cached0 = _router_cached(mesh)
    second = httpx.post(url, json={**body, "prompt": prompt + " And one more line."}, timeout=120)
    assert second.status_code == 200 and second.headers["x-kvmesh-pod"] == pod
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    wait_until(lambda: _router_cached(mesh)[1] - cached0 == cached, 5, msg="request settled")
    assert _router_cached(mesh)[0] - predicted0 == cached > 0


def _greedy(mesh, path: str, prompt: str) -> dict:
    body = {"model": mesh.served, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    if path.endswith("chat/completions"):
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


def test_a_sigkilled_replicas_greedy_streams_resume_token_exact_on_the_other(vllm_mesh):
    mesh = vllm_mesh
    victim = mesh.servers[1]
    # Prompts no other test sent: only the victim will hold them.
    drill = "Failover drill. " * 12
    streams = {
        "/v1/completions": drill + SYSTEM + "List every train and its stops, one per line.",
        "/v1/chat/completions": drill + SYSTEM + "Describe each train in detail.",
    }
    # The references come from the victim itself: its cache then holds both prompts, so the
    # router sends both streams there (and the survivor starts cold: a real failover).
    ref = {}
    for path, prompt in streams.items():
        body = {**_greedy(mesh, path, prompt), "return_token_ids": True}
        resp = httpx.post(victim.url + path, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        ref[path] = resp.json()["choices"][0]["token_ids"]
    wait_until(lambda: len(_blocks(mesh, victim.name)) >= 8, 10, msg="references indexed")
    killed: list[int] = []
    got: dict[str, tuple] = {}

    def kill_midway(ids: list[int]) -> None:
        if len(ids) >= 12 and not killed:
            killed.append(len(ids))
            victim.kill()

    def run(path: str) -> None:
        body = {**_greedy(mesh, path, streams[path]), "stream": True, "return_token_ids": True}
        with httpx.stream("POST", mesh.router.url + path, json=body, timeout=180) as resp:
            assert resp.status_code == 200
            pod = resp.headers["x-kvmesh-pod"]
            on_ids = kill_midway if pod == victim.name else (lambda ids: None)
            got[path] = (pod, *_stream_ids(resp, on_ids))

    threads = [threading.Thread(target=run, args=(p,)) for p in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert killed, "the streams ended before the replica was killed"
    assert set(got) == set(streams)
    # The stream that had 12 ids went on mid-stream (its status line came from the victim); the
    # other had maybe not started (then it was sent again whole): both exact all the same.
    assert victim.name in {pod for pod, *_ in got.values()}
    for path, (_, ids, _, reasons) in got.items():
        assert ids == ref[path], path
        assert reasons == ["length"], path
    resumed = mesh.router.router.metrics.resumed
    assert (
        sum(s.value for m in resumed.collect() for s in m.samples if s.name.endswith("_total")) >= 1
    )


def test_the_sidecar_index_follows_a_restarted_vllm(vllm_mesh):
    mesh = vllm_mesh
    server = mesh.servers[1]
    if server.proc.poll() is None:
        server.kill()
    wait_until(lambda: not mesh.redis.exists(rl.heartbeat_key(mesh.served, server.name)), 10)
    server.start()
    server.wait_ready()
    wait_until(lambda: _hb(mesh, server.name).get("state") == "ready", 20, msg="ready again")
    # The new incarnation's cache is empty, and so is the block set once the sidecar resynced.
    wait_until(lambda: not _blocks(mesh, server.name), 20, msg="the old blocks dropped")
    out = _complete(server.url, mesh.served, "Timetable check. " * 30 + "Which is direct?")
    choice = out["choices"][0]
    # Exactly the new incarnation's blocks: the full blocks of what it computed (the prompt and
    # the output but its last token, whose KV was never computed).
    want = _keys(mesh, choice["prompt_token_ids"] + choice["token_ids"][:-1])
    wait_until(lambda: _blocks(mesh, server.name) == want, 10, msg="the new blocks, and only them")
    stats = mesh.sidecars[1].events.subscriber.stats
    assert stats["decode_errors"] == 0, stats
