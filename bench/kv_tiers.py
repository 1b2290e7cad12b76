#!/usr/bin/env python3
"""KV tiers benchmarks (a script, not a test): what the host and shared tiers save, and cost.

ttft        Time to first token of a long prompt (default 2,000 tokens) whose prefix is in the
            engine's KV cache, in its host tier (evicted from the KV cache by other prompts
            first), in the shared tier written by *another* replica, and recomputed (a cold
            prompt). Two `kvmesh serve` replicas on one shared directory; each figure the median
            over --rounds fresh prompts; ratios against recomputation (goal <= 0.15x). Every hit
            is checked against the engine's `cached_tokens_by_medium` (a figure from the wrong
            tier would be no figure at all).

multiround  A multi-round chat (bench/router.py's workload) on `kvmesh up` with --replicas engines
            whose KV caches each hold 1/--working-set of the conversations' working set: prefix
            routing with the host and shared tiers, prefix routing without tiers, round-robin
            without tiers. Reported per run: prompt tokens not recomputed (the engines'
            cached_tokens), by tier, throughput, TTFT; ratios tiers / no tiers (goal >= 1.5x the
            tokens saved) and against round-robin.

overhead    Offline throughput of unique random prompts (no prefix is ever reused) on an engine
            whose KV cache evicts all the time, with the host and shared tiers on (every evicted
            block copied out, every block written through) vs off, in interleaved rounds in one
            run; the ratio (goal: tiers cost <= 3%).

    python bench/kv_tiers.py ttft [--prompt-tokens 2000] [--rounds 3]
    python bench/kv_tiers.py multiround [--replicas 4] [--working-set 3]
    python bench/kv_tiers.py overhead [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # local_mesh.py

from local_mesh import local_mesh  # noqa: E402

from kvmesh.common.ports import free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"


def _bench_router():
    """bench/router.py's workload and helpers (a script beside this one, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_router", ROOT / "bench" / "router.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Every engine here runs in fp32, the dtype block_bytes sizes the tiers in (dtype auto would be
# bf16 on a CPU with avx512_bf16).
DTYPE = "float32"


def block_bytes(model: str, block_size: int = 16) -> int:
    """Bytes of one KV block (every layer's K and V) of `model` in fp32: the engine's own sizing."""
    import torch

    from kvmesh.common.model_lookup import find_model_dir
    from kvmesh.engine.config import ModelConfig

    return ModelConfig.from_dir(find_model_dir(model)).kv_bytes_per_block(block_size, torch.float32)


