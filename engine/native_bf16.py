"""Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), read from /proc/cpuinfo."""

from __future__ import annotations

import functools

# The x86 flags of a bf16 dot product in hardware; the first found names the reason in the log.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags() -> set[str]:
    """The first processor's flags (every core of a machine has the same); empty off Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


@functools.cache
def native_bf16_flag() -> str | None:
    """The cpuinfo flag by which this CPU multiplies bf16 natively, or None (AVX2-only x86, a CPU
    whose flags cannot be read: bf16 would be widened to fp32 in software there)."""
    flags = cpu_flags()
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)
