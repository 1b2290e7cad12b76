"""A loopback mesh launched by `kvmesh up` itself, whose supervisor restarts the parts a scenario kills."""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass, field

from kvmesh.common import redis_layout as rl
from kvmesh.common.ports import free_port
from kvmesh_testing.chaos.lifecycle import LoopbackMesh
from kvmesh_testing.chaos.processes import ChaosError, Proc, wait_for

STUB_ENGINE_ARGS = [
    "--response-tokens",
    "16",
    "--token-delay",
    "0.03",
    "--num-blocks",
    "8192",
]  # large: no evictions, so a block set only grows under load


@dataclass
class UpConfig:
    replicas: int = 2
    # The engines: "stub" (kvmesh.mesh.stub_engine, no model) or a model for `kvmesh serve`
    # (a checkpoint directory or the built-in model's name).
    engine_model: str = "stub"
    model: str = "chaos-up"  # the served model name
    engine_args: list[str] | None = (
        None  # e.g. a small KV cache (default for stubs: STUB_ENGINE_ARGS)
    )
    response_tokens: int = 16  # max_tokens of the load's requests is drawn from [half, this]
    up_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # for `kvmesh up` and so every child
    start_timeout: float = 180.0


def _started(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat): with the pid, who it is."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _argv(c: UpConfig, port: int, state_file) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "up",
        "--port",
        str(port),
        "--replicas",
        str(c.replicas),
        "--served-model-name",
        c.model,
        "--state-file",
        str(state_file),
    ]
    if c.engine_model == "stub":
        argv += ["--engine-command", "stub"]
    else:
        argv += ["--model", c.engine_model]
    engine_args = (
        STUB_ENGINE_ARGS if c.engine_args is None and c.engine_model == "stub" else c.engine_args
    )
    if engine_args:
        argv += ["--engine-args", " ".join(engine_args)]
    return argv + list(c.up_args)


class UpMesh(LoopbackMesh):
    """`kvmesh up` in a process of its own, on free loopback ports, its output in a log file.
    Its state file names each child's process id (`processes`), which is how a scenario finds
    the one it kills."""

    def __init__(self, cfg: UpConfig):
        super().__init__(cfg, free_port(), cfg.replicas, 60, "kvmesh-up-chaos-")
        self.state_file = self.dir / "up.json"
        self.up = Proc(
            "up", _argv(cfg, self.port, self.state_file), self.dir, env=cfg.env, cwd=self.dir
        )
        self.log_path = self.up.log_path
        self.seen: dict[int, str] = {}  # every child pid seen in the state file -> its start time

    @property
    def pods(self) -> list[str]:
        return [f"replica-{i}" for i in range(self.cfg.replicas)]

    async def _launch(self) -> None:
        self.up.start()
        try:
            await wait_for(
                self._up, self.cfg.start_timeout, "kvmesh up to say it is up", interval=0.2
            )
        except ChaosError as exc:
            raise ChaosError(f"{exc}\n--- kvmesh up's log:\n{self.tail(60)}") from None

    async def _up(self) -> bool:
        if not self.up.alive:
            raise ChaosError(f"kvmesh up exited ({self.up.proc.returncode}):\n{self.tail(60)}")
        self.processes()
        return "kvmesh is up" in self.log_text()

    async def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM, as Ctrl-C would; its exit status (None: it had to be killed)."""
        return await self.up.terminate(timeout)

    async def _stop_processes(self) -> None:
        await self.stop()
        for pid, started in self.seen.items():  # a child `up` could not stop (it was killed itself)
            if _started(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _redis_url(self) -> str:
        url = self.state().get("redis_url")
        if not url:
            raise ChaosError("no Redis URL in the state file")
        return url

    def log_text(self) -> str:
        return self.up.log_text()

    def tail(self, n: int = 40) -> str:
        return self.up.tail(n)

    def log_tails(self, n: int = 60) -> str:
        return f"--- kvmesh up's log:\n{self.tail(n)}"

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def processes(self) -> dict[str, int]:
        """The state file's child name -> pid (alive children only), remembered for clean-up."""
        procs = self.state().get("processes") or {}
        for pid in procs.values():
            if pid not in self.seen and (started := _started(pid)) is not None:
                self.seen[pid] = started
        return procs

    # -- probes --------------------------------------------------------------------------------
    async def heartbeats(self) -> dict[str, rl.Heartbeat | None]:
        return await rl.read_heartbeats(self._redis(), self.cfg.model, self.pods)

    async def block_sets_usable(self) -> bool:
        """The router reads Redis and routes on the pods' block sets (not paused by an error)."""
        r = await self.ready()
        return (
            r is not None
            and r.get("block_sets") == "usable"
            and (r.get("discovery") or {}).get("redis") == "ok"
        )

    async def all_routable_since(self, wall: float) -> bool:
        """Every replica routable: the router routes to all of them, and each one's heartbeat in
        Redis is `ready` and was written at or after `wall` (unix time)."""
        beats = await self.heartbeats()
        if not all(
            hb is not None and hb.state == rl.STATE_READY and hb.ts >= wall for hb in beats.values()
        ):
            return False
        return len(beats) == self.cfg.replicas and await self.routable(self.cfg.replicas)

    async def key_sets(self) -> dict[str, set[bytes]]:
        return {
            pod: set(await self._redis().smembers(rl.blocks_key(self.cfg.model, pod)))
            for pod in self.pods
        }

    async def keys_back(self, before: dict[str, set[bytes]]) -> bool:
        """Whether every key of `before` is in its pod's block set again."""
        for pod, keys in before.items():
            if keys and not all(
                await self._redis().smismember(rl.blocks_key(self.cfg.model, pod), list(keys))
            ):
                return False
        return True

    async def whole(self, timeout: float) -> bool:
        """Whether `kvmesh up` still runs and every replica is routable (waiting up to `timeout`)."""

        async def up_and_routable() -> bool:
            return self.up.alive and await self.all_routable_since(0)

        try:
            await wait_for(up_and_routable, timeout, "every replica routable")
        except ChaosError:
            return False
        return True

    async def index_synced(self) -> int | None:
        """Block keys in Redis, once every replica's set is as large as its sidecar's index (its
        heartbeat's num_keys); else None. For a mesh without load: under load the heartbeat's
        count is up to an interval old."""
        total = 0
        for pod, hb in (await self.heartbeats()).items():
            if hb is None or hb.num_keys is None or await self.block_keys(pod) != hb.num_keys:
                return None
            total += hb.num_keys
        return total
