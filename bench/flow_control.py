"""Flow control under overload (a script, not a test): a `kvmesh up` mesh driven at --overload x its
capacity by one heavy tenant sending --heavy-factor x each light tenant's traffic, with the
router's flow control on, and the same run without it as the baseline, measured in one run.

Tenants (x-gateway-inference-fairness-id): `heavy` (band standard, --heavy-factor x r req/s) and
`light-1`..`light-N` (r each, --critical-share of their requests in the critical band, the rest
standard), where r makes the total offered rate --overload x the mesh's capacity (replicas x
--max-num-seqs streams of --response-tokens tokens, --token-delay s apart). Each mode first
measures the light tenants alone on the idle mesh (their TTFT p99 there is the reference), then
the overload for --seconds. Printed per mode and tenant: TTFT p99 and its ratio to idle, req/s
completed within the window against its max-min fair share of the capacity, refusals by band and
status, 5xx, and requests accepted but lost (a 200 stream without its [DONE]). With N light
tenants at 4x and 10x, each light tenant offers 4C/(10+N) against a fair share of C/(N+1): one
light tenant (the default) asks for 0.73x of its share; two ask for exactly theirs, so any
capacity lost to overheads leaves them a backlog that grows for the whole run (their TTFT cannot
stay near idle whatever the policy); three or more ask for more than theirs and are themselves
throttled to it. The router's own waits (mean seconds queued per band) close each mode's
lines. The verdict line checks the targets: each
light tenant's TTFT p99 <= 1.5x idle and throughput within 10% of fair, 0 refusals in the
critical band, 0 x 5xx, nothing accepted lost.

Stub engines by default (kvmesh.mesh.stub_engine: a fixed capacity, no model, so the overload is
exact on any machine); `--model NAME` runs the real engine (`kvmesh up --model`) instead, and then
--capacity-rps must say what the mesh sustains.

    python bench/flow_control.py                      # full size: 2 replicas, 4x overload, 60 s
    python bench/flow_control.py --seconds 120 --max-num-seqs 64
    python bench/flow_control.py --modes flow         # without the baseline
    python bench/flow_control.py --tiny               # seconds: a check that it runs

Exit status 1 when a target is missed with flow control on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # local_mesh.py

from local_mesh import local_mesh  # noqa: E402

from kvmesh.router.flow.identity import FAIRNESS_HEADER, OBJECTIVE_HEADER  # noqa: E402


@dataclass
class Result:
    tenant: str
    band: str
    phase: str
    status: int = 0
    ttft: float | None = None
    done: bool = False  # a 200 stream that ended with [DONE]
    error: str | None = None
    finished: float = 0.0  # perf_counter at its end
    first_token_at: float = 0.0  # perf_counter at its first token
    sent: float = 0.0  # perf_counter when it was sent


@dataclass
class Plan:
    capacity_rps: float
    rate: float  # r: one light tenant's req/s
    tenants: dict[str, float] = field(default_factory=dict)  # tenant -> req/s
    fair: dict[str, float] = field(default_factory=dict)  # tenant -> its max-min fair req/s


def plan(args) -> Plan:
    capacity = args.capacity_rps or (
        args.replicas * args.max_num_seqs / (args.response_tokens * args.token_delay)
    )
    r = args.overload * capacity / (args.heavy_factor + args.light_tenants)
    tenants = {"heavy": args.heavy_factor * r}
    tenants.update({f"light-{i + 1}": r for i in range(args.light_tenants)})
    return Plan(capacity, r, tenants, max_min_fair(capacity, tenants))


def max_min_fair(capacity: float, demand: dict[str, float]) -> dict[str, float]:
    """Water-filling: each tenant gets min(its demand, an equal split of what is left)."""
    fair, left, todo = {}, capacity, sorted(demand, key=demand.get)
    while todo:
        share = left / len(todo)
        tenant = todo.pop(0)
        fair[tenant] = min(demand[tenant], share)
        left -= fair[tenant]
    return fair


def up_flags(args, flow: bool) -> list[str]:
    """`kvmesh up`'s flags for one mode (besides replicas, port and state file)."""
    cmd: list[str] = []
    engine = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-waiting",
        str(args.max_waiting),
    ]
    if args.model:
        cmd += ["--model", args.model]
    else:
        cmd += ["--engine-command", "stub"]
        engine += [
            "--response-tokens",
            str(args.response_tokens),
            "--token-delay",
            str(args.token_delay),
            "--token-jitter",
            str(args.token_jitter),
            "--num-blocks",
            "65536",
        ]
    cmd += ["--engine-args", " ".join(engine)]
    router = ["--read-timeout", "600"]
    if flow:
        # The router's own cap per replica (its engines' slots): no request waits in an engine.
        router += [
            "--flow-control",
            "--flow-pod-max-inflight",
            str(args.max_num_seqs),
            "--flow-deadline",
            str(args.deadline),
        ]
    return cmd + ["--router-args", shlex.join(router)]


