"""Contract 4: the routing score, the hotspot guard and deterministic tie-breaking.

    score = w_prefix * matched/total - w_kv * kv_usage - w_queue * queue_share

`matched/total` is the fraction of the request's full blocks the pod already holds
(its longest leading run of block keys), `queue_share` the pod's share of the load
(running + waiting) of all candidate pods. A pod whose load is far above the others'
(> hot_ratio x their mean + hot_min) is skipped unless every pod is that hot. Ties are
broken by rendezvous hashing on the request's last full block key, so every router picks
the same pod for the same prompt and different prompts spread over the pods.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass
class Weights:
    prefix: float = 1.0
    kv: float = 0.5
    queue: float = 0.5

    @classmethod
    def parse(cls, text: str | None) -> "Weights":
        w = cls()
        for part in (text or "").split(","):
            if not part.strip():
                continue
            name, _, value = part.partition("=")
            name = name.strip()
            if name not in ("prefix", "kv", "queue"):
                raise ValueError(f"unknown weight {name!r} (expected prefix, kv, queue)")
            setattr(w, name, float(value))
        return w


@dataclass
class Candidate:
    name: str
    url: str
    kv_usage: float = 0.0
    load: int = 0
    matched_blocks: int = 0
    score: float = 0.0
    hot: bool = False
    extra: dict = field(default_factory=dict)


def rendezvous(tie_key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(tie_key + b"\0" + name.encode(), digest_size=8).digest(), "big")


def mark_hot(cands: list[Candidate], hot_ratio: float, hot_min: int) -> None:
    n = len(cands)
    if n < 2:
        return
    total = sum(c.load for c in cands)
    for c in cands:
        others_mean = (total - c.load) / (n - 1)
        c.hot = c.load > hot_ratio * others_mean + hot_min
    if all(c.hot for c in cands):
        for c in cands:
            c.hot = False


def rank(cands: list[Candidate], total_blocks: int, weights: Weights, tie_key: bytes,
         hot_ratio: float = 2.0, hot_min: int = 2) -> list[Candidate]:
    """Best first. Hot pods go last (they stay as retry candidates)."""
    total_load = sum(c.load for c in cands)
    for c in cands:
        prefix = c.matched_blocks / total_blocks if total_blocks else 0.0
        share = c.load / total_load if total_load else 0.0
        c.score = weights.prefix * prefix - weights.kv * c.kv_usage - weights.queue * share
    mark_hot(cands, hot_ratio, hot_min)
    return sorted(cands, key=lambda c: (c.hot, -round(c.score, 9), -rendezvous(tie_key, c.name)))
