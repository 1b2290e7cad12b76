"""Contract 5: KV tiers: where a block lives, the tiers' Redis keys, what loading a block costs.

A block of KV can live in three tiers, named as the KV events' ``medium`` names them (vLLM's
native offloading says "GPU" for the engine's KV cache and "CPU" for its host pool; the shared
tier is kvmesh's):

- ``GPU``: the engine's KV cache (also on a CPU engine: it is the cache attention reads);
- ``CPU``: the engine's host tier (``--kv-offloading-size``): blocks evicted from the KV cache,
  copied out instead of dropped, loaded back on a hit;
- ``SHARED``: a content-addressed store on a volume every replica of a deployment mounts
  (``--kv-shared-dir``): one entry per block key, written behind the requests, read by any
  replica.

Redis (beside contract 3's ``blocks:{pod}``, which stays the GPU tier):

- ``kvmesh:v1:{model}:host-blocks:{pod}``  set of the block keys (``key_hex``) in the pod's host
  tier; deleted with the pod's other keys when its heartbeat is gone;
- ``kvmesh:v1:{model}:shared-blocks``      sorted set key_hex -> unix time it was stored: the
  deployment's shared tier (one set for all replicas), capped at ``SHARED_INDEX_MAX`` members
  (oldest dropped first).

Costs: each engine measures what a block costs it (seconds): prefilling one (``prefill``),
loading one from its host tier (``CPU``), from the shared tier (``SHARED``). It exports them as
the gauge ``kvmesh:kv_tier_block_seconds{source=...}``; the sidecar carries them in the heartbeat
(``F_COST_*``); the router scores a pod by the prefill work its tiers save
(:func:`saved_blocks`).

A response's usage says where its cached prompt tokens came from:
``usage.prompt_tokens_details.cached_tokens`` counts all tiers (vLLM's field: tokens not
computed), ``usage.prompt_tokens_details.cached_tokens_by_medium`` splits them
(``{"GPU": n, "CPU": n, "SHARED": n}``; present when the engine has a tier beyond its KV cache).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.common.redis_layout import PREFIX

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_SHARED = "SHARED"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_SHARED)

# The spellings of each tier that engines put in `medium` (None: an engine without tiers, the
# KV cache). Anything else is a tier this reader does not know: its events are ignored.
_SPELLINGS = {
    None: MEDIUM_GPU,
    "GPU": MEDIUM_GPU,
    "gpu": MEDIUM_GPU,
    "cuda": MEDIUM_GPU,
    "CUDA": MEDIUM_GPU,
    "CPU": MEDIUM_CPU,
    "cpu": MEDIUM_CPU,
    "SHARED": MEDIUM_SHARED,
    "shared": MEDIUM_SHARED,
}

SHARED_INDEX_MAX = 1_000_000  # members of the shared-blocks set (the oldest go first)

# Heartbeat fields (optional; absent: the router's defaults below).
F_COST_PREFILL = "cost_prefill_s"  # seconds to prefill one block
F_COST_CPU = "cost_load_cpu_s"  # seconds to load one block from the host tier
F_COST_SHARED = "cost_load_shared_s"  # seconds to load one block from the shared tier
F_HOST_BLOCKS = "host_blocks"  # blocks the host tier holds at most (absent: no host tier)
F_SHARED_TIER = "shared_tier"  # "on" when the engine reads and writes the shared tier

# The engine's gauge of those costs, one sample per source.
COST_METRIC = "kvmesh:kv_tier_block_seconds"
COST_SOURCES = {"prefill": F_COST_PREFILL, MEDIUM_CPU: F_COST_CPU, MEDIUM_SHARED: F_COST_SHARED}

USAGE_BY_MEDIUM = "cached_tokens_by_medium"


def tier_of(medium: str | None) -> str | None:
    """The tier a KV event's ``medium`` names: GPU, CPU, SHARED, or None (a tier we do not know)."""
    return _SPELLINGS.get(medium) if isinstance(medium, (str, type(None))) else None


def host_blocks_key(model: str, pod: str) -> str:
    return f"{PREFIX}{model}:host-blocks:{pod}"


def shared_blocks_key(model: str) -> str:
    return f"{PREFIX}{model}:shared-blocks"


@dataclass(frozen=True)
class BlockCosts:
    """Seconds per block: prefilling it, loading it from the host tier, from the shared tier.

    Defaults (used until a pod reports its own): loads at a twentieth and a tenth of a prefill,
    the order of magnitude a host copy and a page-cache read have against a forward pass."""

    prefill: float = 1.0
    cpu: float = 0.05
    shared: float = 0.10

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> BlockCosts:
        """From a heartbeat (str keys and values); a missing, junk or non-positive figure keeps
        its default, and a load never costs more than the prefill it replaces."""
        d = cls()

        def num(name: str, default: float) -> float:
            try:
                v = float(data.get(name, default))
            except (TypeError, ValueError):
                return default
            return v if 0.0 < v < 1e6 else default

        prefill = num(F_COST_PREFILL, -1.0)
        if prefill <= 0:  # relative defaults: without the prefill cost the loads' mean nothing
            return d
        return cls(
            prefill,
            min(num(F_COST_CPU, d.cpu * prefill), prefill),
            min(num(F_COST_SHARED, d.shared * prefill), prefill),
        )

    def to_mapping(self) -> dict[str, str]:
        return {
            F_COST_PREFILL: f"{self.prefill:.6g}",
            F_COST_CPU: f"{self.cpu:.6g}",
            F_COST_SHARED: f"{self.shared:.6g}",
        }


def saved_blocks(gpu: int, cpu: int, shared: int, costs: BlockCosts) -> float:
    """The prefill work (in blocks) a pod saves on a prompt whose leading blocks it holds: ``gpu``
    in its KV cache (free), then ``cpu`` in its host tier, then ``shared`` in the shared tier
    (each costs its load time instead of its prefill time). The router's prefix score is this
    over the prompt's full blocks; with no tiers it is contract 4's matched/total."""
    p = costs.prefill
    if p <= 0:
        return float(gpu)
    return gpu + cpu * max(0.0, 1.0 - costs.cpu / p) + shared * max(0.0, 1.0 - costs.shared / p)
