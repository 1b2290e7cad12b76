"""Drain and abort under load on the real engine (a tiny random-weight model, on loopback).

* The drain timeout: several streams (and a plain request) far longer than the timeout are
  cut close to it — tokens keep coming until then — and every response still ends
  properly (a final chunk with finish_reason "abort", then [DONE]; the plain one a 200),
  never a reset; their KV blocks are freed (usage back to 0) before the server exits.
* A soak: concurrent streams, a third of them dropped by their client at random points,
  on a KV pool small enough to preempt, a 32-token step budget (chunked prefill) and a
  shared prefix (prefix-cache hits). It ends at zero KV usage, and every request that was
  not dropped generated exactly transformers' greedy fp32 tokens (each token's text and
  logprob compared).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from tests.engine.conftest import _hf_model, hf_greedy, random_prompts
from tests.engine.server.conftest import ThreadServer, wait_for

MODEL = "tiny"


def _kv_idle(state) -> dict:
    """The engine's block pool once nothing runs: usage 0, every block free."""
    snap = state.engine.snapshot()
    return (
        snap
        if (
            state.engine.num_in_flight == 0
            and snap["kv_cache_usage"] == 0.0
            and snap["num_free_blocks"] == snap["num_total_blocks"]
        )
        else {}
    )


# -- the drain timeout ------------------------------------------------------------------------

# Tokens each request asks for: far more than the tiny model writes in the setup plus the 2 s
# timeout, even when the machine is busy and the streams' start takes seconds, so every request
# is still running when the drain cuts it (one that finished would end with "length").
LONG = 16_000


