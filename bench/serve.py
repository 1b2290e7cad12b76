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
  bench/serve.py --compare                                         # one run of both comparisons:
      (1) shared-prefix workload on `kvmesh serve` with prefix caching on vs off (median TTFT)
      (2) offline workload through `kvmesh serve` vs the offline API (LLM.generate) throughput
  Scale it down for a small machine with --num-requests / --output-len / --prefix-num-requests.
  bench/serve.py --compare-vllm auto                               # kvmesh serve vs vLLM serve
      three workloads (random 256 in / 128 out, 64 prompts, concurrency 16; prefix
      repetition: 4 prefixes of 384 + 128 random tokens, 32 out, 48 prompts, concurrency 8; long
      prompts 1,000 +- 500 in / 48 out, 40 prompts, concurrency 20; --workloads picks) on vLLM's
      server, on `kvmesh serve` and on the engine alone (LLMEngine in its own long-lived process with
      the server's thread settings and token budget, same requests, same concurrency), in --rounds
      interleaved rounds (order alternating, fresh prompts each round; all three stay up, the ones
      not measured paused by SIGSTOP; the host's steal time is noted where it shows). Reported: medians of
      the ratios paired within a round: total tok/s, TTFT p50, TPOT p50, ITL p50 (targets fp32
      >= 2.5x, <= 0.4x; bf16 >= 2x, <= 0.5x), and the server's share of the engine alone (target
      >= 95%; --skip-offline). `auto` starts vLLM's CPU build itself from the venv
      ../shared/bench/vllm_anchor.sh makes (`vllm_anchor.sh setup` first; VLLM_ANCHOR_VENV), with the
      anchor's flags and --dtype (both servers serve that dtype); a URL uses a vLLM server already
      running there. --client vllm drives every workload with vLLM's own client (`vllm bench
      serve`) instead of this script's. --kvmesh-url uses a running kvmesh server instead of
      starting one; --kvmesh-flags adds flags to the one started (e.g. "--engine-mode thread").
      --busy-neighbours 0,1 measures once quiet and once beside a busy-loop process (both servers
      under the same neighbours), then prints kvmesh/vLLM per pass and each server's share of its
      quiet throughput (targets: kvmesh keeps >= 45% beside one, >= 2x vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from kvmesh.common.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
# vllm_client.py beside this script (python -P leaves the script's folder out of sys.path)
sys.path.insert(0, str(ROOT / "bench"))

import ceiling  # noqa: E402
import vllm_client  # noqa: E402


# -- workloads ------------------------------------------------------------------------------------
@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


def offline_workload(
    n: int, min_len: int, max_len: int, output_len: int, vocab: int, seed: int = 0
) -> list[Req]:
    # Same generator as bench/offline_throughput.py: the same prompts for the same seed.
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        out.append(Req([rng.randrange(0, vocab) for _ in range(length)], output_len))
    return out


def shared_prefix_workload(
    n: int, prompt_len: int, shared_frac: float, output_len: int, vocab: int, seed: int = 0
) -> list[Req]:
    rng = random.Random(seed + 1)
    shared = [rng.randrange(0, vocab) for _ in range(int(prompt_len * shared_frac))]
    return [
        Req(shared + [rng.randrange(0, vocab) for _ in range(prompt_len - len(shared))], output_len)
        for _ in range(n)
    ]


def random_workload(
    n: int, input_len: int, output_len: int, vocab: int, seed: int = 0
) -> list[Req]:
    """vLLM bench's `random` dataset shape: fixed-length prompts of random token ids."""
    rng = random.Random(seed + 2)
    return [
        Req([rng.randrange(100, vocab) for _ in range(input_len)], output_len) for _ in range(n)
    ]


def long_prompt_workload(
    n: int, input_len: int, spread: int, output_len: int, vocab: int, seed: int = 0
) -> list[Req]:
    """vLLM bench's `random` dataset with a range ratio: prompt lengths uniform in
    [input_len - spread, input_len + spread]."""
    rng = random.Random(seed + 4)
    return [
        Req(
            [
                rng.randrange(100, vocab)
                for _ in range(rng.randint(input_len - spread, input_len + spread))
            ],
            output_len,
        )
        for _ in range(n)
    ]


def prefix_repetition_workload(
    n: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab: int,
    seed: int = 0,
) -> list[Req]:
    """vLLM bench's `prefix_repetition` shape: num_prefixes shared prefixes, a random suffix each,
    the prompts shuffled."""
    rng = random.Random(seed + 3)
    prefixes = [[rng.randrange(100, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    reqs = [
        Req(
            prefixes[i % num_prefixes] + [rng.randrange(100, vocab) for _ in range(suffix_len)],
            output_len,
        )
        for i in range(n)
    ]
    rng.shuffle(reqs)
    return reqs


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


async def _one(
    session: aiohttp.ClientSession, url: str, model: str | None, req: Req, api_key: str | None
) -> Result:
    body = {
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for raw in r.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
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
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
    except (TimeoutError, aiohttp.ClientError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


async def run_load(
    url: str,
    reqs: list[Req],
    concurrency: int | None,
    rate: float | None,
    model: str | None = None,
    api_key: str | None = None,
    label: str = "",
    seed: int = 0,
) -> tuple[list[Result], float]:
    """The load generator. aiohttp, as vLLM's own benchmark client: its C HTTP parser keeps the
    client's share of a small machine's CPU low (it runs beside the server it measures)."""
    connector = aiohttp.TCPConnector(limit=max(concurrency or 0, len(reqs)) + 8)
    timeout = aiohttp.ClientTimeout(total=3600, sock_connect=30)
    results: list[Result] = []
    done = 0
    t0 = time.perf_counter()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def tracked(req: Req) -> Result:
            nonlocal done
            r = await _one(session, url, model, req, api_key)
            done += 1
            if done % max(1, len(reqs) // 10) == 0 or done == len(reqs):
                print(
                    f"  [{label}] {done}/{len(reqs)} done, {time.perf_counter() - t0:.1f}s",
                    flush=True,
                )
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
    s = {
        "name": name,
        "ok": len(ok),
        "failed": len(failed),
        "elapsed": elapsed,
        "req_s": len(ok) / elapsed,
        "out_tok_s": out_tok / elapsed,
        "total_tok_s": (in_tok + out_tok) / elapsed,
        "cached_frac": sum(r.cached_tokens for r in ok) / max(in_tok, 1),
        "ttft": ttft,
        "itl": itl,
        "e2e": e2e,
        "lens": [(r.prompt_tokens, r.output_tokens) for r in ok],
    }
    print(
        f"\n== {name}: {len(ok)} ok, {len(failed)} failed in {elapsed:.1f}s; {s['req_s']:.2f} req/s, "
        f"{s['out_tok_s']:.1f} output tok/s, {s['total_tok_s']:.1f} total tok/s, "
        f"{100 * s['cached_frac']:.0f}% prompt tokens cached"
    )
    print(f"   {'ms':<6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
    for label, vals in (("TTFT", ttft), ("ITL", itl), ("E2E", e2e)):
        mean = sum(vals) / len(vals) if vals else float("nan")
        print(
            f"   {label:<6} {1000 * mean:9.1f} {1000 * _pct(vals, 50):9.1f} {1000 * _pct(vals, 90):9.1f} "
            f"{1000 * _pct(vals, 99):9.1f}"
        )
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
        # Its own session (process group): pause() stops the server and its engine core together.
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "serve",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *engine_flags,
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def pause(self) -> None:
        """SIGSTOP the server's process group: a paused server takes no CPU at all. An idle one
        still does: vLLM's CPU worker polls (1-2% of a CPU), and on 2 CPUs each of its wake-ups
        stalls the measured engine's OpenMP team at a barrier (it cost kvmesh ~9% throughput)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()  # a stopped process would hold the SIGTERM until continued
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        try:
            self.wait_ready()
        except BaseException:  # __exit__ is not called when __enter__ raises
            self.stop()
            raise
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


def offline_engine(model: str, dtype: str, budget: int):
    """The engine alone (LLMEngine: no HTTP, no core process), warmed up. `budget`: the token budget
    per step (serve_budget: the server's)."""
    from kvmesh.engine import EngineArgs, SamplingParams
    from kvmesh.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, dtype=dtype, max_num_batched_tokens=budget))
    engine.add_request(
        list(range(100, 164)), SamplingParams(max_tokens=4, temperature=0.0)
    )  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def offline_closed_loop(
    engine, prompts: list[list[int]], max_tokens: list[int], concurrency: int
) -> tuple[float, int, int]:
    """The requests on the engine alone at the server's concurrency, closed loop: (seconds, prompt
    tokens, output tokens). The yardstick for the serving path's own cost (the target: the
    server keeps >= 95% of it)."""
    from kvmesh.engine import SamplingParams

    todo = list(zip(prompts, max_tokens))
    in_flight, out_tokens = 0, 0
    start = time.perf_counter()
    while todo or in_flight:
        while todo and in_flight < concurrency:
            prompt, n = todo.pop(0)
            engine.add_request(
                prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            )
            in_flight += 1
        for o in engine.step():
            if o.finished:
                in_flight -= 1
                out_tokens += len(o.token_ids)
    return time.perf_counter() - start, sum(len(p) for p in prompts), out_tokens


def _offline_worker(conn, model: str, dtype: str, budget: int) -> None:
    """OfflineEngine's process: one engine, built once, runs each workload it is sent."""
    try:
        engine = offline_engine(model, dtype, budget)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while (job := conn.recv()) is not None:
        try:
            conn.send(("ok", offline_closed_loop(engine, *job)))
        except Exception as exc:  # noqa: BLE001 - reported; the next run starts clean
            engine.abort_request(list(engine.states))
            while engine.has_unfinished_requests():
                engine.step()
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class OfflineEngine:
    """The engine alone in one long-lived process, started with the environment `kvmesh serve`
    gives its engine core (thread count, OpenMP spin: engine/threads.py) and the server's token
    budget, so it differs from the server only by the serving path; paused (SIGSTOP) like the
    servers while another part runs.

    Long-lived like the servers, not a fresh process per run: on this machine (a VM) gigabytes
    freed by an exiting process are reclaimed by the host over the next ~20 s, and while the
    guest's CPUs are busy that shows as steal time: 8% of both CPUs, 12% of the next server run's
    throughput (docs/engine-server.md)."""

    def __init__(self, model: str, dtype: str, budget: int):
        import multiprocessing

        from kvmesh.engine.threads import core_environment, plan_threads

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        saved = dict(os.environ)
        os.environ.update(
            core_environment(plan_threads())
        )  # a spawned child takes os.environ as it starts
        try:
            self.proc = ctx.Process(
                target=_offline_worker, args=(child, model, dtype, budget), daemon=True
            )
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        child.close()
        self._answer()  # ready

    def _answer(self):
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the offline engine's process exited ({self.proc.exitcode})"
            ) from None
        if kind == "error":
            raise RuntimeError(f"offline engine: {value}")
        return value

    def run(self, reqs: list[Req], concurrency: int) -> tuple[float, int, int]:
        self.conn.send(([r.prompt for r in reqs], [r.max_tokens for r in reqs], concurrency))
        return self._answer()

    def pause(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def serve_budget(flags: list[str]) -> int:
    """The token budget `kvmesh serve` runs with under these flags, as serve's own parser and
    defaults resolve it."""
    import argparse

    from kvmesh.engine.cli_args import engine_args_from
    from kvmesh.engine.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return engine_args_from(parser.parse_known_args(flags)[0], server=True).max_num_batched_tokens


def compare(args) -> int:
    from kvmesh.engine.builtin import resolve_model_dir
    from kvmesh.engine.config import ModelConfig

    vocab = ModelConfig.from_dir(resolve_model_dir(args.model)).vocab_size
    engine_flags = [
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory",
        args.kv_cache_memory,
    ]
    engine_kwargs = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    )
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    report = []

    # (1) shared prefix: caching on vs off.
    if not args.skip_prefix:
        reqs = shared_prefix_workload(
            args.prefix_num_requests, args.prefix_prompt_len, 0.75, args.prefix_output_len, vocab
        )
        warm = shared_prefix_workload(1, args.prefix_prompt_len, 0.75, 2, vocab, seed=99)
        print(
            f"shared-prefix workload: {len(reqs)} requests of {args.prefix_prompt_len} tokens "
            f"(75% shared), {args.prefix_output_len} output tokens, concurrency {args.prefix_concurrency}",
            flush=True,
        )
        medians = {}
        for caching in ("on", "off"):
            flags = engine_flags + (
                ["--enable-prefix-caching"] if caching == "on" else ["--no-enable-prefix-caching"]
            )
            with LocalServer(args.model, flags, logs / f"serve-prefix-{caching}.log") as srv:
                # One warm-up request (random prompt, same length) for both: the shared prefix is
                # computed by the first measured requests, as in production.
                asyncio.run(run_load(srv.url, warm, 1, None, label="warm-up"))
                res, el = asyncio.run(
                    run_load(
                        srv.url,
                        reqs,
                        args.prefix_concurrency,
                        args.request_rate,
                        label=f"prefix caching {caching}",
                    )
                )
            s = summarize(f"shared-prefix, prefix caching {caching}", res, el)
            medians[caching] = _pct(s["ttft"], 50)
        ratio = medians["off"] / medians["on"]
        report.append(
            f"shared-prefix median TTFT: caching on {1000 * medians['on']:.1f} ms, off "
            f"{1000 * medians['off']:.1f} ms -> {ratio:.2f}x lower with caching (target >= 3x)"
        )

    # (2) the offline workload: server vs offline API.
    if not args.skip_offline:
        reqs = offline_workload(
            args.num_requests, args.min_len, args.max_len, args.output_len, vocab
        )
        print(
            f"\noffline workload: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, "
            f"{args.output_len} output tokens each",
            flush=True,
        )
        elapsed, gen, prompt_tokens = run_offline_api(args.model, reqs, engine_kwargs)
        off_tps = (gen + prompt_tokens) / elapsed
        print(
            f"\n== offline API (LLM.generate): {elapsed:.1f}s, {gen / elapsed:.1f} output tok/s, "
            f"{off_tps:.1f} total tok/s"
        )
        with LocalServer(args.model, engine_flags, logs / "serve-offline.log") as srv:
            asyncio.run(run_load(srv.url, [Req(reqs[0].prompt[:32], 4)], 1, None, label="warm-up"))
            res, el = asyncio.run(
                run_load(
                    srv.url,
                    reqs,
                    args.concurrency or len(reqs),
                    args.request_rate,
                    label="offline workload via server",
                )
            )
        s = summarize("offline workload via kvmesh serve", res, el)
        report.append(
            f"offline workload: server {s['out_tok_s']:.1f} output tok/s / {s['total_tok_s']:.1f} total "
            f"tok/s vs offline API {gen / elapsed:.1f} / {off_tps:.1f} -> server keeps "
            f"{100 * s['total_tok_s'] / off_tps:.0f}% (target >= 85%)"
        )
    print("\n== summary")
    for line in report:
        print("  " + line)
    return 0


# -- kvmesh serve vs vLLM serve ------------------------------------------------------------------------
# The vLLM anchor script, beside the checkout (relative to the repository root).
VLLM_ANCHOR = str(
    Path(__file__).resolve().parents[1] / ".." / "shared" / "bench" / "vllm_anchor.sh"
)


class VLLMServer(LocalServer):
    """`vllm serve` of vLLM's CPU build from the venv `vllm_anchor.sh setup` made (the anchor's
    own flags: max model length 2048, its KV cache space), in a dtype, with extra flags."""

    def __init__(
        self,
        anchor: str,
        model_dir: str,
        name: str,
        log_path: Path,
        dtype: str = "float32",
        extra: list[str] | None = None,
    ):
        del anchor  # its venv is used directly: the script's `serve` takes no dtype or extra flags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
        cmd = [
            str(vllm_client.anchor_venv() / "bin" / "vllm"),
            "serve",
            model_dir,
            "--served-model-name",
            name,
        ]
        cmd += [
            "--dtype",
            dtype,
            "--max-model-len",
            "2048",
            "--port",
            str(self.port),
            *(extra or []),
        ]
        # cwd: not the repository root, whose operator/ would shadow the stdlib's in vLLM's `python -m` children
        self.proc = subprocess.Popen(
            cmd,
            cwd=log_path.parent,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 1200) -> None:
        """vLLM has no /ready: its /v1/models answers once the engine is up (its first start
        compiles, minutes on a small machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError("vllm serve did not become ready")

    def stop(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: vllm's engine process too
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _tpot(results: list[Result]) -> list[float]:
    return [
        (r.e2e - r.ttft) / (r.output_tokens - 1) for r in results if r.ok and r.output_tokens > 1
    ]


def _anchor_workloads(vocab: int, args, seed: int = 0) -> list[tuple[str, str, list[Req], int]]:
    """The workloads of --compare-vllm that --workloads names: (kind: random, prefix or long,
    name, requests, concurrency)."""
    workloads = [
        (
            f"random {args.random_input_len} in / {args.random_output_len} out, {args.random_num_prompts} prompts, "
            f"concurrency {args.random_concurrency}",
            random_workload(
                args.random_num_prompts, args.random_input_len, args.random_output_len, vocab, seed
            ),
            args.random_concurrency,
        ),
        (
            f"prefix_repetition {args.prefix_rep_prefix_len}+{args.prefix_rep_suffix_len}, "
            f"{args.prefix_rep_num_prefixes} prefixes, {args.prefix_rep_output_len} out, {args.prefix_rep_num_prompts} "
            f"prompts, concurrency {args.prefix_rep_concurrency}",
            prefix_repetition_workload(
                args.prefix_rep_num_prompts,
                args.prefix_rep_prefix_len,
                args.prefix_rep_suffix_len,
                args.prefix_rep_num_prefixes,
                args.prefix_rep_output_len,
                vocab,
                seed,
            ),
            args.prefix_rep_concurrency,
        ),
        (
            f"long prompts {args.long_input_len} +- {args.long_input_spread} in / "
            f"{args.long_output_len} out, {args.long_num_prompts} prompts, concurrency "
            f"{args.long_concurrency}",
            long_prompt_workload(
                args.long_num_prompts,
                args.long_input_len,
                args.long_input_spread,
                args.long_output_len,
                vocab,
                seed,
            ),
            args.long_concurrency,
        ),
    ]
    keep = [w.strip() for w in args.workloads.split(",")]
    kinds = ("random", "prefix", "long")
    return [(kind, *w) for w, kind in zip(workloads, kinds) if kind in keep]


def _bench_server(
    label: str,
    url: str,
    model: str,
    tokenizer: str,
    work: tuple[str, str, list[Req], int],
    seed: int,
    args,
) -> dict:
    """One workload against one server, by this script's client or (--client vllm) vLLM's, which
    tokenizes with the served model's tokenizer (its directory)."""
    kind, name, reqs, conc = work
    if args.client == "vllm":
        print(f"  [{label}: {name[:24]}] vllm bench serve", flush=True)
        return vllm_client.run(url, model, tokenizer, kind, args, seed)
    res, el = asyncio.run(
        run_load(url, reqs, conc, None, model=model, label=f"{label}: {name[:24]}")
    )
    s = summarize(f"{label}: {name}", res, el)
    s["tpot"] = _tpot(res)
    return s


def _cpu_times() -> list[int]:
    """/proc/stat's all-CPU line: user nice system idle iowait irq softirq steal ..."""
    return [int(x) for x in open("/proc/stat").readline().split()[1:]]


def _machine_busy(seconds: float = 2.0) -> float:
    """The fraction of all CPUs busy over `seconds`: what the idle parts cost the one measured."""
    t0 = _cpu_times()
    time.sleep(seconds)
    d = [b - a for a, b in zip(t0, _cpu_times())]
    return 1 - (d[3] + d[4]) / max(sum(d), 1)


def _steal(t0: list[int], t1: list[int]) -> float:
    """The fraction of CPU time the hypervisor took between two _cpu_times() (0 on bare metal)."""
    d = [b - a for a, b in zip(t0, t1)]
    return d[7] / max(sum(d[:8]), 1) if len(d) > 7 else 0.0


def _median(values: list[float]) -> float:
    return _pct(values, 50)


def compare_vllm(args) -> int:
    """kvmesh serve against vLLM's CPU server, in interleaved rounds. This machine's speed drifts by 10-30% within a
    run, so measuring each side once, one after the other, lets the drift pick the winner. Both
    servers and the engine alone stay up, the ones not being measured paused (their pause()), and
    every round runs each workload on vLLM, kvmesh and the engine alone back to back, in
    alternating order, with fresh prompts (a new seed: no round hits the prefix cache an earlier
    one filled). The ratios are taken within a round and the report gives their median."""
    import contextlib

    import torch

    from kvmesh.engine.builtin import resolve_model_dir
    from kvmesh.engine.config import ModelConfig

    model_dir = str(resolve_model_dir(args.model))
    config = ModelConfig.from_dir(model_dir)
    vocab = config.vocab_size
    name = args.model
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    kvmesh_flags = args.kvmesh_flags.split()
    budget = serve_budget(kvmesh_flags)
    started: dict = {}  # the servers (and the offline engine) this run started, which it can pause
    with contextlib.ExitStack() as stack:
        if args.compare_vllm == "auto":
            print("starting vllm serve (its first start compiles: minutes)", flush=True)
            started["vllm"] = stack.enter_context(
                VLLMServer(
                    args.vllm_anchor, model_dir, name, logs / "vllm-serve.log", dtype=args.dtype
                )
            )
            vllm_url = started["vllm"].url
        else:
            vllm_url = args.compare_vllm.rstrip("/")
        if args.kvmesh_url:
            kvmesh_url = args.kvmesh_url.rstrip("/")
        else:
            print("starting kvmesh serve", flush=True)
            flags = ["--served-model-name", name, "--dtype", args.dtype, *kvmesh_flags]
            started["kvmesh"] = stack.enter_context(
                LocalServer(args.model, flags, logs / "kvmesh-serve.log")
            )
            kvmesh_url = started["kvmesh"].url
        if not args.skip_offline:
            print(
                "starting the offline engine (the engine alone, in its own long-lived process)",
                flush=True,
            )
            started["offline"] = stack.enter_context(OfflineEngine(args.model, args.dtype, budget))
        warm = random_workload(2, 64, 4, vocab, seed=99)
        for label, url in (("vllm serve", vllm_url), ("kvmesh serve", kvmesh_url)):
            asyncio.run(run_load(url, warm, 2, None, model=name, label=f"{label} warm-up"))
        print(
            f"waiting {args.settle:.0f} s for the host to reclaim the memory the start-ups freed "
            "(while it does, it takes CPU time from this machine: steal)",
            flush=True,
        )
        time.sleep(args.settle)
        busy = _machine_busy()
        print(
            f"all up and idle: the machine is {100 * busy:.1f}% busy; each part runs with the "
            f"others paused (SIGSTOP: {', '.join(started) or 'none started here'})",
            flush=True,
        )

        def offline(work: tuple[str, str, list[Req], int], seed: int) -> dict:
            _, wname, reqs, conc = work
            print(f"  [offline engine: {wname[:24]}] running", flush=True)
            elapsed, in_tok, out_tok = started["offline"].run(reqs, conc)
            return {"total_tok_s": (in_tok + out_tok) / elapsed}

        def alone(part: str, fn):
            """fn with everything this run started, except the part it measures, paused; the
            result notes the CPU time the host took meanwhile (steal)."""

            def run(*a):
                others = [srv for p, srv in started.items() if p != part]
                for srv in others:
                    srv.pause()
                try:
                    t0 = _cpu_times()
                    out = fn(*a)
                    out["steal"] = _steal(t0, _cpu_times())
                    return out
                finally:
                    for srv in others:
                        srv.resume()

            return run

        parts = {
            "vllm": alone(
                "vllm",
                lambda w, seed: _bench_server(
                    "vllm serve", vllm_url, name, model_dir, w, seed, args
                ),
            ),
            "kvmesh": alone(
                "kvmesh",
                lambda w, seed: _bench_server(
                    "kvmesh serve", kvmesh_url, name, model_dir, w, seed, args
                ),
            ),
        }
        if not args.skip_offline:
            parts["offline"] = alone("offline", offline)
        workloads = _anchor_workloads(vocab, args)
        kinds, names = [w[0] for w in workloads], [w[1] for w in workloads]
        print("measuring the matmul peak (everything else paused)", flush=True)
        dtype = getattr(torch, args.dtype)
        peak = alone("peak", lambda: {"flop_s": ceiling.matmul_peak(dtype)})()["flop_s"]
        passes: dict[int, list[dict[str, list[dict]]]] = {}  # busy neighbours -> results
        for i, n in enumerate(args.busy_neighbours):
            with busy_neighbours(n):
                # fresh prompts per pass: a pass never hits the prefix cache of the one before
                passes[n] = _rounds(parts, vocab, args, first_seed=100_000 * i)
    for n, results in passes.items():
        if len(passes) > 1:
            print(f"\n== with {n} busy neighbour process(es)")
        _print_report(names, results, args.rounds)
    if 0 in passes and len(passes) > 1:
        _print_busy_report(names, passes)
    _print_ceiling(names, kinds, passes, peak, ceiling.ModelCost.of(config), args)
    return 0


def _print_ceiling(
    names: list[str],
    kinds: list[str],
    passes: dict[int, list[dict[str, list[dict]]]],
    peak: float,
    cost: ceiling.ModelCost,
    args,
) -> None:
    """Each workload's arithmetic ceiling (bench/ceiling.py) from the prompts vLLM's run served:
    the most total tok/s any engine could reach, against vLLM's and kvmesh's."""
    cpus = ceiling.engine_cpus()
    goals = {0: 2.5 if args.dtype == "float32" else 2.0}
    print(
        f"\n== the arithmetic ceiling: each workload's FLOPs at the {args.dtype} matmul peak measured "
        f"in this run ({peak / 1e9:.1f} GFLOP/s on {cpus:g} CPUs; beside n busy processes "
        f"{cpus:g}/({cpus:g}+n) of it): no engine that runs every layer on every token passes it"
    )
    print(
        f"   {'workload':<58} {'busy':>4} {'ceiling':>8} {'/ vllm':>7} {'goal':>5} "
        f"{'kvmesh at':>10} {'vllm at':>8}"
    )
    for wi, (wname, kind) in enumerate(zip(names, kinds)):
        for n, results in passes.items():
            res = results[wi]
            tops, over_v, at_k, at_v = [], [], [], []
            for v, k in zip(res["vllm"], res["kvmesh"]):
                lens = v.get("lens") or k.get("lens") or []
                if not lens:
                    continue
                if kind == "prefix":
                    cached = ceiling.repeated_prefix_cached(
                        len(lens), args.prefix_rep_num_prefixes, args.prefix_rep_prefix_len
                    )
                else:
                    cached = [0] * len(lens)
                reqs = [(p, c, o) for (p, o), c in zip(lens, cached)]
                top = ceiling.ceiling_tok_s(cost, reqs, peak * ceiling.share_beside(cpus, n))
                tops.append(top)
                over_v.append(top / v["total_tok_s"])
                at_k.append(k["total_tok_s"] / top)
                at_v.append(v["total_tok_s"] / top)
            if not tops:
                continue
            goal = goals.get(n, 2.0)
            print(
                f"   {wname[:58]:<58} {n:>4} {_median(tops):8.1f} {_median(over_v):6.2f}x "
                f"{goal:4.1f}x {100 * _median(at_k):9.1f}% {100 * _median(at_v):7.1f}%"
            )


@contextlib.contextmanager
def busy_neighbours(n: int):
    """n processes that busy-loop beside the servers (both measured under the same ones): the
    other pods of a busy node."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    if n:
        print(f"\n== {n} busy neighbour process(es) running (pids {[p.pid for p in procs]})")
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _rounds(parts: dict, vocab: int, args, first_seed: int = 0) -> list[dict[str, list[dict]]]:
    """args.rounds interleaved rounds of every workload on every part; [workload][part]: one
    summary per round."""
    num_workloads = len(_anchor_workloads(vocab, args))
    results: list[dict[str, list[dict]]] = [{p: [] for p in parts} for _ in range(num_workloads)]
    for rnd in range(args.rounds):
        order = list(parts) if rnd % 2 == 0 else list(parts)[::-1]
        seed = first_seed + 1000 * rnd
        for wi, work in enumerate(_anchor_workloads(vocab, args, seed=seed)):
            print(
                f"\n-- round {rnd + 1}/{args.rounds}, {work[1][:40]}: {' -> '.join(order)}",
                flush=True,
            )
            for part in order:
                results[wi][part].append(parts[part](work, seed))
            _print_round(results[wi], rnd)
    return results


def _print_busy_report(names: list[str], passes: dict[int, list[dict[str, list[dict]]]]) -> None:
    """Throughput beside busy neighbours: kvmesh/vLLM within each pass (paired by round), and
    each server's share of its own quiet throughput (the medians of the pass without neighbours)."""
    print(
        "\n== beside busy neighbours (targets: kvmesh keeps >= 45% of its quiet total tok/s and "
        ">= 2x vLLM's)"
    )
    print(
        f"   {'workload':<58} {'busy':>4} {'vllm':>8} {'kvmesh':>8} {'ratio':>7} {'kvmesh keeps':>13} {'vllm keeps':>11}"
    )
    for wi, wname in enumerate(names):
        quiet = {
            p: _median([s["total_tok_s"] for s in passes[0][wi][p]]) for p in ("vllm", "kvmesh")
        }
        for n, results in passes.items():
            res = results[wi]
            v = [s["total_tok_s"] for s in res["vllm"]]
            k = [s["total_tok_s"] for s in res["kvmesh"]]
            ratio = _median([b / a if a else float("nan") for a, b in zip(v, k)])
            print(
                f"   {wname[:58]:<58} {n:>4} {_median(v):8.1f} {_median(k):8.1f} {ratio:6.2f}x "
                f"{100 * _median(k) / quiet['kvmesh']:12.1f}% {100 * _median(v) / quiet['vllm']:10.1f}%"
            )


def _print_round(res: dict[str, list[dict]], rnd: int) -> None:
    v, k = res["vllm"][rnd], res["kvmesh"][rnd]
    line = (
        f"   round {rnd + 1}: total tok/s vllm {v['total_tok_s']:.1f} kvmesh {k['total_tok_s']:.1f} "
        f"= {k['total_tok_s'] / v['total_tok_s']:.2f}x; TTFT p50 {1000 * _pct(v['ttft'], 50):.0f} / "
        f"{1000 * _pct(k['ttft'], 50):.0f} ms = {_pct(k['ttft'], 50) / _pct(v['ttft'], 50):.2f}x"
    )
    if "offline" in res:
        o = res["offline"][rnd]
        line += f"; offline {o['total_tok_s']:.1f} tok/s, server keeps {100 * k['total_tok_s'] / o['total_tok_s']:.1f}%"
    steal = {p: runs[rnd]["steal"] for p, runs in res.items() if "steal" in runs[rnd]}
    if any(x >= 0.01 for x in steal.values()):
        line += (
            "\n   (host steal: "
            + ", ".join(f"{p} {100 * x:.1f}%" for p, x in steal.items())
            + " of CPU time)"
        )
    print(line, flush=True)


def _print_report(names: list[str], results: list[dict[str, list[dict]]], rounds: int) -> None:
    print(
        f"\n== kvmesh serve vs vllm serve (same machine, same client, {rounds} interleaved rounds; medians; "
        "ratios paired within a round; targets fp32: >= 2.5x total tok/s, <= 0.4x TTFT p50; bf16: >= 2x, <= 0.5x; server >= 95% of offline)"
    )
    print(f"   {'workload':<58} {'metric':<14} {'vllm':>10} {'kvmesh':>10} {'ratio':>7}  per round")
    for wname, res in zip(names, results):
        metrics = [
            ("total tok/s", lambda s: s["total_tok_s"], 1.0),
            ("TTFT p50 ms", lambda s: _pct(s["ttft"], 50), 1000.0),
            ("TPOT p50 ms", lambda s: _pct(s["tpot"], 50), 1000.0),
            ("ITL p50 ms", lambda s: _pct(s["itl"], 50), 1000.0),
        ]
        for metric, get, scale in metrics:
            v = [get(s) for s in res["vllm"]]
            k = [get(s) for s in res["kvmesh"]]
            ratios = [b / a if a else float("nan") for a, b in zip(v, k)]
            print(
                f"   {wname[:58]:<58} {metric:<14} {scale * _median(v):10.1f} {scale * _median(k):10.1f} "
                f"{_median(ratios):6.2f}x  {' '.join(f'{x:.2f}' for x in ratios)}"
            )
        if "offline" in res:
            o = [s["total_tok_s"] for s in res["offline"]]
            shares = [s["total_tok_s"] / b for s, b in zip(res["kvmesh"], o)]
            print(
                f"   {wname[:58]:<58} {'offline tok/s':<14} {'':>10} {_median(o):10.1f} "
                f"server keeps {100 * _median(shares):.1f}%  {' '.join(f'{100 * x:.0f}%' for x in shares)}"
            )
        failed = [(p, sum(s["failed"] for s in res[p])) for p in ("vllm", "kvmesh")]
        if any(n for _, n in failed):
            print(f"   (failed requests: {', '.join(f'{p} {n}' for p, n in failed)})")


def _counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"non-negative counts, comma-separated: {text!r}")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--url", help="base URL of a running OpenAI-compatible server")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="prefix caching on vs off, and the server vs the offline API (starts its own servers)",
    )
    ap.add_argument(
        "--compare-vllm",
        metavar="URL|auto",
        default=None,
        help="the comparison against vLLM's server at URL (auto: start it with --vllm-anchor)",
    )
    ap.add_argument(
        "--vllm-anchor",
        default=VLLM_ANCHOR,
        help="vllm_anchor.sh, which serves vLLM's CPU build (default: ../shared/bench/vllm_anchor.sh from the repository root)",
    )
    ap.add_argument(
        "--kvmesh-url",
        default=None,
        help="--compare-vllm: a running kvmesh server (else one is started)",
    )
    ap.add_argument(
        "--kvmesh-flags", default="", help="--compare-vllm: extra `kvmesh serve` flags, one string"
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="--compare-vllm: seconds to wait after the start-ups before measuring",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="--compare-vllm: interleaved rounds (each: every workload on vllm, kvmesh, offline)",
    )
    ap.add_argument(
        "--client",
        choices=["kvmesh", "vllm"],
        default="kvmesh",
        help="--compare-vllm: the load generator: this script's client, or vLLM's own "
        "(`vllm bench serve` from the anchor's venv; the long workload as its random dataset "
        "with an input range ratio)",
    )
    ap.add_argument(
        "--busy-neighbours",
        type=_counts,
        default=[0],
        metavar="N[,N...]",
        help="--compare-vllm: one pass per value, with N busy-loop processes beside the servers "
        "(e.g. 0,1: quiet and one neighbour; with 0 and another, each server's share of its "
        "quiet throughput is printed)",
    )
    ap.add_argument("--random-num-prompts", type=int, default=64)
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-concurrency", type=int, default=16)
    ap.add_argument("--prefix-rep-num-prompts", type=int, default=48)
    ap.add_argument("--prefix-rep-prefix-len", type=int, default=384)
    ap.add_argument("--prefix-rep-suffix-len", type=int, default=128)
    ap.add_argument("--prefix-rep-num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-rep-output-len", type=int, default=32)
    ap.add_argument("--prefix-rep-concurrency", type=int, default=8)
    ap.add_argument("--workload", choices=["offline", "shared-prefix"], default="offline")
    ap.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="--compare: the model to serve; --url: the `model` field sent",
    )
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-num-requests", type=int, default=32)
    ap.add_argument("--prefix-prompt-len", type=int, default=512)
    ap.add_argument("--prefix-output-len", type=int, default=16)
    ap.add_argument("--prefix-concurrency", type=int, default=4)
    ap.add_argument(
        "--concurrency", type=int, default=None, help="fixed concurrency (default: all at once)"
    )
    ap.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals (req/s) instead"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--long-num-prompts", type=int, default=40)
    ap.add_argument("--long-input-len", type=int, default=1000)
    ap.add_argument("--long-input-spread", type=int, default=500)
    ap.add_argument("--long-output-len", type=int, default=48)
    ap.add_argument("--long-concurrency", type=int, default=20)
    ap.add_argument(
        "--workloads",
        default="random,prefix,long",
        help="--compare-vllm: which of its workloads run (random, prefix, long)",
    )
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--log-dir", default="/tmp/kvmesh-bench-serve")
    args = ap.parse_args(argv)
    # On SIGTERM unwind normally, so the servers that --compare started are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.compare_vllm:
        return compare_vllm(args)
    if args.compare:
        return compare(args)
    if not args.url:
        ap.error("give --url (a running server) or --compare")
    vocab = 49152
    try:
        from kvmesh.common.model_lookup import find_model_dir
        from kvmesh.engine.config import ModelConfig

        vocab = ModelConfig.from_dir(find_model_dir(args.model)).vocab_size
    except Exception:  # noqa: BLE001 - any server: stay inside a common vocabulary size
        pass
    if args.workload == "offline":
        reqs = offline_workload(
            args.num_requests, args.min_len, args.max_len, args.output_len, vocab
        )
        conc = args.concurrency or len(reqs)
    else:
        reqs = shared_prefix_workload(
            args.prefix_num_requests, args.prefix_prompt_len, 0.75, args.prefix_output_len, vocab
        )
        conc = args.concurrency or args.prefix_concurrency
    res, el = asyncio.run(
        run_load(
            args.url.rstrip("/"),
            reqs,
            conc,
            args.request_rate,
            model=args.model,
            api_key=args.api_key,
            label=args.workload,
        )
    )
    summarize(f"{args.workload} workload against {args.url}", res, el)
    return 0


if __name__ == "__main__":
    sys.exit(main())
