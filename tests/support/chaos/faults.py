"""The chaos scenario: an engine SIGKILLed mid-stream, Redis SIGKILLed and restarted empty, the router restarted."""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx

from kvmesh.common import redis_layout as rl
from kvmesh_testing.chaos.load import Load, send_one, words
from kvmesh_testing.chaos.mesh import Mesh, MeshConfig
from kvmesh_testing.chaos.processes import ChaosError, wait_for
from kvmesh_testing.chaos.report import ChaosReport, RedisFault, RoutingCheck


@dataclass
class ChaosConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    workers: int = 6  # concurrent clients during each fault
    families: int = 6  # prompts whose follow-ups must keep going to the pod that holds them
    family_words: int = 120
    requests_after_fault: int = (
        12  # requests that must complete after each fault (and while Redis is down)
    )
    deadline: float = 20.0  # per request: longer is a hang


async def _families(
    mesh: Mesh, cfg: ChaosConfig, client: httpx.AsyncClient
) -> list[tuple[str, str]]:
    """Send each family's first prompt; returns (prompt, the pod that now caches it)."""
    rng = random.Random(1234)
    out = []
    for i in range(cfg.families):
        prompt = f"family {i} {uuid.uuid4().hex[:8]}: " + words(rng, cfg.family_words)
        r = await send_one(
            client, mesh.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4}, cfg.deadline
        )
        if not r.ok:
            raise ChaosError(f"family {i}'s first request failed: {r.short()}")
        out.append((prompt, r.pod))
    return out


async def _quiet(mesh: Mesh) -> None:
    """Wait until no engine runs anything, the router has read heartbeats that say so (a
    heartbeat's load is up to one interval old; the router's view up to one refresh), and it
    uses the block sets (a Redis call that failed pauses them for a second)."""
    await wait_for(lambda: _idle(mesh), 20, "the engines idle")

    async def zero_load_in_redis():
        for e in mesh.engines:
            hb = await mesh._redis().hgetall(rl.heartbeat_key(mesh.cfg.model, e.name))
            if not hb or int(hb.get(rl.F_RUNNING.encode(), 1)) + int(
                hb.get(rl.F_WAITING.encode(), 1)
            ):
                return False
        return True

    await wait_for(zero_load_in_redis, 20, "heartbeats with no load")
    t = time.monotonic()

    async def router_read_since():
        r = await mesh.ready()
        age = (r or {}).get("discovery", {}).get("redis_view_age_s")
        return age is not None and time.monotonic() - age > t

    await wait_for(router_read_since, 20, "the router reading those heartbeats")

    async def block_sets_usable():  # not paused by a failed Redis call the load made (router: redis_retry_after)
        return ((await mesh.ready()) or {}).get("block_sets") == "usable"

    await wait_for(block_sets_usable, 20, "the router using the block sets in Redis")


async def _idle(mesh: Mesh) -> bool:
    for e in mesh.engines:
        if (await mesh.stats(e))["running"]:
            return False
    return True


async def _decisions(mesh: Mesh) -> Counter:
    from kvmesh.common.engine_load import parse_prometheus

    text = (await mesh.http.get(mesh.url + "/metrics")).text
    out: Counter = Counter()
    for name, labels, v in parse_prometheus(text):
        if name == "kvmesh_router_decisions_total":
            out[labels.get("reason", "")] += int(v)
        elif name == "kvmesh_router_redis_errors_total":
            out["redis_error:" + labels.get("op", "")] += int(v)
    return out


async def _check_routing(
    mesh: Mesh,
    cfg: ChaosConfig,
    client: httpx.AsyncClient,
    families,
    when: str,
) -> RoutingCheck:
    await _quiet(mesh)
    check = RoutingCheck(when)
    before = await _decisions(mesh)
    rng = random.Random(when)
    for prompt, pod in families:
        r = await send_one(
            client,
            mesh.url + "/v1/completions",
            {"prompt": f"{prompt} {when}: {words(rng, 24)}", "max_tokens": 4},
            cfg.deadline,
        )
        check.probes += 1
        check.ok += r.ok
        check.same_pod += r.ok and r.pod == pod
    after = await _decisions(mesh)
    delta = {k: after[k] - before[k] for k in after if after[k] - before[k]}
    check.reasons = {k: n for k, n in delta.items() if not k.startswith("redis_error:")}
    check.redis_errors = {
        k.split(":", 1)[1]: n for k, n in delta.items() if k.startswith("redis_error:")
    }
    return check