def test_drain_timeout_cuts_streams_near_the_timeout_ends_them_properly_and_frees_their_blocks(
    tiny_model,
):
    from kvmesh.engine.server import cli

    timeout = 2.0
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            str(7 * LONG // 16 + 64),
            "--max-num-seqs",
            "16",
            "--max-model-len",
            str(LONG + 64),
        ]
    ).start()
    state = srv.state
    streams = 6
    results: list[dict] = [{} for _ in range(streams)]
    started = threading.Barrier(streams + 1)

    def consume(i: int) -> None:
        res = results[i]
        res["arrivals"], res["events"] = [], []
        try:
            with httpx.stream(
                "POST",
                srv.url + "/v1/completions",
                timeout=60,
                json={
                    "prompt": f"stream {i} goes on and on",
                    "max_tokens": LONG,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                },
            ) as r:
                res["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        res["arrivals"].append(time.monotonic())
                        res["events"].append(line[6:])
                        if len(res["events"]) == 1:
                            started.wait(30)
        except Exception as exc:  # noqa: BLE001 - a reset is what this test refuses
            res["error"] = repr(exc)
        res["ended"] = time.monotonic()

    plain: dict = {}

    def consume_plain() -> None:
        try:
            r = httpx.post(
                srv.url + "/v1/completions",
                timeout=60,
                json={
                    "prompt": "a plain request",
                    "max_tokens": LONG,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            plain["status"], plain["body"] = r.status_code, r.json()
        except Exception as exc:  # noqa: BLE001
            plain["error"] = repr(exc)
        plain["ended"] = time.monotonic()

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(streams)]
    threads.append(threading.Thread(target=consume_plain, daemon=True))
    try:
        for t in threads:
            t.start()
        started.wait(30)  # every stream has its first token
        wait_for(lambda: state.engine.num_in_flight == streams + 1, timeout=30)
        assert state.engine.snapshot()["kv_cache_usage"] > 0
        # What SIGTERM does (cli.serve's handler), on the server's loop.
        t0 = time.monotonic()
        state.begin_drain()
        drained = asyncio.run_coroutine_threadsafe(
            cli.drain_then_exit(state, srv.server, timeout), state.engine._loop
        )
        late = httpx.post(
            srv.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5
        )
        assert late.status_code == 503
        assert (
            drained.result(timeout=timeout + cli.DRAIN_ABORT_GRACE_S + 10) is False
        )  # cut, not drained
        for t in threads:
            t.join(15)
        srv.thread.join(15)
        assert not srv.thread.is_alive(), "the server did not exit after the drain"
    finally:
        if srv.thread.is_alive():
            srv.stop()

    for i, res in enumerate(results):
        assert "error" not in res and res["status"] == 200, (i, res.get("error"))
        assert res["events"][-1] == "[DONE]", (i, res["events"][-3:])
        chunks = [json.loads(e) for e in res["events"][:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "abort" and not any(finishes[:-1]), (i, finishes[-3:])
        assert len(chunks) < LONG  # far from finished
        tokens_at = res["arrivals"][-2] - t0  # the last token's chunk
        assert tokens_at >= 0.8 * timeout, (
            f"stream {i} was cut {tokens_at:.2f}s after the drain began"
        )
        assert res["ended"] - t0 <= timeout + cli.DRAIN_ABORT_GRACE_S, (
            f"stream {i} ended {res['ended'] - t0:.2f}s"
        )
    assert "error" not in plain and plain["status"] == 200, plain.get("error")
    choice = plain["body"]["choices"][0]
    assert (
        choice["finish_reason"] == "abort"
        and 0 < plain["body"]["usage"]["completion_tokens"] < LONG
    )
    assert plain["ended"] - t0 >= 0.8 * timeout
    # Every aborted request's blocks went back to the pool before the engine stopped.
    assert _kv_idle(state), state.engine.snapshot()


# -- the soak ---------------------------------------------------------------------------------

BLOCKS = 24  # x 16 tokens: far less than 8 concurrent requests of up to 112 tokens need
BUDGET = 32  # tokens per step: every prompt (53..88 tokens) is prefilled in chunks
N_REQUESTS = 24


def _hf_logprobs(model_dir: str, prompt: list[int], generated: list[int]) -> list[float]:
    """Transformers' fp32 log-probability of each generated token."""
    import torch

    model = _hf_model(model_dir)
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [lps[len(prompt) - 1 + i, t].item() for i, t in enumerate(generated)]


async def _one(client: httpx.AsyncClient, url: str, body: dict, drop_after: int | None) -> dict:
    """Stream one request; with ``drop_after``, hang up after that many SSE events (0: once the
    response has started)."""
    out: dict = {"tokens": [], "logprobs": [], "events": 0, "dropped": drop_after is not None}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        if drop_after == 0:
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            out["events"] += 1
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                break
            chunk = json.loads(data)
            for c in chunk["choices"]:
                lp = c.get("logprobs") or {}
                out["tokens"] += lp.get("tokens") or []
                out["logprobs"] += lp.get("token_logprobs") or []
                if c.get("finish_reason"):
                    out["finish"] = c["finish_reason"]
            if drop_after is not None and out["events"] >= drop_after:
                break  # the client hangs up: leaving the block closes the connection
    return out


def test_soak_aborts_preemption_chunked_prefill_prefix_hits_end_clean_and_equal_transformers(
    tiny_model,
):
    rng = random.Random(20240611)
    shared = random_prompts(1, 48, 48, seed=11)[0]  # three full blocks, shared by most prompts
    suffixes = random_prompts(N_REQUESTS, 5, 40, seed=12)
    prompts = [
        (shared if i % 4 else []) + s + ([7] * 48 if i % 4 == 0 else [])
        for i, s in enumerate(suffixes)
    ]
    # The last ones are the shared prefix alone, a whole number of blocks all cached by then:
    # the last token must still be computed (logits to sample from), not read from the cache.
    prompts[-2:] = [list(shared), list(shared)]
    max_tokens = [rng.randint(8, 24) for _ in prompts]
    drops = {
        i: rng.choice([0, 1, 3, 6]) for i in rng.sample(range(N_REQUESTS - 2), N_REQUESTS // 3)
    }
    # A dropped request asks for the rest of the model length: it cannot run to its end before
    # its hang-up's abort lands, however fast the engine (a short one could, and the check below
    # that aborts cut requests short would then depend on timing).
    for i in drops:
        max_tokens[i] = 256 - len(prompts[i])

    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--dtype",
            "float32",
            "--num-kv-blocks",
            str(BLOCKS),
            "--max-num-batched-tokens",
            str(BUDGET),
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "256",
        ]
    ).start()
    try:

        async def run() -> list[dict]:
            limits = httpx.Limits(max_connections=N_REQUESTS + 4)
            async with httpx.AsyncClient(timeout=30, limits=limits) as client:
                return await asyncio.gather(
                    *[
                        _one(
                            client,
                            srv.url,
                            {
                                "prompt": p,
                                "max_tokens": m,
                                "temperature": 0,
                                "ignore_eos": True,
                                "logprobs": 0,
                                "stream": True,
                            },
                            drops.get(i),
                        )
                        for i, (p, m) in enumerate(zip(prompts, max_tokens))
                    ]
                )

        t0 = time.monotonic()
        results = asyncio.run(run())
        elapsed = time.monotonic() - t0
        # The pool ends empty: dropped requests were aborted and freed, finished ones released.
        wait_for(lambda: _kv_idle(srv.state), timeout=15)
        stats = srv.state.engine.stats
        assert stats.num_preemptions > 0, "the KV pool never ran short: no preemption exercised"
        assert stats.prefix_cache_hits > 0, "no prefix-cache hit"
        # A hang-up aborts the request in the engine: the dropped ones did not all run to the end.
        assert stats.generation_tokens < sum(max_tokens), (stats.generation_tokens, sum(max_tokens))
        tok = srv.state.engine.tokenizer
    finally:
        srv.stop()

    completed = 0
    for i, (res, prompt, m) in enumerate(zip(results, prompts, max_tokens)):
        assert res["status"] == 200, (i, res)
        if res["dropped"]:
            continue
        completed += 1
        assert res.get("done") and res.get("finish") == "length", (i, res.get("finish"))
        expected = hf_greedy(tiny_model, prompt, m, ignore_eos=True)
        assert res["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in expected], (
            f"request {i} diverged from transformers"
        )
        want = _hf_logprobs(tiny_model, prompt, expected)
        assert res["logprobs"] == pytest.approx(want, abs=2e-3), f"request {i}: logprobs differ"
    assert completed == N_REQUESTS - len(drops)
    print(
        f"soak: {N_REQUESTS} requests ({len(drops)} dropped) in {elapsed:.1f}s, "
        f"{stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-hit tokens"
    )