# -- ttft -----------------------------------------------------------------------------------------
def start_server(port: int, flags: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-P", "-m", "kvmesh.cli", "serve", "--model", MODEL, "--port", str(port)]
    cmd += ["--dtype", DTYPE]
    log = open(log_path, "w")
    return subprocess.Popen(cmd + flags, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    print(f"  waiting for {url}/ready (engine loading) ...", flush=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server on {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become ready in {timeout:.0f} s")


def timed_completion(url: str, prompt: list[int]) -> tuple[float, dict]:
    """(seconds to the one generated token, the cached tokens by medium) for one prompt."""
    import httpx

    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    by_medium = dict(details.get("cached_tokens_by_medium") or {})
    by_medium["total"] = details.get("cached_tokens") or 0
    return dt, by_medium


def ttft(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    vocab = 49152 - 1000
    shared = tempfile.mkdtemp(prefix="kv-shared-")
    bb = block_bytes(MODEL)
    # KV cache: room for the long prompt and a little more, so that the filler evicts it.
    kv_blocks = args.prompt_tokens // 16 + 64
    host_gib = 4 * kv_blocks * bb / 2**30
    common = [
        "--num-kv-blocks",
        str(kv_blocks),
        "--kv-offloading-size",
        f"{host_gib:.3f}",
        "--kv-shared-dir",
        shared,
        "--kv-shared-size",
        "4",
    ]
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [os.path.join(shared, f"..{i}.log") for i in range(2)]
    print(
        f"TTFT of a {args.prompt_tokens}-token prompt by where its prefix is: 2 replicas, KV cache "
        f"{kv_blocks} blocks each, host tier {host_gib:.2f} GiB, shared tier {shared}",
        flush=True,
    )
    procs = [start_server(p, common, log) for p, log in zip(ports, logs)]
    try:
        for u, p in zip(urls, procs):
            wait_ready(u, p)
        # Warm-up: a prompt of the measured length on each replica (first long contexts pay for
        # allocation and page faults), never reused after.
        for u in urls:
            timed_completion(u, [rng.randrange(vocab) for _ in range(args.prompt_tokens)])
        rows: dict[str, list[float]] = {"recompute": [], "GPU": [], "CPU": [], "SHARED": []}
        for rnd in range(args.rounds):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
            t_cold, c = timed_completion(urls[0], prompt)
            rows["recompute"].append(t_cold)
            t_gpu, c_gpu = timed_completion(urls[0], prompt)
            rows["GPU"].append(t_gpu)
            # Evict the prompt from replica 0's KV cache: other prompts fill it.
            for _ in range(2):
                timed_completion(urls[0], [rng.randrange(vocab) for _ in range(args.prompt_tokens)])
            t_cpu, c_cpu = timed_completion(urls[0], prompt)
            rows["CPU"].append(t_cpu)
            time.sleep(1.0)  # replica 0's shared-tier writes are behind its requests
            t_shared, c_shared = timed_completion(urls[1], prompt)
            rows["SHARED"].append(t_shared)
            print(
                f"  round {rnd + 1}: recompute {t_cold * 1000:7.1f} ms (cached {c['total']}), "
                f"KV cache {t_gpu * 1000:6.1f} ms ({c_gpu}), host tier {t_cpu * 1000:6.1f} ms "
                f"({c_cpu}), shared tier on the other replica {t_shared * 1000:6.1f} ms ({c_shared})",
                flush=True,
            )
            expect = (args.prompt_tokens - 1) // 16 * 16
            for name, got in (("CPU", c_cpu), ("SHARED", c_shared)):
                if got.get(name, 0) < expect * 0.9:
                    print(f"  WARNING: the {name} run took only {got} from the {name} tier")
        base = statistics.median(rows["recompute"])
        print(f"\n  median TTFT over {args.rounds} prompts ({args.prompt_tokens} tokens):")
        for name, label in (
            ("recompute", "recomputed"),
            ("GPU", "prefix in the KV cache"),
            ("CPU", "prefix in the host tier"),
            ("SHARED", "prefix in the shared tier (written by the other replica)"),
        ):
            med = statistics.median(rows[name])
            goal = (
                ""
                if name in ("recompute", "GPU")
                else "  goal <= 0.15x: " + ("OK" if med / base <= 0.15 else "MISSED")
            )
            print(f"  {label:58s} {med * 1000:8.1f} ms  {med / base:5.2f}x{goal}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(shared, ignore_errors=True)


# -- multiround -----------------------------------------------------------------------------------
def _engine_tier_tokens(redis_url: str, model: str) -> dict[str, float]:
    """The fleet's hit tokens per tier, from the engines' kvmesh:kv_tier_hit_tokens_total."""
    import httpx
    import redis

    from kvmesh.common import redis_layout as rl
    from kvmesh.common.engine_load import parse_prometheus

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    out: dict[str, float] = {}
    for pod in sorted(r.smembers(rl.pods_key(model))):
        url = r.hget(rl.heartbeat_key(model, pod), rl.F_URL)
        if not url:
            continue
        for name, labels, v in parse_prometheus(httpx.get(url + "/metrics", timeout=10).text):
            if name in ("kvmesh:kv_tier_hit_tokens_total", "kvmesh:kv_tier_hit_tokens"):
                m = labels.get("medium", "?")
                out[m] = out.get(m, 0.0) + v
    return out


def multiround(args: argparse.Namespace) -> None:
    br = _bench_router()
    total, longest = br.working_set_blocks(
        MODEL,
        args.conversations,
        args.rounds,
        args.max_tokens,
        args.user_words,
        args.system_repeat,
        args.seed,
    )
    blocks = max(int(total / args.working_set), longest * 2)
    bb = block_bytes(MODEL)
    tier_gib = max(total * bb * 1.2 / 2**30, 0.05)
    print(
        f"multi-round chat on {args.replicas} replicas: {args.conversations} conversations x "
        f"{args.rounds} rounds; working set {total} blocks = {total / blocks:.1f}x one replica's KV "
        f"cache ({blocks} blocks); tiers: host {tier_gib:.2f} GiB per replica, shared {tier_gib:.2f} GiB",
        flush=True,
    )
    runs = [
        ("prefix + tiers", "prefix", True),
        ("prefix", "prefix", False),
        ("round-robin", "round-robin", False),
    ]
    results: dict[str, dict] = {}
    for label, policy, tiers in runs:
        shared = tempfile.mkdtemp(prefix="kv-shared-")
        engine_args = f"--num-kv-blocks {blocks} --omp-threads 1 --dtype {DTYPE}"
        up_flags: list[str] = []
        if tiers:
            up_flags = [
                "--kv-offloading-size",
                f"{tier_gib:.3f}",
                "--kv-shared-dir",
                shared,
                "--kv-shared-size",
                f"{tier_gib:.3f}",
            ]
        flags = ["--policy", policy, "--engine-args", engine_args, *up_flags]
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(shutil.rmtree, shared, ignore_errors=True)
            mesh = cleanup.enter_context(local_mesh(args.replicas, flags, args.verbose, label))
            state = mesh.state()
            before = _engine_tier_tokens(state["redis_url"], state["model"])
            t0 = time.perf_counter()
            st = asyncio.run(
                br.chat_workload(
                    mesh.url,
                    MODEL,
                    args.conversations,
                    args.rounds,
                    args.concurrency,
                    args.max_tokens,
                    args.system_repeat,
                    args.user_words,
                    args.think_time,
                    args.seed,
                )
            )
            st["wall"] = time.perf_counter() - t0
            after = _engine_tier_tokens(state["redis_url"], state["model"])
            st["by_tier"] = {m: after.get(m, 0) - before.get(m, 0) for m in after}
            results[label] = st
            ttfts = st["ttft"] or [float("nan")]
            print(
                f"  {label:15s} prompt tokens not recomputed {st['cached_tokens']:8d} of "
                f"{st['prompt_tokens']:8d} ({st['cached_tokens'] / max(st['prompt_tokens'], 1):5.1%}), by tier "
                f"{ {k: int(v) for k, v in sorted(st['by_tier'].items())} }  "
                f"{len(st['ttft']) / st['wall']:5.2f} req/s  TTFT p50 {br.pct(ttfts, 50) * 1000:7.1f} ms  "
                f"p90 {br.pct(ttfts, 90) * 1000:7.1f} ms  errors {st['errors']}",
                flush=True,
            )
    t, p, r = results["prefix + tiers"], results["prefix"], results["round-robin"]

    def saved(st):
        return st["cached_tokens"] / max(st["prompt_tokens"], 1)

    def tput(st):
        return len(st["ttft"]) / st["wall"]

    x = saved(t) / max(saved(p), 1e-9)
    print(
        f"  tiers vs prefix routing without tiers: tokens saved {x:.2f}x (goal >= 1.5x: "
        f"{'OK' if x >= 1.5 else 'MISSED'}), throughput {tput(t) / tput(p):.2f}x, TTFT p50 "
        f"{br.pct(t['ttft'], 50) / br.pct(p['ttft'], 50):.2f}x\n"
        f"  tiers vs round-robin: tokens saved {saved(t) / max(saved(r), 1e-9):.2f}x, throughput "
        f"{tput(t) / tput(r):.2f}x, TTFT p50 {br.pct(t['ttft'], 50) / br.pct(r['ttft'], 50):.2f}x",
        flush=True,
    )


# -- overhead -------------------------------------------------------------------------------------
def _overhead_worker(conn, tiers: bool, prompts, output_len: int, kv_blocks: int) -> None:
    from kvmesh.engine import LLM, SamplingParams

    # 8 requests at most at once, each under 50 blocks: the cache evicts, nothing is preempted
    # (a preempted request would hit its own blocks in a tier).
    kwargs: dict = {"num_kv_blocks": kv_blocks, "max_num_seqs": 8, "dtype": DTYPE}
    shared = None
    if tiers:
        shared = tempfile.mkdtemp(prefix="kv-shared-")
        kwargs.update(kv_offloading_size=1.0, kv_shared_dir=shared, kv_shared_size=4.0)
    llm = LLM(MODEL, **kwargs)
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([p[::-1][:64] for p in prompts[:4]], sp)  # warm-up (reversed: no hits bought)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    tokens = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
    conn.send((tokens / dt, dt))
    conn.close()
    if shared:
        shutil.rmtree(shared, ignore_errors=True)


def overhead(args: argparse.Namespace) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    print(
        f"tiers that never hit: {args.requests} unique prompts of 256-768 tokens, {args.output_len} "
        f"out, KV cache {args.kv_blocks} blocks (evicting all the time), {args.rounds} interleaved rounds",
        flush=True,
    )
    ratios = []
    for rnd in range(args.rounds):
        rng = random.Random(args.seed + rnd)
        prompts = [
            [rng.randrange(48000) for _ in range(rng.randint(256, 768))]
            for _ in range(args.requests)
        ]
        res = {}
        for tiers in (rnd % 2 == 0, rnd % 2 == 1):  # order alternates between rounds
            a, b = ctx.Pipe()
            p = ctx.Process(
                target=_overhead_worker, args=(b, tiers, prompts, args.output_len, args.kv_blocks)
            )
            p.start()
            res[tiers] = a.recv()
            p.join()
        ratio = res[True][0] / res[False][0]
        ratios.append(ratio)
        print(
            f"  round {rnd + 1}: tiers on {res[True][0]:7.1f} tok/s, off {res[False][0]:7.1f} tok/s, "
            f"ratio {ratio:.3f}",
            flush=True,
        )
    med = statistics.median(ratios)
    print(
        f"  median throughput with tiers / without: {med:.3f} (cost {1 - med:+.1%}; goal <= 3%: "
        f"{'OK' if 1 - med <= 0.03 else 'MISSED'})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("ttft")
    t.add_argument("--prompt-tokens", type=int, default=2000)
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("multiround")
    m.add_argument("--replicas", type=int, default=4)
    m.add_argument("--working-set", type=float, default=3.0, help="x one replica's KV cache")
    m.add_argument("--conversations", type=int, default=16)
    m.add_argument("--rounds", type=int, default=6)
    m.add_argument("--concurrency", type=int, default=0)
    m.add_argument("--max-tokens", type=int, default=32)
    m.add_argument("--system-repeat", type=int, default=2)
    m.add_argument("--user-words", type=int, default=50)
    m.add_argument("--think-time", type=float, default=3.0)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--verbose", action="store_true")
    o = sub.add_parser("overhead")
    o.add_argument("--requests", type=int, default=24)
    o.add_argument("--output-len", type=int, default=32)
    o.add_argument("--kv-blocks", type=int, default=512)
    o.add_argument("--rounds", type=int, default=4)
    o.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    {"ttft": ttft, "multiround": multiround, "overhead": overhead}[args.what](args)


if __name__ == "__main__":
    main()