async def run_chaos(cfg: ChaosConfig) -> ChaosReport:
    rep = ChaosReport()
    t0 = time.monotonic()
    rep.timeline.append(("start", 0.0))
    async with Mesh(cfg.mesh) as mesh:
        rep.timeline.append(("mesh up", time.monotonic() - t0))
        rep.asgi_tracebacks = await mesh.run_scenario(_chaos(mesh, cfg, rep))
    rep.duration_s = time.monotonic() - t0
    return rep


async def _chaos(mesh: Mesh, cfg: ChaosConfig, rep: ChaosReport) -> None:
    t0 = time.monotonic() - rep.timeline[-1][1]

    def mark(what: str) -> None:
        rep.timeline.append((what, time.monotonic() - t0))

    probe = httpx.AsyncClient(
        timeout=cfg.deadline, limits=httpx.Limits(max_keepalive_connections=0)
    )
    try:
        await _engine_killed(mesh, cfg, rep, mark)
        # prefix routing before the next faults: families spread over the pods
        families = await _families(mesh, cfg, probe)
        await wait_for(mesh.keys_synced, 20, "the families' blocks in Redis")
        rep.routing.append(
            await _check_routing(mesh, cfg, probe, families, "before the Redis restarts")
        )
        mark("routing checked")
        for name in ("restarted at once", "down, then restarted"):
            rep.redis.append(await _redis_restarted(mesh, cfg, rep, mark, name))
        rep.routing.append(
            await _check_routing(mesh, cfg, probe, families, "after the Redis restarts")
        )
        mark("routing checked")
        await _router_restarted(mesh, cfg, rep, mark)
        rep.routing.append(
            await _check_routing(mesh, cfg, probe, families, "after the router restart")
        )
        rep.internal_errors += await mesh.metric("kvmesh_router_internal_errors_total")
        mark("routing checked")
    finally:
        await probe.aclose()


async def _engine_killed(mesh: Mesh, cfg: ChaosConfig, rep: ChaosReport, mark) -> None:
    n, after = len(mesh.engines), cfg.requests_after_fault
    # (a) SIGKILL one engine while streams are mid-way on every engine; its container then
    # restarts (same ports, empty cache), as a pod's would
    victim = mesh.engines[0]
    rep.killed = victim.name
    load = Load(mesh, cfg.workers, deadline=cfg.deadline, seed=1).start()
    await wait_for(lambda: load.mid_stream_on([victim]), 30, f"a stream mid-way on {victim.name}")
    victim.stub.kill()
    t_kill = rep.t_kill = time.monotonic()
    mark("(a) engine killed")
    await wait_for(lambda: mesh.routable(n - 1), 20, "the router dropping the killed engine")
    t_seen = time.monotonic()
    rep.seen_after_s = t_seen - t_kill
    victim.stub.start()
    await wait_for(
        lambda: load.completed_since(t_seen, after), 60, f"{after} requests after the fault"
    )
    await wait_for(lambda: mesh.routable(n), 60, "the restarted engine routable again")
    rep.engine_back_s = time.monotonic() - t_kill
    mark("(a) engine restarted and routable")
    res = await load.stop()
    rep.results += res
    rep.lost = [r for r in res if not r.ok]
    # on the killed engine when it died (its answer, a 200 stream or a 502, names the pod)
    rep.in_flight_on_killed = [r for r in res if r.pod == victim.name and r.in_flight_at(t_kill)]
    rep.failed_after_fault = [r for r in res if not r.ok and r.t_start >= t_kill]
    rep.failed_after_seen = [r for r in res if not r.ok and r.t_start >= t_seen]
    await wait_for(mesh.keys_synced, 20, "block sets in Redis equal to the engines' caches")


