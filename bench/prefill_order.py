#!/usr/bin/env python3
"""Scheduling policies under long prompts, simulated: TTFT, ITL and throughput per policy, in steps.

Replays the long-prompt workload (prompts of --input-len +- --input-range tokens, seeded; --output-len
tokens out; --concurrency clients, each sending its next request when the last one ends, as
`vllm bench serve --max-concurrency`; or open-loop Poisson arrivals at --request-rate) through the engine's Scheduler and KV cache manager with no
model: a step's time is the cost model a + b x (tokens in the step). Every policy sees the same
requests, so only the order differs. Prints, per policy, TTFT p50/p90, ITL p50 and output
throughput, and each ratio to fcfs. Nothing is timed on the machine, so it runs the same under load.

  python -P bench/prefill_order.py                            # fcfs, sjf, priority; 200 requests
  python -P bench/prefill_order.py --max-prefill-skips 0,4,8,16  # sjf's aging bound
  python -P bench/prefill_order.py --request-rate 0.6         # open loop, near saturation
  python -P bench/prefill_order.py --measure                  # a and b from the built-in model

The default a and b are the CPU engine's (fp32 smollm2-135m, 2 cores, docs/engine.md "The
budget"): ~30 ms per step plus ~1 ms per token. --measure times them again (a 512-token prefill,
decode steps at batch 1): on a loaded machine that measures the load, not the engine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def workload(args) -> list[int]:
    rng = random.Random(args.seed)
    lo, hi = args.input_len - args.input_range, args.input_len + args.input_range
    return [rng.randint(lo, hi) for _ in range(args.num_requests)]


def simulate(lengths: list[int], policy: str, max_skips: int, args) -> dict:
    from kvmesh.engine.kv_cache_manager import KVCacheManager
    from kvmesh.engine.request import Request
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.engine.scheduler import Scheduler

    bs, max_len = 16, args.input_len + args.input_range + args.output_len + 16
    kv = KVCacheManager(args.num_kv_blocks, bs)
    sched = Scheduler(kv, args.budget, args.max_num_seqs, max_len, policy=policy,
                      max_prefill_skips=max_skips)  # fmt: skip
    rng = random.Random(args.seed + 1)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    clock, sent, arrival, first, last, itl = 0.0, 0, {}, {}, {}, []

    def send(at: float | None = None) -> None:
        nonlocal sent
        n = lengths[sent]
        rid = f"r{sent}"
        prio = sent % 3 if policy == "priority" else 0  # three classes of client
        sched.add_request(Request(rid, [rng.randrange(1, 30000) for _ in range(n)], params,
                                  set(), "m", bs, max_len, priority=prio))  # fmt: skip
        arrival[rid] = clock if at is None else at
        sent += 1

    # Closed loop: --concurrency clients; open loop (--request-rate): Poisson arrivals.
    times = _arrivals(len(lengths), args)
    for _ in range(len(lengths) if times else min(args.concurrency, len(lengths))):
        if not times:
            send()
    tokens_out = 0
    while sent < len(lengths) or sched.has_unfinished():
        if times:
            if not sched.has_unfinished():
                clock = max(clock, times[sent])
            while sent < len(lengths) and times[sent] <= clock:
                send(times[sent])
        out = sched.schedule()
        clock += args.step_a + args.step_b * out.total_tokens
        sampled = {
            r.request_id: 1
            for r in out.requests
            if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens
        }
        for request, _ in sched.update_from_output(out, sampled):
            rid = request.request_id
            tokens_out += 1
            if rid in last:
                itl.append(clock - last[rid])
            else:
                first[rid] = clock - arrival[rid]
            last[rid] = clock
            if request.status.finished and sent < len(lengths) and not times:
                send()
    ttft = sorted(first.values())
    return {
        "ttft_p50": _pct(ttft, 50),
        "ttft_p90": _pct(ttft, 90),
        "ttft_max": ttft[-1],
        "itl_p50": statistics.median(itl),
        "throughput": tokens_out / clock,
    }


def _arrivals(n: int, args) -> list[float]:
    """Open-loop arrival times (seconds), seeded; empty for the closed loop."""
    if not args.request_rate:
        return []
    rng, t, out = random.Random(args.seed + 2), 0.0, []
    for _ in range(n):
        t += rng.expovariate(args.request_rate)
        out.append(t)
    return out


def _pct(values: list[float], p: int) -> float:
    return values[min(len(values) - 1, len(values) * p // 100)]


def measure(args) -> tuple[float, float]:
    """a and b of the built-in model on this machine (timed: noisy under load)."""
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling_params import SamplingParams

    llm = LLM(args.model, max_num_batched_tokens=args.budget)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    many = SamplingParams(max_tokens=33, ignore_eos=True)
    prefill, decode = [], []
    for i in range(3):
        ids = [(7 * i + j) % 1000 + 5 for j in range(args.budget)]
        t = time.perf_counter()
        llm.generate([ids], one)
        prefill.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate([[i + 5] * 8], many)
        decode.append((time.perf_counter() - t) / 33)
    step_1, step_n = min(decode), min(prefill)
    b = max((step_n - step_1) / (args.budget - 1), 0.0)
    return step_1 - b, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--input-range", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="open loop: Poisson arrivals at this many requests/s instead of --concurrency clients",
    )
    ap.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--policies", default="fcfs,sjf,priority")
    ap.add_argument(
        "--max-prefill-skips", default="8", help="sjf's aging bound(s), comma-separated"
    )
    ap.add_argument("--step-a", type=float, default=0.030, help="seconds per step")
    ap.add_argument("--step-b", type=float, default=0.001, help="seconds per token in a step")
    ap.add_argument("--measure", action="store_true", help="time a and b on --model first")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.measure:
        args.step_a, args.step_b = measure(args)
    print(f"step cost: {args.step_a * 1e3:.2f} ms + {args.step_b * 1e3:.4f} ms/token")
    lengths = workload(args)
    runs = []
    for policy in args.policies.split(","):
        skips = [int(s) for s in args.max_prefill_skips.split(",")] if policy == "sjf" else [0]
        for n in skips:
            name = f"sjf/{n}" if policy == "sjf" else policy
            runs.append((name, simulate(lengths, policy, n, args)))
    base = dict(runs).get("fcfs")
    print(f"{'policy':>10} {'ttft p50':>9} {'ttft p90':>9} {'ttft max':>9} {'itl p50':>8} "
          f"{'tok/s':>7}   ratios to fcfs (ttft p50, p90, itl p50, tok/s)")  # fmt: skip
    for name, r in runs:
        line = (f"{name:>10} {r['ttft_p50']:9.3f} {r['ttft_p90']:9.3f} {r['ttft_max']:9.3f} "
                f"{r['itl_p50'] * 1e3:8.1f} {r['throughput']:7.1f}")  # fmt: skip
        if base:
            keys = ("ttft_p50", "ttft_p90", "itl_p50", "throughput")
            line += "   " + " ".join(f"{r[k] / base[k]:.2f}" for k in keys)
        print(line)


if __name__ == "__main__":
    main()