async def one(client, url: str, tenant: str, band: str, phase: str, max_tokens: int) -> Result:
    res = Result(tenant, band, phase)
    headers = {FAIRNESS_HEADER: tenant, OBJECTIVE_HEADER: band}
    body = {
        "model": "flow-bench",
        "prompt": f"{tenant}: tell me about request {random.random()}",
        "max_tokens": max_tokens,
        "stream": True,
    }
    t0 = res.sent = time.perf_counter()
    try:
        async with client.stream(
            "POST", url + "/v1/completions", json=body, headers=headers
        ) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                try:
                    res.error = resp.json()["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    res.error = resp.text[:80]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res.done = True
                    break
                if res.ttft is None and '"text"' in line:
                    res.first_token_at = time.perf_counter()
                    res.ttft = res.first_token_at - t0
    except Exception as exc:  # noqa: BLE001 - a broken connection is a result, not a crash
        res.error = type(exc).__name__
    res.finished = time.perf_counter()
    return res


async def drive(url: str, rates: dict[str, float], seconds: float, phase: str, args):
    """Open-loop Poisson arrivals per tenant for `seconds`; every request awaited to its end."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    timeout = httpx.Timeout(args.deadline + 120)
    rng = random.Random(args.seed)
    tasks = []
    start = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def tenant_loop(tenant: str, rate: float) -> None:
            end = start + seconds
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() >= end:
                    return
                critical = tenant != "heavy" and rng.random() < args.critical_share
                band = "critical" if critical else "standard"
                tasks.append(
                    asyncio.ensure_future(
                        one(client, url, tenant, band, phase, args.response_tokens)
                    )
                )

        await asyncio.gather(*(tenant_loop(t, r) for t, r in rates.items() if r > 0))
        return await asyncio.gather(*tasks), start


def p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def report(
    mode: str,
    p: Plan,
    idle: list[Result],
    everything: list[Result],
    start: float,
    seconds: float,
    warmup: float = 0.0,
):
    """Lines for one mode, and the targets it missed. The measured window is the `seconds` after
    the first `warmup` seconds of the overload (while the mesh first fills, every newcomer waits
    for the first streams to end: reported on its own line)."""
    lines, missed = [f"== {mode}"], []
    onset = [r for r in everything if r.sent < start + warmup]
    load = [r for r in everything if r.sent >= start + warmup]
    start += warmup
    for tenant, offered in p.tenants.items():
        fair = p.fair[tenant]
        mine = [r for r in load if r.tenant == tenant]
        ok = [r for r in mine if r.status == 200 and r.done]
        # served: started (first token) inside the window, so streams still running at its end
        # count and the queue drained after it does not
        in_window = [
            r
            for r in everything
            if r.tenant == tenant
            and r.status == 200
            and r.done
            and start <= r.first_token_at <= start + seconds
        ]
        ttft = p99([r.ttft for r in ok if r.ttft is not None])
        idle_ttft = p99([r.ttft for r in idle if r.tenant == tenant and r.ttft is not None])
        ratio = ttft / idle_ttft if idle_ttft == idle_ttft and idle_ttft > 0 else float("nan")
        served = len(in_window) / seconds
        share = served / fair
        refused = {}
        for r in mine:
            if r.status != 200:
                refused[f"{r.status}:{r.error}"] = refused.get(f"{r.status}:{r.error}", 0) + 1
        lines.append(
            f"  {tenant:<9} offered {offered:6.2f}/s served {served:6.2f}/s = {share:5.2f} x its "
            f"fair share {fair:.2f}/s  TTFT p99 "
            f"{ttft * 1000:7.1f} ms (idle {idle_ttft * 1000:7.1f} ms, x{ratio:.2f})  refused {refused}"
        )
        if tenant.startswith("light-"):
            if not ratio <= 1.5:
                missed.append(f"{tenant} TTFT p99 x{ratio:.2f} > 1.5")
            if not share >= 0.9:
                missed.append(f"{tenant} throughput {share:.2f} of fair < 0.9")
    if warmup:
        lights = [r for r in onset if r.tenant != "heavy" and r.ttft is not None]
        lines.append(
            f"  the first {warmup:g} s of the overload (not in the figures above): light TTFT p99 "
            f"{p99([r.ttft for r in lights]) * 1000:.1f} ms over {len(lights)} requests"
        )
    by_band: dict[str, int] = {}  # over the whole overload, its first seconds included
    for r in everything:
        if r.status != 200:
            by_band[r.band] = by_band.get(r.band, 0) + 1
    server_errors = sum(1 for r in idle + everything if r.status >= 500 or r.error and not r.status)
    lost = sum(1 for r in idle + everything if r.status == 200 and not r.done)
    lines.append(
        f"  refusals by band {by_band}; 5xx or broken {server_errors}; accepted but lost {lost}; "
        f"requests {len(everything)} in {warmup + seconds:g} s"
    )
    if by_band.get("critical"):
        missed.append(f"{by_band['critical']} refusals in the critical band")
    if server_errors:
        missed.append(f"{server_errors} x 5xx or broken")
    if lost:
        missed.append(f"{lost} accepted requests lost")
    return lines, missed


def run_mode(mode: str, args, p: Plan) -> tuple[list[str], list[str]]:
    with local_mesh(args.replicas, up_flags(args, flow=mode == "flow"), args.verbose, mode) as mesh:
        url = mesh.url
        lights = {t: r for t, r in p.tenants.items() if t != "heavy"}  # alone: the idle mesh
        idle, _ = asyncio.run(drive(url, lights, args.idle_seconds, "idle", args))
        time.sleep(1.0)
        load, start = asyncio.run(
            drive(url, p.tenants, args.warmup + args.seconds, "overload", args)
        )
        lines, missed = report(mode, p, idle, load, start, args.seconds, args.warmup)
        return lines + router_waits(url), missed


def router_waits(url: str) -> list[str]:
    """The router's own account of the waiting: mean seconds queued per band and outcome."""
    import httpx

    from kvmesh.common.engine_load import parse_prometheus

    sums: dict[tuple[str, str], list[float]] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for name, lab, v in parse_prometheus(text):
        if name.startswith("kvmesh_router_flow_queued_seconds_") and name[-4:] in ("_sum", "ount"):
            key = (lab.get("band", "?"), lab.get("outcome", "?"))
            sums.setdefault(key, [0.0, 0.0])[0 if name.endswith("_sum") else 1] += v
    waits = [
        f"{band}/{outcome} {n:.0f} x {total / n * 1000:.0f} ms"
        for (band, outcome), (total, n) in sorted(sums.items())
        if n
    ]
    return [f"  queued at the router (band/outcome, count x mean wait): {', '.join(waits) or '-'}"]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="flow,baseline", help="flow, baseline or both")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--overload", type=float, default=4.0, help="offered load / capacity")
    ap.add_argument("--heavy-factor", type=float, default=10.0, help="heavy / light traffic")
    ap.add_argument("--light-tenants", type=int, default=1)
    ap.add_argument(
        "--critical-share", type=float, default=0.25, help="light requests in the critical band"
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="the overload's length")
    ap.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        help="seconds of overload before the measured window (reported on a line of their own)",
    )
    ap.add_argument("--idle-seconds", type=float, default=20.0, help="the idle reference's length")
    ap.add_argument("--max-num-seqs", type=int, default=48, help="each engine's slots")
    ap.add_argument("--max-waiting", type=int, default=48, help="each engine's queue")
    ap.add_argument("--response-tokens", type=int, default=8)
    ap.add_argument("--token-delay", type=float, default=0.4, help="stub seconds per token")
    ap.add_argument(
        "--token-jitter",
        type=float,
        default=0.5,
        help="stub token delays drawn from delay x [1-J, 1+J]: streams end at scattered times, as a "
        "real engine's (with exact delays they end, and free their slots, in lockstep waves)",
    )
    ap.add_argument("--deadline", type=float, default=30.0, help="--flow-deadline")
    ap.add_argument("--model", default=None, help="run the real engine with this model")
    ap.add_argument("--capacity-rps", type=float, default=None, help="with --model: its req/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="kvmesh up's output too")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: a check that it runs")
    args = ap.parse_args(argv)
    if args.model and not args.capacity_rps:
        ap.error("--model needs --capacity-rps (what the mesh sustains)")
    if args.tiny:
        args.replicas, args.seconds, args.idle_seconds, args.warmup = 1, 3.0, 2.0, 1.0
        args.max_num_seqs, args.max_waiting, args.token_delay = 2, 2, 0.05
        args.response_tokens, args.heavy_factor, args.light_tenants = 4, 4.0, 1
    return args


def main(argv=None) -> int:
    args = parse(argv)
    p = plan(args)
    print(
        f"flow control bench: {args.replicas} replicas, capacity {p.capacity_rps:.1f} req/s, "
        f"offered {sum(p.tenants.values()):.1f} req/s ({args.overload:g}x) for {args.seconds:g} s; "
        f"tenants {json.dumps({t: round(r, 2) for t, r in p.tenants.items()})}",
        flush=True,
    )
    missed_with_flow: list[str] = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        lines, missed = run_mode(mode, args, p)
        print("\n".join(lines), flush=True)
        print(f"  targets: {'all met' if not missed else '; '.join(missed)}", flush=True)
        if mode == "flow":
            missed_with_flow = missed
    return 1 if missed_with_flow and not args.tiny else 0


if __name__ == "__main__":
    sys.exit(main())
