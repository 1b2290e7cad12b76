"""Chaos and overload report (a script, not a test): the scenarios of tests/router/test_chaos.py
and tests/router/test_overload.py (tests/support/chaos/), run with more clients, longer
streams and more requests, on loopback with stub engines (no model needed).

chaos     two engines (separate processes, each with its sidecar process) behind a router
          process and a real redis-server; streams in flight while one engine is SIGKILLed
          (then restarted: the requests on it go on with the other engine, router/resume.py), Redis is SIGKILLed and restarted empty (at once, then after an
          outage), and the router restarts (SIGTERM, new process on the same port).
overload  each admission limit driven at --factor x its capacity: the engines' queues
          (--max-num-seqs + --max-waiting), the router's per-key --rate-limit-rpm, and its
          hold queue (--max-pending-requests while no engine is routable).
restarts  `kvmesh up` (--up-engine: the built-in model by default, `stub`, or a checkpoint
          directory) under a client load while each part in turn is killed and its
          supervisor restarts it: an engine (SIGKILL, then SIGTERM), a sidecar, the router,
          Redis. One line each: seconds until routable again, requests sent / ok / failed,
          and failed beyond the killed process's own (must be 0).

    python bench/chaos.py                 # all three
    python bench/chaos.py chaos --workers 24
    python bench/chaos.py chaos --max-resumes 0   # the router without resuming, for comparison
    python bench/chaos.py overload --seconds 30
    python bench/chaos.py restarts --up-engine stub

Exit status 1 if an invariant was broken (listed under "problems").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvmesh_testing.chaos import (  # noqa: E402
    ChaosConfig,
    MeshConfig,
    OverloadConfig,
    UpConfig,
    UpRestartConfig,
    percentile,
    run_chaos,
    run_overload,
    run_up_restarts,
)


def chaos(args: argparse.Namespace) -> list[str]:
    cfg = ChaosConfig(
        workers=args.workers,
        families=args.families,
        requests_after_fault=args.requests_after_fault,
        deadline=args.deadline,
        mesh=MeshConfig(
            engines=args.engines,
            response_tokens=args.response_tokens,
            token_delay=args.token_delay,
            router_args=[]
            if args.max_resumes is None
            else ["--max-resumes", str(args.max_resumes)],
        ),
    )
    rep = asyncio.run(run_chaos(cfg))
    keys = ", ".join(f"{f.keys_restored}/{f.keys_expected} ({f.name})" for f in rep.redis)
    print(
        f"chaos: {args.engines} engines, {args.workers} clients, streams of up to {args.response_tokens} tokens "
        f"{args.token_delay * 1000:.0f} ms apart"
    )
    resumed = sum(r.ok for r in rep.in_flight_on_killed)
    print(
        f"  requests in flight on the killed engine {len(rep.in_flight_on_killed)}, completed by another "
        f"replica {resumed} (router/resume.py)"
    )
    print(
        f"  requests sent {rep.sent}, completed {rep.completed}, lost {len(rep.lost)} (on the killed engine "
        f"{len(rep.lost_on_killed)}), failed after the fault {len(rep.failed_after_fault)}, keys restored {keys}, "
        f"hung {len(rep.hangs)}, silently truncated {len(rep.truncated)}"
    )
    print("\n".join(rep.lines()))
    return rep.problems()


def overload(args: argparse.Namespace) -> list[str]:
    cfg = OverloadConfig(
        mesh=MeshConfig(
            engines=args.engines,
            max_num_seqs=args.max_num_seqs,
            max_waiting=args.max_waiting,
            token_delay=args.overload_token_delay,
            response_tokens=args.overload_tokens,
        ),
        factor=args.factor,
        duration_s=args.seconds,
        admitted_target=args.admitted_target,
        max_requests=args.max_requests,
        rate_limit_rpm=args.rate_limit_rpm,
        max_pending=args.max_pending,
        deadline=args.deadline,
    )
    rep = asyncio.run(run_overload(cfg))
    print(f"overload: {args.factor}x each admission limit")
    for p in rep.parts:
        lat = [r.latency for r in p.admitted if r.ok]
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        print(
            f"  {p.name.split(' (')[0]}: sent {len(p.results)}, admitted {len(p.admitted)}, "
            f"{p.refusal} {len(p.refused)}, 5xx/other {len(p.server_errors)}, admitted latency "
            f"p50 {p50 * 1000 if p50 is not None else float('nan'):.0f} ms "
            f"p99 {p99 * 1000 if p99 is not None else float('nan'):.0f} ms"
        )
    print("\n".join(rep.lines()))
    return rep.problems()


def restarts(args: argparse.Namespace) -> list[str]:
    engine_args = (
        None if args.up_engine == "stub" else ["--kv-cache-memory", args.up_kv_cache_memory]
    )
    cfg = UpRestartConfig(
        workers=args.up_workers,
        requests_after=args.requests_after_fault,
        deadline=args.deadline,
        back_timeout=args.up_back_timeout,
        mesh=UpConfig(
            replicas=args.engines,
            engine_model=args.up_engine,
            engine_args=engine_args,
            start_timeout=args.up_start_timeout,
        ),
    )
    rep = asyncio.run(run_up_restarts(cfg))
    print(
        f"restarts: kvmesh up, {args.engines} replicas of {args.up_engine}, {args.up_workers} clients"
    )
    print("\n".join(rep.lines()))
    return rep.problems()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "what", nargs="?", choices=["chaos", "overload", "restarts", "all"], default="all"
    )
    p.add_argument("--engines", type=int, default=2)
    p.add_argument(
        "--deadline", type=float, default=30.0, help="per request: longer counts as a hang"
    )
    c = p.add_argument_group("chaos")
    c.add_argument("--workers", type=int, default=16, help="concurrent clients")
    c.add_argument(
        "--families", type=int, default=12, help="prompts whose follow-ups must stay on their pod"
    )
    c.add_argument("--requests-after-fault", type=int, default=48)
    c.add_argument("--response-tokens", type=int, default=32)
    c.add_argument("--token-delay", type=float, default=0.03)
    c.add_argument(
        "--max-resumes",
        type=int,
        default=None,
        help="the router's --max-resumes (0: the requests on the killed engine are not resumed)",
    )
    o = p.add_argument_group("overload")
    o.add_argument("--factor", type=int, default=4)
    o.add_argument(
        "--seconds", type=float, default=15.0, help="longest time over the engines' capacity"
    )
    o.add_argument(
        "--admitted-target", type=int, default=300, help="or until this many were admitted"
    )
    o.add_argument("--max-requests", type=int, default=20000)
    o.add_argument("--max-num-seqs", type=int, default=4)
    o.add_argument("--max-waiting", type=int, default=4)
    o.add_argument("--overload-tokens", type=int, default=16)
    o.add_argument("--overload-token-delay", type=float, default=0.02)
    o.add_argument("--rate-limit-rpm", type=int, default=60)
    o.add_argument("--max-pending", type=int, default=16)
    u = p.add_argument_group("restarts")
    u.add_argument(
        "--up-engine",
        default="smollm2-135m-instruct",
        help="the engines of `kvmesh up`: a model (built-in name or checkpoint directory) or `stub`",
    )
    u.add_argument("--up-workers", type=int, default=8, help="concurrent clients during each fault")
    u.add_argument("--up-kv-cache-memory", default="256MiB", help="each engine's KV cache")
    u.add_argument(
        "--up-back-timeout",
        type=float,
        default=120.0,
        help="the most seconds until routable again before a scenario fails",
    )
    u.add_argument(
        "--up-start-timeout",
        type=float,
        default=900.0,
        help="the most seconds for the mesh to come up (a first start may build the CPU kernels)",
    )
    args = p.parse_args()
    problems = []
    if args.what in ("chaos", "all"):
        problems += chaos(args)
    if args.what in ("overload", "all"):
        problems += overload(args)
    if args.what in ("restarts", "all"):
        problems += restarts(args)
    print("problems: " + ("none" if not problems else "\n  " + "\n  ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
