"""A ModelDeployment's KV tiers (spec.engine.kvOffload): engine flags, the shared volume and the
memory the host tier adds to the engine container (pure functions).

The host tier (``hostMemory``) is the engine's ``--kv-offloading-size``: blocks evicted from the
KV cache are copied to host memory, so that memory is added to the container's request and
limit. The shared tier (``shared``) is a directory every replica mounts (``--kv-shared-dir``),
one file per block key; the engine bounds it to ``size`` (``--kv-shared-size``).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from kvmesh.operator import crd

VOLUME = "kv-shared"
SHARED_DIR = "/var/lib/kvmesh/kv-shared"
MIN_BYTES = 2**20  # the flags are GiB with six decimals: less would render as 0
GIB = 2**30

_SUFFIX = {
    "": 1,
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    **{s: 1000 ** (i + 1) for i, s in enumerate("kMGTPE")},
    **{f"{s}i": 1024 ** (i + 1) for i, s in enumerate("KMGTPE")},
}
_SIZE = re.compile(crd.SIZE_PATTERN)
_QUANTITY = re.compile(r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:([a-zA-Z]{0,2})|[eE]([+-]?[0-9]+))$")


def quantity_bytes(value: Any) -> Fraction:
    """A Kubernetes quantity (``8Gi``, ``512Mi``, ``20G``, ``1e9``, an integer) -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Fraction(value)
    m = _QUANTITY.match(str(value).strip()) if isinstance(value, str) else None
    if not m or (m.group(2) or "") not in _SUFFIX:
        raise ValueError(f"{value!r} is not a quantity (e.g. 8Gi, 512Mi)")
    number, suffix, exponent = m.groups()
    scale = Fraction(10) ** int(exponent) if exponent else Fraction(_SUFFIX[suffix or ""])
    return Fraction(number) * scale


def gib(value: Any) -> str:
    """A quantity as the engine flags' GiB, a plain decimal: 8Gi -> 8, 512Mi -> 0.5."""
    text = f"{float(quantity_bytes(value) / GIB):.6f}".rstrip("0").rstrip(".")
    return text or "0"


def _quantity_text(nbytes: Fraction) -> str:
    """Bytes as the shortest exact binary quantity (32Gi), else whole bytes (rounded up)."""
    whole = -(-nbytes.numerator // nbytes.denominator)
    for i, s in reversed(list(enumerate("KMGTPE"))):
        if whole % 1024 ** (i + 1) == 0:
            return f"{whole // 1024 ** (i + 1)}{s}i"
    return str(whole)


def settings(spec: dict[str, Any]) -> dict[str, Any]:
    kv = (spec.get("engine") or {}).get("kvOffload")
    return kv if isinstance(kv, dict) else {}


def host_memory(spec: dict[str, Any]) -> str | None:
    return settings(spec).get("hostMemory")


def shared(spec: dict[str, Any]) -> dict[str, Any] | None:
    sh = settings(spec).get("shared")
    return sh if isinstance(sh, dict) else None


def engine_flags(spec: dict[str, Any], vllm: bool = False) -> list[str]:
    """The engine's KV tier flags (vLLM's names for the host tier; vLLM has no shared tier)."""
    flags = []
    if host_memory(spec) is not None:
        flags += ["--kv-offloading-size", gib(host_memory(spec))]
        flags += ["--kv-offloading-backend", "native"] if vllm else []
    sh = shared(spec)
    if sh is not None and not vllm:
        flags += ["--kv-shared-dir", SHARED_DIR]
        flags += ["--kv-shared-size", gib(sh.get("size", crd.DEFAULT_KV_SHARED_SIZE))]
    return flags


def volumes(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The shared tier's pod volume, from its one source, as the user wrote it."""
    sh = shared(spec)
    if sh is None:
        return []
    (kind, source), *_ = sorted((sh.get("volume") or {}).items())
    return [{"name": VOLUME, kind: dict(source)}]


def mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": VOLUME, "mountPath": SHARED_DIR}] if shared(spec) is not None else []


def grown_resources(resources: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """The engine container's resources with the host tier's memory added to its memory
    request and limit (where they are set): that memory is the container's own."""
    if host_memory(spec) is None:
        return resources
    extra = quantity_bytes(host_memory(spec))
    out = {kind: dict(values) for kind, values in resources.items()}
    for values in out.values():
        if "memory" in values:
            values["memory"] = _quantity_text(quantity_bytes(values["memory"]) + extra)
    return out


def rule_errors(spec: dict[str, Any]) -> list[str]:
    """The kvOffload CEL rule of crd.py, mirrored."""
    sh = shared(spec)
    volume = (sh or {}).get("volume")
    if isinstance(volume, dict) and sum(k in volume for k in crd.KV_SHARED_SOURCES) != 1:
        return [crd.KV_SHARED_VOLUME_RULES[0]["message"]]
    return []


def semantic_errors(spec: dict[str, Any], vllm: bool) -> list[str]:
    """What passes the schema but cannot work: sizes too small to be a flag, memory requests
    that cannot be added to, a shared tier on an engine without one."""
    errors = []
    sizes = [("engine.kvOffload.hostMemory", host_memory(spec))]
    if shared(spec) is not None:
        sizes.append(("engine.kvOffload.shared.size", shared(spec).get("size")))
        if vllm:
            errors.append(
                "engine.kvOffload.shared: the shared KV tier is kvmesh's engine's "
                "(engine.kind kvmesh); vLLM has the host tier (hostMemory) only"
            )
    for field, value in sizes:
        # A value the schema's pattern refuses is reported by the schema check.
        if isinstance(value, str) and _SIZE.match(value) and quantity_bytes(value) < MIN_BYTES:
            errors.append(f"{field}: {value!r} is less than 1Mi")
    if host_memory(spec) is not None:
        errors += _resource_errors(spec)
    return errors


def _resource_errors(spec: dict[str, Any]) -> list[str]:
    resources = (spec.get("engine") or {}).get("resources") or {}
    errors = []
    for kind in ("requests", "limits"):
        value = (resources.get(kind) or {}).get("memory")
        if value is None:
            continue
        try:
            quantity_bytes(value)
        except ValueError as exc:
            errors.append(f"engine.resources.{kind}.memory (grown by kvOffload.hostMemory): {exc}")
    return errors
