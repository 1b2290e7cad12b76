"""Restart scenarios through `kvmesh up`: two `kvmesh serve` replicas of a tiny random-weight
model, their sidecars, the router and the embedded Redis. Each part in turn is killed under a
client load through the router (tests/support/chaos/up_restarts.py: `up_restart`); `kvmesh up` must restart
it, every replica must be routable again within a bound (the router's /ready and a `ready`
heartbeat written after the restart), and no request may fail but the killed process's own.

The scenarios share one mesh (a start costs the engines' model load); one that leaves it broken
costs the next a fresh one."""

from __future__ import annotations

import asyncio
import signal

import pytest
import redis

from kvmesh_testing.chaos import UpConfig, UpMesh, UpRestart, UpRestartConfig, up_restart
from tests.tiny_models import build_tiny_model

# Seconds from the kill until every replica is routable again. An engine's restart is its process
# start and model load (about 6 s on an idle 2-core machine, 20-45 s when other test processes
# share the cores); the other parts come back in 2-5 s. A part that is never restarted, or a
# replica left unroutable (a sidecar that keeps a restarted engine `draining`), fails.
ENGINE_BACK_S = 90.0
PART_BACK_S = 30.0


class SharedMesh:
    """One `kvmesh up` for the module, on its own event loop (the mesh's clients are bound to it)."""

    def __init__(self, cfg: UpRestartConfig):
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.mesh: UpMesh | None = None

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def get(self) -> UpMesh:
        if self.mesh is not None and not self.run(self.mesh.whole(20)):
            self.run(self.mesh.close())
            self.mesh = None
        if self.mesh is None:
            mesh = UpMesh(self.cfg.mesh)
            self.run(mesh.__aenter__())
            self.mesh = mesh
        return self.mesh

    def restart(self, name: str, child: str, sig: int) -> UpRestart:
        rep = self.run(up_restart(self.get(), self.cfg, name, child, sig))
        print(rep.line())
        return rep

    def close(self) -> None:
        if self.mesh is not None:
            self.run(self.mesh.close())
        self.loop.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "m", "tiny-llama-plain")
    cfg = UpRestartConfig(
        workers=3,
        requests_after=6,
        back_timeout=ENGINE_BACK_S,
        mesh=UpConfig(
            replicas=2,
            engine_model=str(model),
            model="tiny",
            # long enough that a stream seen half done is still generating when the kill lands
            response_tokens=96,
            engine_args=["--num-kv-blocks", "16384"],  # 128 MiB in fp32, 64 in bf16: no evictions
            # plain torch ops: a restart never waits for a build of the CPU kernels
            env={"KVMESH_CPU_KERNELS": "0"},
        ),
    )
    s = SharedMesh(cfg)
    yield s
    s.close()


def _assert_no_failure_beyond_own(rep: UpRestart) -> None:
    assert not rep.error, rep.error
    assert [r.short() for r in rep.failed_beyond] == [], rep.line()
    assert [r.short() for r in rep.results if r.kind == "hang"] == []
    assert rep.ok >= 6, rep.line()  # at least the requests after the restart were served


