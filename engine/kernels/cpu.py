"""The CPU kernels, compiled once on first use (C++, torch extension): decode and
prefill attention over the paged cache, the fused elementwise ops (RMSNorm with the
residual add, RoPE on q/k in place, SiLU-and-mul), and linear layers over panel-packed
weights for decode-size batches (onednn_linear.py uses them).

Builds with the system compiler into torch's extension cache: ahead of time with
``kvmesh build-kernels`` (``make setup`` runs it), else on the first engine start. The build
directory is named after everything the library depends on (the sources, the flags, torch's
version, the Python ABI), and a finished build there is loaded without ninja, whichever
checkout or venv built it (build_record.py). One process builds at a time; the others wait
for it, for at most KVMESH_CPU_KERNELS_WAIT_S seconds, and a lock left by a builder that died
is cleared (build_lock.py). If the kernels cannot be built (no compiler, KVMESH_CPU_KERNELS=0,
that wait ran out), the model falls back to plain torch ops, which compute the same thing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_SOURCE_FILES = (
    "bindings_cpu.cpp",
    "paged_attention_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "fused_ops_cpu.cpp",
    "panel_linear_cpu.cpp",
    "panel_linear_bf16_cpu.cpp",
    "decode_stack_cpu.cpp",
    "lora_cpu.cpp",
)
_HEADERS = (
    "avx512_math.h",
    "avx2_math.h",
    "decode_attention_avx2.h",
    "prefill_attention_avx2.h",
    "work_queue.h",
    "cpu_ops.h",
)
_SOURCES = [Path(__file__).with_name(n) for n in _SOURCE_FILES]
_module = None
_failed = False


def portable() -> bool:
    """Whether the kernels are built without -march=native (KVMESH_CPU_KERNELS_PORTABLE=1)."""
    return os.environ.get("KVMESH_CPU_KERNELS_PORTABLE") == "1"


def _cpu_flags() -> list[str]:
    # Built on the machine that runs it (torch's extension cache is per machine), so
    # -march=native is safe and turns on the AVX-512 paths (or the AVX2 ones on a CPU without
    # AVX-512). -ffast-math lets the softmax's exp vectorise (glibc's libmvec); the tests check
    # the result against the torch path.
    flags = ["-O3", "-fopenmp", "-ffast-math"]
    return flags if portable() else flags + ["-march=native"]


def _build_inputs(flags: list[str]) -> dict[str, Any]:
    """What the built library depends on. The headers count (torch's own cache keys on the .cpp
    files only); ninja and the source paths do not (a finished build is loaded without ninja)."""
    import torch

    digest = hashlib.sha256()
    for name in _SOURCE_FILES + _HEADERS:
        digest.update(Path(__file__).with_name(name).read_bytes())
    return {
        "sources": digest.hexdigest(),
        "flags": flags,
        "torch": torch.__version__,
        "python": sysconfig.get_config_var("EXT_SUFFIX"),
    }


def _build_name(flags: list[str], inputs: dict[str, Any] | None = None) -> str:
    """The build's name (and directory), keyed by its inputs (``_build_inputs(flags)``)."""
    inputs = _build_inputs(flags) if inputs is None else inputs
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    kind = "native" if "-march=native" in flags else "portable"
    return f"kvmesh_cpu_ops_{key[:10]}_{kind}"


def wait_timeout() -> float:
    """How long a start waits for another process's build (KVMESH_CPU_KERNELS_WAIT_S, seconds)."""
    return float(os.environ.get("KVMESH_CPU_KERNELS_WAIT_S", "900"))


def build_name() -> str:
    return _build_name(_cpu_flags())


def build_directory(name: str) -> Path:
    """Where torch builds (and caches) the extension: TORCH_EXTENSIONS_DIR or torch's default."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def build(timeout: float | None = None):
    """Build (or load the cached build of) the kernels; raises on failure. One process builds at
    a time; others wait for it at most ``timeout`` seconds (BuildLockTimeout), and a lock left by
    a builder that died is cleared (build_lock.py)."""
    from torch.utils.cpp_extension import load as load_extension

    from kvmesh.engine.kernels import build_record
    from kvmesh.engine.kernels.build_lock import exclusive_build

    flags = _cpu_flags()
    inputs = _build_inputs(flags)  # the sources read once: they key the name and the record
    name = _build_name(flags, inputs)
    directory = build_directory(name)
    with exclusive_build(directory, wait_timeout() if timeout is None else timeout):
        module = build_record.load_finished(directory, name)
        if module is not None:
            return module
        log.info(
            "building the CPU kernels in %s (once; cached by torch; `kvmesh build-kernels` does it "
            "ahead of time)",
            directory,
        )
        module = load_extension(
            name=name,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
        build_record.record(directory, name, inputs)
        return module


def load():
    """The compiled module, or None when unavailable (the model then runs plain torch ops)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("KVMESH_CPU_KERNELS", "1") == "0":
        _failed = True
        return None
    try:
        _module = build()
    except (
        Exception
    ) as exc:  # no compiler, no ninja, a build that never ends: keep serving with torch
        log.warning("CPU kernels unavailable, using plain torch ops (slower): %s", exc)
        _failed = True
    return _module
