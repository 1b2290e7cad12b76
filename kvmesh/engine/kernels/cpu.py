"""The CPU decode-attention kernel, compiled once on first use (C++, torch extension).

Builds with the system compiler into torch's extension cache. If it cannot be
built (no compiler, KVMESH_CPU_KERNELS=0), attention falls back to the pure
torch gather path, which computes the same thing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
_module = None
_failed = False


def _cpu_flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return flags
    if " avx2 " in info and " fma " in info:
        flags += ["-mavx2", "-mfma"]
    return flags


def load():
    """The compiled module, or None when unavailable."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("KVMESH_CPU_KERNELS", "1") == "0":
        _failed = True
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        flags = _cpu_flags()
        log.info("building the CPU paged-attention kernel (once; cached by torch)")
        _module = load_extension(
            name="kvmesh_paged_attention_cpu_" + ("avx2" if "-mavx2" in flags else "base"),
            sources=[str(_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, ...: keep serving with the torch path
        log.warning("CPU attention kernel unavailable, using the torch fallback: %s", exc)
        _failed = True
    return _module
