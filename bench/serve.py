#!/usr/bin/env python3
"""Online serving benchmark: load against any OpenAI-compatible /v1/completions endpoint.

Two workloads:
  offline        the offline benchmark's request shapes: prompts of random token ids with
                 lengths uniform in [64, 512] (seed 0), 128 output tokens, ignore_eos, greedy
  shared-prefix  prompts whose first 75% is one prefix shared by every request, the rest
                 random per request (the case prefix caching is for)

Load: fixed concurrency (--concurrency) or Poisson arrivals (--request-rate, req/s).
Reports TTFT, inter-token latency (gaps between streamed tokens) and end-to-end latency
percentiles, plus request and token throughput.

Modes:
  bench/serve.py --url http://host:8000 --workload shared-prefix   # against a running server
  bench/serve.py --compare                                         # the issue's report, one run:
      (1) shared-prefix workload on `kvmesh serve` with prefix caching on vs off (median TTFT)
      (2) offline workload through `kvmesh serve` vs the offline API (LLM.generate) throughput
  Scale it down for a small machine with --num-requests / --output-len / --prefix-num-requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvmesh.common.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


# -- workloads ------------------------------------------------------------------------------------
@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


def offline_workload(n: int, min_len: int, max_len: int, output_len: int, vocab: int, seed: int = 0) -> list[Req]:
    # Same generator as bench/offline_throughput.py: the same prompts for the same seed.
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        out.append(Req([rng.randrange(0, vocab) for _ in range(length)], output_len))
    return out


def shared_prefix_workload(n: int, prompt_len: int, shared_frac: float, output_len: int, vocab: int,
                           seed: int = 0) -> list[Req]:
    rng = random.Random(seed + 1)
    shared = [rng.randrange(0, vocab) for _ in range(int(prompt_len * shared_frac))]
    return [Req(shared + [rng.randrange(0, vocab) for _ in range(prompt_len - len(shared))], output_len)
            for _ in range(n)]


# -- the load generator ---------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def _one(client: httpx.AsyncClient, url: str, model: str | None, req: Req, api_key: str | None) -> Result:
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("error"):
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("choices"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    u = chunk["usage"]
                    res.prompt_tokens = u["prompt_tokens"]
                    res.output_tokens = u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


async def run_load(url: str, reqs: list[Req], concurrency: int | None, rate: float | None,
                   model: str | None = None, api_key: str | None = None, label: str = "",
                   seed: int = 0) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=max(concurrency or 0, len(reqs)) + 8, max_keepalive_connections=64)
    results: list[Result] = []
    done = 0
    t0 = time.perf_counter()

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        async def tracked(req: Req) -> Result:
            nonlocal done
            r = await _one(client, url, model, req, api_key)
            done += 1
            if done % max(1, len(reqs) // 10) == 0 or done == len(reqs):
                print(f"  [{label}] {done}/{len(reqs)} done, {time.perf_counter() - t0:.1f}s", flush=True)
            return r

        if rate:  # Poisson arrivals, unbounded concurrency
            rng = random.Random(seed)
            tasks = []
            for req in reqs:
                tasks.append(asyncio.create_task(tracked(req)))
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
        else:
            sem = asyncio.Semaphore(concurrency or len(reqs))

            async def limited(req: Req) -> Result:
                async with sem:
                    return await tracked(req)

            results = list(await asyncio.gather(*(limited(r) for r in reqs)))
    return results, time.perf_counter() - t0


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(name: str, results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    e2e = [r.e2e for r in ok]
    s = {"name": name, "ok": len(ok), "failed": len(failed), "elapsed": elapsed,
         "req_s": len(ok) / elapsed, "out_tok_s": out_tok / elapsed, "total_tok_s": (in_tok + out_tok) / elapsed,
         "cached_frac": sum(r.cached_tokens for r in ok) / max(in_tok, 1),
         "ttft": ttft, "itl": itl, "e2e": e2e}
    print(f"\n== {name}: {len(ok)} ok, {len(failed)} failed in {elapsed:.1f}s; {s['req_s']:.2f} req/s, "
          f"{s['out_tok_s']:.1f} output tok/s, {s['total_tok_s']:.1f} total tok/s, "
          f"{100 * s['cached_frac']:.0f}% prompt tokens cached")
    print(f"   {'ms':<6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
    for label, vals in (("TTFT", ttft), ("ITL", itl), ("E2E", e2e)):
        mean = sum(vals) / len(vals) if vals else float("nan")
        print(f"   {label:<6} {1000 * mean:9.1f} {1000 * _pct(vals, 50):9.1f} {1000 * _pct(vals, 90):9.1f} "
              f"{1000 * _pct(vals, 99):9.1f}")
    if failed:
        print(f"   first error: {failed[0].error}")
    return s


# -- servers and the offline API for --compare ------------------------------------------------------
class LocalServer:
    def __init__(self, model: str, engine_flags: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", *engine_flags],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        self.wait_ready()
        return self

    def __exit__(self, *exc):
        self.stop()


def run_offline_api(model: str, reqs: list[Req], engine_kwargs: dict) -> tuple[float, int, int]:
    from kvmesh.engine import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs)
    llm.generate([reqs[0].prompt[:32]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    sp = SamplingParams(max_tokens=reqs[0].max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], sp, use_tqdm=True)
    elapsed = time.perf_counter() - start
    del llm
    return elapsed, sum(len(o.token_ids) for o in outs), sum(len(r.prompt) for r in reqs)


def compare(args) -> int:
    from kvmesh.engine.builtin import resolve_model_dir
    from kvmesh.engine.config import ModelConfig

    vocab = ModelConfig.from_dir(resolve_model_dir(args.model)).vocab_size
    engine_flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                    "--kv-cache-memory", args.kv_cache_memory]
    engine_kwargs = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    report = []

    # (1) shared prefix: caching on vs off.
    if not args.skip_prefix:
        reqs = shared_prefix_workload(args.prefix_num_requests, args.prefix_prompt_len, 0.75,
                                      args.prefix_output_len, vocab)
        warm = shared_prefix_workload(1, args.prefix_prompt_len, 0.75, 2, vocab, seed=99)
        print(f"shared-prefix workload: {len(reqs)} requests of {args.prefix_prompt_len} tokens "
              f"(75% shared), {args.prefix_output_len} output tokens, concurrency {args.prefix_concurrency}",
              flush=True)
        medians = {}
        for caching in ("on", "off"):
            flags = engine_flags + (["--enable-prefix-caching"] if caching == "on" else ["--no-enable-prefix-caching"])
            with LocalServer(args.model, flags, logs / f"serve-prefix-{caching}.log") as srv:
                # One warm-up request (random prompt, same length) for both: the shared prefix is
                # computed by the first measured requests, as in production.
                asyncio.run(run_load(srv.url, warm, 1, None, label="warm-up"))
                res, el = asyncio.run(run_load(srv.url, reqs, args.prefix_concurrency, args.request_rate,
                                               label=f"prefix caching {caching}"))
            s = summarize(f"shared-prefix, prefix caching {caching}", res, el)
            medians[caching] = _pct(s["ttft"], 50)
        ratio = medians["off"] / medians["on"]
        report.append(f"shared-prefix median TTFT: caching on {1000 * medians['on']:.1f} ms, off "
                      f"{1000 * medians['off']:.1f} ms -> {ratio:.2f}x lower with caching (target >= 3x)")

    # (2) the offline workload: server vs offline API.
    if not args.skip_offline:
        reqs = offline_workload(args.num_requests, args.min_len, args.max_len, args.output_len, vocab)
        print(f"\noffline workload: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, "
              f"{args.output_len} output tokens each", flush=True)
        elapsed, gen, prompt_tokens = run_offline_api(args.model, reqs, engine_kwargs)
        off_tps = (gen + prompt_tokens) / elapsed
        print(f"\n== offline API (LLM.generate): {elapsed:.1f}s, {gen / elapsed:.1f} output tok/s, "
              f"{off_tps:.1f} total tok/s")
        with LocalServer(args.model, engine_flags, logs / "serve-offline.log") as srv:
            asyncio.run(run_load(srv.url, [Req(reqs[0].prompt[:32], 4)], 1, None, label="warm-up"))
            res, el = asyncio.run(run_load(srv.url, reqs, args.concurrency or len(reqs), args.request_rate,
                                           label="offline workload via server"))
        s = summarize("offline workload via kvmesh serve", res, el)
        report.append(f"offline workload: server {s['out_tok_s']:.1f} output tok/s / {s['total_tok_s']:.1f} total "
                      f"tok/s vs offline API {gen / elapsed:.1f} / {off_tps:.1f} -> server keeps "
                      f"{100 * s['total_tok_s'] / off_tps:.0f}% (target >= 85%)")
    print("\n== summary")
    for line in report:
        print("  " + line)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--url", help="base URL of a running OpenAI-compatible server")
    ap.add_argument("--compare", action="store_true", help="run the issue's comparison (starts its own servers)")
    ap.add_argument("--workload", choices=["offline", "shared-prefix"], default="offline")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="--compare: the model to serve; --url: the `model` field sent")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-num-requests", type=int, default=32)
    ap.add_argument("--prefix-prompt-len", type=int, default=512)
    ap.add_argument("--prefix-output-len", type=int, default=16)
    ap.add_argument("--prefix-concurrency", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=None, help="fixed concurrency (default: all at once)")
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals (req/s) instead")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--log-dir", default="/tmp/kvmesh-bench-serve")
    args = ap.parse_args(argv)
    # On SIGTERM unwind normally, so the servers that --compare started are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.compare:
        return compare(args)
    if not args.url:
        ap.error("give --url (a running server) or --compare")
    vocab = 49152
    try:
        from kvmesh.common.models import find_model_dir
        from kvmesh.engine.config import ModelConfig

        vocab = ModelConfig.from_dir(find_model_dir(args.model)).vocab_size
    except Exception:  # noqa: BLE001 - any server: stay inside a common vocabulary size
        pass
    if args.workload == "offline":
        reqs = offline_workload(args.num_requests, args.min_len, args.max_len, args.output_len, vocab)
        conc = args.concurrency or len(reqs)
    else:
        reqs = shared_prefix_workload(args.prefix_num_requests, args.prefix_prompt_len, 0.75,
                                      args.prefix_output_len, vocab)
        conc = args.concurrency or args.prefix_concurrency
    res, el = asyncio.run(run_load(args.url.rstrip("/"), reqs, conc, args.request_rate, model=args.model,
                                   api_key=args.api_key, label=args.workload))
    summarize(f"{args.workload} workload against {args.url}", res, el)
    return 0


if __name__ == "__main__":
    sys.exit(main())
