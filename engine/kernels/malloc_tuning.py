"""glibc malloc settings for CPU inference.

A prefill step allocates activations of tens of MB per layer (the MLP's gate/up
output at a full step's tokens) and frees them a moment later. With glibc's
defaults such blocks are mmap'ed and unmapped, or trimmed off the heap top, so
every step faults the same memory in again (what that costs, measured:
docs/performance.md, "What each CPU part buys"). vLLM's CPU guide answers this by
preloading tcmalloc; this does the same job in-process: blocks up to 32 MiB
come from the heap, and up to 1 GiB of freed heap stays mapped for reuse.

`KVMESH_MALLOC_TUNING=0` leaves malloc alone. Not glibc (musl, macOS): no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD = 1 << 30
_done = False


def tune_malloc() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _done
    if _done:
        return True
    if os.environ.get("KVMESH_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        log.warning("mallopt refused the activation-reuse settings; prefill steps may page-fault")
        return False
    _done = True
    return True