def _router_resumed(shared) -> float:
    """The router's kvmesh_router_resumed_requests_total, every phase summed."""
    text = shared.run(shared.get().http.get(shared.get().url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvmesh_router_resumed_requests_total")
    )


def test_engine_sigkill_loses_nothing_its_streams_go_on_elsewhere_and_it_is_routable_again(shared):
    resumed_before = _router_resumed(shared)
    rep = shared.restart("engine SIGKILL", "engine-0", signal.SIGKILL)
    _assert_no_failure_beyond_own(rep)
    assert (
        "engine-0 exited (killed by SIGKILL)" in rep.exit_logged
        and "restarting it in" in rep.exit_logged
    )
    assert rep.back_after_s is not None and rep.back_after_s < ENGINE_BACK_S, rep.line()
    mid = [r for r in rep.in_flight_at_kill if r.tokens >= 1]
    assert mid, "no stream was mid-way on the killed engine: the fault tested nothing"
    # The router sends each stream the engine held on to the other replica (a continuation from the
    # ids its client received): nothing fails, not even the killed engine's own streams.
    assert [r.short() for r in rep.failed] == [], rep.line()
    assert all(r.ok for r in mid), [r.short() for r in mid]
    assert _router_resumed(shared) - resumed_before >= len(mid), (
        "the streams completed without a resume"
    )


def test_engine_sigterm_drains_loses_nothing_and_is_routable_again(shared):
    rep = shared.restart("engine SIGTERM", "engine-0", signal.SIGTERM)
    _assert_no_failure_beyond_own(rep)
    assert "engine-0 exited (exit code 0)" in rep.exit_logged, rep.exit_logged
    assert rep.back_after_s is not None and rep.back_after_s < ENGINE_BACK_S, rep.line()
    assert rep.in_flight_at_kill, "no request was in flight on the drained engine"
    # A drained engine finishes what it holds: nothing fails at all.
    assert [r.short() for r in rep.failed] == []


def test_sidecar_sigkill_fails_nothing_and_the_new_sidecar_takes_over(shared):
    rep = shared.restart("sidecar SIGKILL", "sidecar-0", signal.SIGKILL)
    _assert_no_failure_beyond_own(rep)
    assert "sidecar-0 exited (killed by SIGKILL)" in rep.exit_logged
    assert rep.back_after_s is not None and rep.back_after_s < PART_BACK_S, rep.line()
    assert [r.short() for r in rep.failed] == []


def test_router_sigkill_fails_only_its_in_flight_requests_and_comes_back(shared):
    rep = shared.restart("router SIGKILL", "router", signal.SIGKILL)
    _assert_no_failure_beyond_own(rep)
    assert "router exited (killed by SIGKILL)" in rep.exit_logged
    assert rep.back_after_s is not None and rep.back_after_s < PART_BACK_S, rep.line()
    assert rep.in_flight_at_kill, "no request was in flight on the killed router"
    # Every request after the new router listens succeeds (failed_beyond covers them): only
    # those it held when it died, or that found no router listening, failed.
    assert all(r.kind in ("truncated", "reset", "refused") for r in rep.own), [
        r.short() for r in rep.own
    ]


def test_redis_sigkill_fails_nothing_and_the_sidecars_restore_the_index(shared):
    rep = shared.restart("Redis SIGKILL", "redis", signal.SIGKILL)
    _assert_no_failure_beyond_own(rep)
    assert "redis exited (killed by SIGKILL)" in rep.exit_logged
    assert rep.back_after_s is not None and rep.back_after_s < PART_BACK_S, rep.line()
    # No request fails because of Redis: routing falls back to load only while it is gone.
    assert [r.short() for r in rep.failed] == []
    # The restarted Redis (empty, same port) gets every block set back from the sidecars: every
    # key of before the kill (the engines' caches are large enough to evict nothing here), and
    # each set exactly its sidecar's index once the load stops.
    assert rep.keys_before > 0
    assert rep.restored_after_s is not None and rep.restored_after_s < PART_BACK_S
    assert rep.keys_back is True
    assert rep.keys_restored >= rep.keys_before
    # on the same port: the URL everyone was given answers from the new process
    mesh = shared.get()
    info = redis.Redis.from_url(mesh.state()["redis_url"]).info("server")
    assert info["process_id"] == mesh.processes()["redis"] != rep.old_pid


def test_up_stops_cleanly_after_the_restarts(shared):
    mesh = shared.get()
    pids = dict(mesh.processes())
    assert set(pids) == {"redis", "router", "engine-0", "sidecar-0", "engine-1", "sidecar-1"}
    assert shared.run(mesh.stop()) == 0, mesh.tail(40)
    assert "[up] stopped" in mesh.log_text()
    import os

    alive = []
    for name, pid in pids.items():
        try:
            os.kill(pid, 0)
            alive.append(name)
        except ProcessLookupError:
            pass
    assert alive == []
