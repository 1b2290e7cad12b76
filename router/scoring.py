"""Contract 4: the routing score, the hotspot guard and deterministic tie-breaking.

    score = w_prefix * saved/total + w_lora * affinity - w_kv * kv_usage - w_queue * queue_share

`saved/total` is the share of the request's full blocks whose prefill the pod saves: its
longest leading run of block keys in its KV cache (g), then block by block in its host tier (c)
or the shared tier (s), each of those worth its prefill less its load time
(kvmesh/common/kv_tiers.py ``saved_blocks``, with the pod's measured costs); without tiers it is
the matched/total of the leading run. `affinity` how ready the pod is to run the LoRA adapter
the request names (router/adapters.py: 1 active in its batch, 0.5 a free adapter slot, else 0;
always 0 for the base model), `queue_share` the pod's share of the load
(running + waiting) of all candidate pods. A pod whose load is far above the others'
(> hot_ratio x their mean + hot_min) goes last; with hot_ratio >= 1 and hot_min >= 0 the
least-loaded pod never is, so a pod is always left in front (not every pod can be hot). Ties are
broken by rendezvous hashing on the request's last full block key, so every router picks
the same pod for the same prompt and different prompts spread over the pods.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvmesh.common.kv_tiers import BlockCosts, saved_blocks

DEFAULT_COSTS = BlockCosts()


@dataclass
class Weights:
    prefix: float = 1.0
    kv: float = 0.5
    queue: float = 0.5
    lora: float = 0.25  # below prefix: a cached prefix counts more than a loaded adapter

    @classmethod
    def parse(cls, text: str | None) -> Weights:
        w = cls()
        for part in (text or "").split(","):
            if not part.strip():
                continue
            name, _, value = part.partition("=")
            name = name.strip()
            if name not in ("prefix", "kv", "queue", "lora"):
                raise ValueError(f"unknown weight {name!r} (expected prefix, kv, queue, lora)")
            setattr(w, name, float(value))
        return w


@dataclass
class Candidate:
    name: str
    url: str
    kv_usage: float = 0.0
    load: int = 0
    matched_blocks: int = 0  # the leading run in its KV cache (g)
    cpu_blocks: int = 0  # then in its host tier (c)
    shared_blocks: int = 0  # then in the shared tier (s)
    costs: BlockCosts | None = None  # its costs per block (None: the defaults)
    score: float = 0.0
    hot: bool = False
    extra: dict = field(default_factory=dict)
    affinity: float = 0.0  # for the request's LoRA adapter (router/adapters.py)

    @property
    def cached_blocks(self) -> int:
        """The prompt's leading blocks it need not prefill, from any tier."""
        return self.matched_blocks + self.cpu_blocks + self.shared_blocks

    @property
    def saved_blocks(self) -> float:
        return saved_blocks(
            self.matched_blocks, self.cpu_blocks, self.shared_blocks, self.costs or DEFAULT_COSTS
        )


def rendezvous(tie_key: bytes, name: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(tie_key + b"\0" + name.encode(), digest_size=8).digest(), "big"
    )


def check_hotspot_params(hot_ratio: float, hot_min: int) -> None:
    """The guard's parameters: ``hot_ratio >= 1`` and ``hot_min >= 0`` (ValueError otherwise).

    Below these, "hot" would no longer mean "far above the others" (with a ratio under 1 a pod
    at the others' mean is hot), and every pod could be hot at once."""
    if not (isinstance(hot_ratio, (int, float)) and 1.0 <= hot_ratio < float("inf")):
        raise ValueError(f"hotspot ratio must be a finite number >= 1, got {hot_ratio!r}")
    if isinstance(hot_min, bool) or not isinstance(hot_min, int) or hot_min < 0:
        raise ValueError(f"hotspot minimum load must be an integer >= 0, got {hot_min!r}")


def mark_hot(cands: list[Candidate], hot_ratio: float, hot_min: int) -> None:
    """Mark the pods whose load is far above the others': load > hot_ratio x (mean of the others) + hot_min.

    "Skipped unless all are" holds by construction, so there is no all-hot fallback: with
    hot_ratio >= 1 and hot_min >= 0 (check_hotspot_params) the least-loaded pod is never hot, since
    its load is at most the mean of the others, which is at most hot_ratio x that mean + hot_min.
    At least one pod is always left in front of the hot ones."""
    n = len(cands)
    if n < 2:
        return
    total = sum(c.load for c in cands)
    for c in cands:
        others_mean = (total - c.load) / (n - 1)
        c.hot = c.load > hot_ratio * others_mean + hot_min


def rank(
    cands: list[Candidate],
    total_blocks: int,
    weights: Weights,
    tie_key: bytes,
    hot_ratio: float = 2.0,
    hot_min: int = 2,
) -> list[Candidate]:
    """Best first. Hot pods go last (they stay as retry candidates)."""
    total_load = sum(c.load for c in cands)
    for c in cands:
        prefix = c.saved_blocks / total_blocks if total_blocks else 0.0
        share = c.load / total_load if total_load else 0.0
        c.score = (
            weights.prefix * prefix
            + weights.lora * c.affinity
            - weights.kv * c.kv_usage
            - weights.queue * share
        )
    mark_hot(cands, hot_ratio, hot_min)
    return sorted(cands, key=lambda c: (c.hot, -round(c.score, 9), -rendezvous(tie_key, c.name)))
