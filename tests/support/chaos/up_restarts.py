"""The restarts scenario: each part of a `kvmesh up` mesh killed under load until its supervisor restarts it."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

from kvmesh_testing.chaos.load import Load
from kvmesh_testing.chaos.processes import ChaosError, wait_for
from kvmesh_testing.chaos.report import UpRestart, UpRestartReport
from kvmesh_testing.chaos.up_mesh import UpConfig, UpMesh

# A request the router sends to an engine as it dies can go out on a pooled connection whose
# close the router has not yet seen: sent, then disconnected, a 502 the router may not retry (the
# engine could have been running it). Such a request, routed to the killed engine within this
# many seconds of the kill, is the killed engine's own; later ones must find it closed and be
# retried elsewhere.
KILL_RACE_S = 1.0


@dataclass
class UpRestartConfig:
    mesh: UpConfig = field(default_factory=UpConfig)
    workers: int = 4  # concurrent clients during each fault
    requests_after: int = 8  # requests that must complete once the killed part is routable again
    back_timeout: float = 60.0  # the most seconds until routable again before the scenario fails
    deadline: float = 20.0  # per request: longer is a hang


# (scenario name, the child `kvmesh up` calls it, the signal)
UP_SCENARIOS = (
    ("engine SIGKILL", "engine-0", signal.SIGKILL),
    ("engine SIGTERM", "engine-0", signal.SIGTERM),
    ("sidecar SIGKILL", "sidecar-0", signal.SIGKILL),
    ("router SIGKILL", "router", signal.SIGKILL),
    ("Redis SIGKILL", "redis", signal.SIGKILL),
)


async def up_restart(
    mesh: UpMesh, cfg: UpRestartConfig, name: str, child: str, sig: int, seed: int = 0
) -> UpRestart:
    """Kill `child` with `sig` under a client load through the router; wait until `kvmesh up`
    has replaced it and every replica is routable again, then for `cfg.requests_after` more
    requests. A failed request is the killed process's own when it was in flight on it: on the
    killed engine (its answer names the pod), on the killed router (in flight at the kill, or
    refused while no router listened). Killing a sidecar or Redis may fail no request."""
    pod = f"replica-{child.split('-')[1]}" if child.startswith("engine-") else None
    rep = UpRestart(name, child, pod, signal.Signals(sig).name)
    await wait_for(
        lambda: mesh.all_routable_since(0), 60, "every replica routable before the fault"
    )
    old_pid = rep.old_pid = mesh.processes().get(child)
    if old_pid is None:
        raise ChaosError(f"no {child} in kvmesh up's state file: {mesh.state()}")
    log_at = len(mesh.log_text())
    t_kill = t_back = None
    load = Load(mesh, cfg.workers, deadline=cfg.deadline, seed=seed).start()  # type: ignore[arg-type]
    try:
        if pod:
            await wait_for(lambda: _streaming_on(load, pod), 30, f"a stream mid-way on {pod}")
        else:
            await wait_for(load.mid_stream, 30, "streams mid-way")
        before = await mesh.key_sets() if child == "redis" else {}
        rep.keys_before = sum(map(len, before.values()))
        log_kill = len(mesh.log_text())
        os.kill(old_pid, sig)
        t_kill = time.monotonic()

        async def replaced():
            pid = mesh.processes().get(child)
            return pid is not None and pid != old_pid

        await wait_for(replaced, cfg.back_timeout, f"kvmesh up restarting {child}")
        wall_replaced = time.time()
        await wait_for(
            lambda: mesh.all_routable_since(wall_replaced),
            cfg.back_timeout,
            f"every replica routable again after {child} was restarted",
            interval=0.1,
        )
        t_back = time.monotonic()
        rep.back_after_s = t_back - t_kill
        if child == "redis":
            await wait_for(
                lambda: _rewritten(mesh, log_kill), 30, "every sidecar rewriting its block set"
            )
            rep.restored_after_s = time.monotonic() - t_kill
            await wait_for(mesh.block_sets_usable, 30, "the router routing on the block sets again")
        await wait_for(
            lambda: _done_since(load, t_back, cfg.requests_after),
            60,
            f"{cfg.requests_after} requests after {child} came back",
        )
    except ChaosError as exc:
        # what the supervisor and the killed replica's (or part's) processes said since the fault
        who = (
            ("[up]", f"[{child}]")
            if "-" not in child
            else ("[up]", f"[engine-{child.split('-')[1]}]", f"[sidecar-{child.split('-')[1]}]")
        )
        said = [
            line
            for line in mesh.log_text()[log_at:].splitlines()
            if line.startswith(who) and " admitted: " not in line and " finished: " not in line
        ]
        rep.error = f"{exc}\n--- kvmesh up's log since the fault ({', '.join(who)}):\n" + "\n".join(
            said[-80:]
        )
    rep.results = await load.stop()
    if child == "redis" and not rep.error:
        try:  # without load: every set exactly its sidecar's index
            rep.keys_restored = await wait_for(
                mesh.index_synced, 20, "block sets equal to the sidecars' indexes"
            )
            rep.keys_back = await mesh.keys_back(before)
        except ChaosError as exc:
            rep.error = str(exc)
    rep.exit_logged = next(
        (
            line
            for line in mesh.log_text()[log_at:].splitlines()
            if line.startswith(f"[up] {child} exited")
        ),
        "",
    )
    if t_kill is not None:
        end = t_back if t_back is not None else time.monotonic()
        if pod:
            rep.in_flight_at_kill = [
                r for r in rep.results if r.pod == pod and r.in_flight_at(t_kill)
            ]
            rep.sent_as_it_died = [
                r
                for r in rep.results
                if r.pod == pod
                and t_kill <= r.t_start < t_kill + KILL_RACE_S
                and r.kind == "http"
                and r.status == 502
            ]
        elif child == "router":
            rep.in_flight_at_kill = [r for r in rep.results if r.in_flight_at(t_kill)]
        own = set(map(id, rep.in_flight_at_kill + rep.sent_as_it_died))
        if child == "router":
            down = [
                r
                for r in rep.results
                if r.kind in ("refused", "reset") and t_kill <= r.t_start < end
            ]
            rep.refused_while_down = len(down)
            own |= set(map(id, down))
        rep.own = [r for r in rep.failed if id(r) in own]
    return rep


async def _rewritten(mesh: UpMesh, since: int) -> bool:
    """Every sidecar has logged a full rewrite of its block set since offset `since` of the log
    (a Redis restarted empty gets its sets back only that way: the rest are increments)."""
    said = mesh.log_text()[since:].splitlines()
    return all(
        any(
            line.startswith(f"[sidecar-{i}]")
            and "block keys to Redis" in line
            and " rewrote " in line
            for line in said
        )
        for i in range(mesh.cfg.replicas)
    )


async def _streaming_on(load: Load, pod: str) -> bool:
    """A stream on `pod` with at most half its tokens received: the engine is still generating
    it when the kill lands (one with its last tokens in flight may be done at the engine already,
    and then there is nothing to resume)."""
    return any(
        r.expected_tokens is None or 2 * r.tokens <= r.expected_tokens for r in load.streaming(pod)
    )


async def _done_since(load: Load, t: float, n: int) -> bool:
    return sum(1 for r in load.results if r.t_start >= t) >= n


async def run_up_restarts(cfg: UpRestartConfig, scenarios=UP_SCENARIOS) -> UpRestartReport:
    """Every scenario in turn on one `kvmesh up` mesh; a scenario that leaves it broken (not
    every replica routable within `back_timeout`) is reported, and the next one gets a fresh mesh."""
    rep = UpRestartReport()
    t0 = time.monotonic()
    mesh: UpMesh | None = None
    try:
        for i, (name, child, sig) in enumerate(scenarios):
            if mesh is not None and not await mesh.whole(cfg.back_timeout):
                await mesh.close()
                mesh = None
                rep.fresh_meshes += 1
            if mesh is None:
                mesh = UpMesh(cfg.mesh)
                await mesh.__aenter__()
            rep.scenarios.append(await up_restart(mesh, cfg, name, child, sig, seed=i))
        if mesh is not None:
            rep.stop_exit = await mesh.stop()
    finally:
        if mesh is not None:
            await mesh.close()
    rep.duration_s = time.monotonic() - t0
    return rep