async def _redis_restarted(
    mesh: Mesh, cfg: ChaosConfig, rep: ChaosReport, mark, name: str
) -> RedisFault:
    n, after = len(mesh.engines), cfg.requests_after_fault
    # (b) Redis SIGKILLed under load and restarted empty, twice: at once (no client sees an
    # error: only a sidecar that checks its set can tell), then after an outage the router
    # notices (it routes on its last view, then by load). The sidecars must write their sets again.
    fault = RedisFault(name)
    load = Load(mesh, cfg.workers, deadline=cfg.deadline, seed=len(rep.redis) + 2).start()
    await wait_for(load.mid_stream, 30, "streams mid-way")
    fault.keys_before = sum([await mesh.block_keys(e.name) for e in mesh.engines])
    mesh.redis.kill()
    t_rkill = time.monotonic()
    mark(f"(b) Redis killed ({name})")
    if name != "restarted at once":
        await wait_for(lambda: _redis_unreachable(mesh), 20, "the router noticing Redis is down")
        await wait_for(
            lambda: load.completed_since(t_rkill, after),
            60,
            f"{after} requests while Redis is down",
        )
        fault.served_while_down = sum(1 for r in load.results if r.ok and r.t_start >= t_rkill)
    t_rstart = time.monotonic()
    mesh.redis.start()
    await wait_for(mesh.redis_ping, 20, "redis-server up again")
    await wait_for(
        lambda: _keys_at_least(mesh, fault.keys_before),
        30,
        f"the {fault.keys_before} block keys of before the kill back in Redis",
    )
    fault.restored_after_s = time.monotonic() - t_rstart
    mark("(b) block keys back")
    await wait_for(lambda: mesh.routable(n), 30, "heartbeats back in Redis")
    t_up = time.monotonic()
    await wait_for(
        lambda: load.completed_since(t_up, after), 60, f"{after} requests after Redis came back"
    )
    fault.results = await load.stop()
    rep.results += fault.results
    fault.keys_restored, fault.keys_expected = await wait_for(
        mesh.keys_synced, 30, "the sidecars restoring every block key"
    )
    return fault


async def _router_restarted(mesh: Mesh, cfg: ChaosConfig, rep: ChaosReport, mark) -> None:
    n, after = len(mesh.engines), cfg.requests_after_fault
    # (c) restart the router (SIGTERM: it drains, then a new process on the same port)
    load = Load(mesh, cfg.workers, deadline=cfg.deadline, seed=9).start()
    await wait_for(load.mid_stream, 30, "streams mid-way")
    rep.internal_errors += await mesh.metric("kvmesh_router_internal_errors_total")
    t_term = time.monotonic()
    rep.router_exit_code = await mesh.router.terminate(timeout=cfg.deadline + 10)
    rep.router_drain_s = time.monotonic() - t_term
    if rep.router_exit_code is None:  # what held the drain: the requests it logged last
        rep.router_log_tail = mesh.router.tail(60)
    mark("(c) router drained and exited")
    mesh.router.start()
    await wait_for(lambda: mesh.routable(n), 60, "the new router routing to every engine")
    t_back = time.monotonic()
    rep.router_back_s = t_back - t_term
    mark("(c) new router routing")
    await wait_for(
        lambda: load.completed_since(t_back, after),
        60,
        f"{after} requests after the router came back",
    )
    res = await load.stop()
    rep.results += res
    in_flight = [r for r in res if r.in_flight_at(t_term)]
    rep.router_in_flight = len(in_flight)
    rep.router_in_flight_ok = sum(r.ok for r in in_flight)
    rep.router_refused = sum(r.kind in ("refused", "reset") for r in res)
    rep.router_failed = [r for r in res if not r.ok and r.kind not in ("refused", "reset")]


async def _keys_at_least(mesh: Mesh, n: int) -> bool:
    return sum([await mesh.block_keys(e.name) for e in mesh.engines]) >= n


async def _redis_unreachable(mesh: Mesh) -> bool:
    r = await mesh.ready()
    return r is not None and (r.get("discovery") or {}).get("redis") == "unreachable"
