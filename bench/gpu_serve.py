#!/usr/bin/env python3
"""Online serving on a GPU (part of bench/gpu_check.sh): `kvmesh serve` (engine core process,
async scheduling and CUDA graphs, the GPU defaults) under a closed-loop client at several
concurrencies, then the engine alone (LLMEngine, no HTTP, no core process) on the same requests
at the top concurrency: the server's share of it is what the serving path costs.

Workloads (bench/serve.py's generators and client):
  random         fixed-length prompts of random token ids (--input-len, default 512) and
                 --output-len (128) tokens, ignore_eos, greedy; a fresh seed per concurrency, so
                 no level hits the prefix cache an earlier one filled
  shared-prefix  prompts of --input-len tokens whose first 75% is one prefix shared by all

Per level: request and token throughput, TTFT and TPOT (per request: (E2E - TTFT) / (tokens - 1))
p50 / p99, ITL p50 / p99. The server is checked up (/ready, then a warm-up whose requests must all
succeed) before any load; if it dies, its log's tail is printed.

    python bench/gpu_serve.py --model DIR [--concurrency 1,16,64,256] [--requests 8,64,128,512]
        [--offline-at 256] [--json figures.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/serve.py: the client and workloads

from serve import (  # noqa: E402
    LocalServer,
    Req,
    _pct,
    _tpot,
    random_workload,
    run_load,
    shared_prefix_workload,
    summarize,
)


def parse_levels(concurrency: str, requests: str) -> list[tuple[int, int]]:
    """'1,16,64' and '8,64,128' -> [(1, 8), (16, 64), (64, 128)]: one request count per level,
    at least the concurrency (a level must fill its concurrency at least once)."""
    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    counts = [int(n) for n in requests.split(",") if n.strip()]
    if len(levels) != len(counts):
        raise ValueError(
            f"--concurrency has {len(levels)} levels but --requests {len(counts)} counts"
        )
    for c, n in zip(levels, counts):
        if c < 1 or n < c:
            raise ValueError(
                f"concurrency {c} with {n} requests: need 1 <= concurrency <= requests"
            )
    return list(zip(levels, counts))


def figures(s: dict) -> dict:
    """The JSON figures of one summary (milliseconds for latencies)."""
    ms = lambda values, p: round(1000 * _pct(values, p), 2)  # noqa: E731
    return {
        "ok": s["ok"],
        "failed": s["failed"],
        "elapsed_s": round(s["elapsed"], 2),
        "req_s": round(s["req_s"], 2),
        "out_tok_s": round(s["out_tok_s"], 1),
        "total_tok_s": round(s["total_tok_s"], 1),
        "cached_frac": round(s["cached_frac"], 3),
        "ttft_p50_ms": ms(s["ttft"], 50),
        "ttft_p99_ms": ms(s["ttft"], 99),
        "tpot_p50_ms": ms(s["tpot"], 50),
        "tpot_p99_ms": ms(s["tpot"], 99),
        "itl_p50_ms": ms(s["itl"], 50),
        "itl_p99_ms": ms(s["itl"], 99),
    }


def engine_alone(
    model: str,
    dtype: str,
    max_num_seqs: int,
    kv_cache_memory: str,
    budget: int,
    reqs: list[Req],
    concurrency: int,
    warm_reqs: list[Req] | None = None,
) -> dict:
    """The same requests on LLMEngine in this process (the server stopped: the GPU is free),
    closed loop at the same concurrency, warmed up the same way as the server (and, with
    warm_reqs, after the same warm pass)."""
    import torch

    from kvmesh.engine import EngineArgs, SamplingParams
    from kvmesh.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(
            model=model,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            kv_cache_memory=kv_cache_memory,
            max_num_batched_tokens=budget,
        )
    )
    try:
        for w in warmup_requests(len(reqs[0].prompt), engine.core.model_config.vocab_size):
            engine.add_request(
                w.prompt, SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True)
            )
        while engine.has_unfinished_requests():
            engine.step()

        def closed_loop(batch: list[Req]) -> tuple[float, int]:
            todo = list(batch)
            in_flight = out_tokens = 0
            start = time.perf_counter()
            while todo or in_flight:
                while todo and in_flight < concurrency:
                    r = todo.pop(0)
                    engine.add_request(
                        r.prompt,
                        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
                    )
                    in_flight += 1
                for o in engine.step():
                    if o.finished:
                        in_flight -= 1
                        out_tokens += len(o.outputs[0].token_ids)
            return time.perf_counter() - start, out_tokens

        cold = None
        if warm_reqs:
            el, toks = closed_loop(warm_reqs)
            cold = round((sum(len(r.prompt) for r in warm_reqs) + toks) / el, 1)
        elapsed, out_tokens = closed_loop(reqs)
    finally:
        engine.core.shutdown()
        engine = None  # the closure holds the name; this frees the engine before empty_cache
        gc.collect()
        torch.cuda.empty_cache()
    in_tokens = sum(len(r.prompt) for r in reqs)
    return {
        "elapsed_s": round(elapsed, 2),
        "out_tok_s": round(out_tokens / elapsed, 1),
        "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1),
        "requests": len(reqs),
        "concurrency": concurrency,
        "warm_pass_total_tok_s": cold,
    }


def warmup_requests(input_len: int, vocab: int) -> list[Req]:
    """Prompts of several lengths, then decodes at a few batch sizes: Triton compiles its kernels'
    specialisations here, not inside a measured level."""
    lengths = [input_len, input_len // 2 + 3, 17, 100, input_len - 1, 64, 256, 33] * 4
    return [
        Req(r.prompt[:n], 16)
        for r, n in zip(random_workload(len(lengths), input_len, 16, vocab, seed=777), lengths)
    ]


def server_log_tail(srv: LocalServer, lines: int = 60) -> str:
    try:
        return "".join(
            Path(srv.log.name).read_text(errors="replace").splitlines(keepends=True)[-lines:]
        )
    except OSError:
        return "(no server log)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--model", required=True, help="a Hugging Face directory (or a built-in name)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--requests", default="8,64,128,512", help="requests per concurrency level")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-requests", type=int, default=128)
    ap.add_argument("--prefix-concurrency", type=int, default=64)
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument(
        "--warm-pass",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each level, the same level on other prompts, reported apart: Triton compiles a "
        "kernel variant the first time a step's shape needs one (split-KV counts, tile "
        "sizes), and a measured level should not pay for that",
    )
    ap.add_argument(
        "--offline-at",
        default="256",
        help="concurrencies at which the engine alone runs too (comma list; empty: none)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-memory", default="16GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--server-flags", default="", help="extra `kvmesh serve` flags, one string")
    ap.add_argument("--log-dir", default="/tmp/kvmesh-gpu-serve")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument(
        "--pid-file",
        default=None,
        help="write the server's process id (its own session: the caller can end it after a kill)",
    )
    args = ap.parse_args(argv)
    # On SIGTERM (a time limit) unwind normally, so the server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    levels = parse_levels(args.concurrency, args.requests)
    offline_at = [int(c) for c in args.offline_at.split(",") if c.strip()]

    from kvmesh.engine.builtin import resolve_model_dir
    from kvmesh.engine.config import ModelConfig

    vocab = ModelConfig.from_dir(str(resolve_model_dir(args.model))).vocab_size
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    name = "bench-model"
    flags = [
        "--served-model-name",
        name,
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        *args.server_flags.split(),
    ]
    out: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "server_flags": flags,
        "levels": {},
        "errors": [],
    }
    workloads = {
        c: random_workload(n, args.input_len, args.output_len, vocab, seed=100 + c)
        for c, n in levels
    }
    warm_workloads = {
        c: random_workload(n, args.input_len, args.output_len, vocab, seed=1000 + c)
        if args.warm_pass
        else None
        for c, n in levels
    }

    def warm_pass(url: str, reqs: list[Req] | None, conc: int, key: str) -> None:
        if not reqs:
            return
        res, el = asyncio.run(run_load(url, reqs, conc, None, model=name, label=f"warm pass {key}"))
        s = summarize(f"warm pass (not the measurement), {key}", res, el)
        s["tpot"] = _tpot(res)
        out.setdefault("warm_pass", {})[key] = figures(s)

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))

    print(
        f"gpu serve: model {args.model}, {args.dtype}; random {args.input_len} in / {args.output_len} out; "
        f"levels (concurrency, requests) {levels}; shared prefix {args.prefix_requests} requests at "
        f"concurrency {args.prefix_concurrency}{' (skipped)' if args.skip_prefix else ''}; engine alone at "
        f"{offline_at or 'none'}; serve flags {' '.join(flags)}",
        flush=True,
    )
    t0 = time.perf_counter()
    srv = LocalServer(args.model, flags, logs / "server.log")
    if args.pid_file:
        Path(args.pid_file).write_text(str(srv.proc.pid))
    try:
        try:
            srv.wait_ready(timeout=300)
        except Exception as exc:
            print(
                f"!! server not ready: {exc}\n--- server log tail ---\n{server_log_tail(srv)}",
                flush=True,
            )
            out["errors"].append(f"server not ready: {exc}")
            save()
            return 1
        out["server_start_s"] = round(time.perf_counter() - t0, 1)
        print(f"server ready in {out['server_start_s']} s at {srv.url}", flush=True)
        warm = warmup_requests(args.input_len, vocab)
        res, el = asyncio.run(run_load(srv.url, warm, 16, None, model=name, label="warm-up"))
        bad = [r for r in res if not r.ok]
        if bad:
            print(
                f"!! warm-up: {len(bad)}/{len(res)} requests failed; first: {bad[0].error}\n"
                f"--- server log tail ---\n{server_log_tail(srv)}",
                flush=True,
            )
            out["errors"].append(f"warm-up failed: {bad[0].error}")
            save()
            return 1
        print(f"warm-up: {len(res)} requests ok in {el:.1f} s", flush=True)
        for conc, n in levels:
            warm_pass(srv.url, warm_workloads[conc], conc, f"c={conc}")
            res, el = asyncio.run(
                run_load(srv.url, workloads[conc], conc, None, model=name, label=f"c={conc}")
            )
            s = summarize(
                f"random {args.input_len}/{args.output_len}, concurrency {conc}, {n} requests",
                res,
                el,
            )
            s["tpot"] = _tpot(res)
            out["levels"][str(conc)] = {"requests": n, **figures(s)}
            if s["failed"]:
                out["errors"].append(f"c={conc}: {s['failed']} requests failed")
            save()
            if srv.proc.poll() is not None:
                print(
                    f"!! the server exited ({srv.proc.returncode})\n--- server log tail ---\n{server_log_tail(srv)}",
                    flush=True,
                )
                out["errors"].append(f"server exited with {srv.proc.returncode}")
                return 1
        if not args.skip_prefix:
            if args.warm_pass:
                warm_pass(
                    srv.url,
                    shared_prefix_workload(
                        args.prefix_requests, args.input_len, 0.75, args.output_len, vocab, seed=6
                    ),
                    args.prefix_concurrency,
                    "prefix",
                )
            reqs = shared_prefix_workload(
                args.prefix_requests, args.input_len, 0.75, args.output_len, vocab, seed=5
            )
            res, el = asyncio.run(
                run_load(srv.url, reqs, args.prefix_concurrency, None, model=name, label="prefix")
            )
            s = summarize(
                f"shared prefix (75% of {args.input_len}), concurrency {args.prefix_concurrency}, "
                f"{len(reqs)} requests",
                res,
                el,
            )
            s["tpot"] = _tpot(res)
            out["shared_prefix"] = {
                "requests": len(reqs),
                "concurrency": args.prefix_concurrency,
                **figures(s),
            }
            save()
    finally:
        srv.stop()
        if args.pid_file:
            Path(args.pid_file).unlink(missing_ok=True)
    budget = args.max_num_batched_tokens
    for conc in offline_at:
        if str(conc) not in out["levels"]:
            continue
        print(f"\nengine alone (LLMEngine, same requests, closed loop at {conc})", flush=True)
        try:
            o = engine_alone(
                args.model,
                args.dtype,
                args.max_num_seqs,
                args.kv_cache_memory,
                budget,
                workloads[conc],
                conc,
                warm_workloads[conc],
            )
        except Exception as exc:  # noqa: BLE001 - reported; the server's figures stand
            print(f"!! engine alone failed: {type(exc).__name__}: {exc}", flush=True)
            out["errors"].append(f"engine alone at {conc}: {type(exc).__name__}: {exc}")
            continue
        served = out["levels"][str(conc)]
        o["server_share"] = round(served["total_tok_s"] / o["total_tok_s"], 3)
        out.setdefault("engine_alone", {})[str(conc)] = o
        print(
            f"engine alone at {conc}: {o['total_tok_s']:.1f} total tok/s ({o['elapsed_s']} s); server "
            f"{served['total_tok_s']:.1f} -> keeps {100 * o['server_share']:.1f}% (target >= 90%)",
            flush=True,
        )
        save()
    print(
        f"\n== gpu serve summary ({args.model}, {args.dtype}, random {args.input_len} in / {args.output_len} out)"
    )
    print(
        f"   {'load':<22} {'req':>5} {'req/s':>7} {'out tok/s':>10} {'total tok/s':>12} {'TTFT p50':>9} "
        f"{'p99':>8} {'TPOT p50':>9} {'p99':>7}  ms"
    )
    rows = [(f"c={c}", out["levels"][str(c)]) for c, _ in levels if str(c) in out["levels"]]
    if "shared_prefix" in out:
        rows.append((f"prefix c={args.prefix_concurrency}", out["shared_prefix"]))
    for label, f in rows:
        print(
            f"   {label:<22} {f['ok']:>5} {f['req_s']:7.2f} {f['out_tok_s']:10.1f} {f['total_tok_s']:12.1f} "
            f"{f['ttft_p50_ms']:9.1f} {f['ttft_p99_ms']:8.1f} {f['tpot_p50_ms']:9.2f} {f['tpot_p99_ms']:7.2f}"
        )
    for key, f in out.get("warm_pass", {}).items():
        print(
            f"   warm pass {key:<12} {f['ok']:>5} {f['req_s']:7.2f} {f['out_tok_s']:10.1f} {f['total_tok_s']:12.1f} "
            f"{f['ttft_p50_ms']:9.1f} {f['ttft_p99_ms']:8.1f} {f['tpot_p50_ms']:9.2f} {f['tpot_p99_ms']:7.2f}"
        )
    for conc, o in out.get("engine_alone", {}).items():
        print(
            f"   engine alone c={conc}: {o['total_tok_s']:.1f} total tok/s (its warm pass {o['warm_pass_total_tok_s']}); "
            f"server keeps {100 * o['server_share']:.1f}% (target >= 90%)"
        )
    save()
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
