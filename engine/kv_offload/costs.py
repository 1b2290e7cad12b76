"""What a block costs this engine (seconds): prefilling it, loading it from each tier.

Exponential moving averages, so the router's view follows the load the engine is under; until a
source has a sample it reports the contract's default ratio to the prefill cost."""

from __future__ import annotations

from kvmesh.common.kv_tiers import MEDIUM_CPU, MEDIUM_SHARED, BlockCosts

ALPHA = 0.1  # weight of a new sample


class BlockCostMeter:
    def __init__(self, alpha: float = ALPHA):
        self.alpha = alpha
        self.seconds: dict[str, float] = {}  # "prefill" | "CPU" | "SHARED" -> seconds per block

    def _observe(self, source: str, per_block: float) -> None:
        old = self.seconds.get(source)
        self.seconds[source] = per_block if old is None else old + self.alpha * (per_block - old)

    def observe_step(
        self, seconds: float, prefill_tokens: int, total_tokens: int, block_size: int
    ) -> None:
        """A step of ``total_tokens`` tokens, ``prefill_tokens`` of them prompt tokens, took
        ``seconds``: its prefill share of the time, per prefilled block."""
        if prefill_tokens < block_size or total_tokens <= 0 or seconds <= 0:
            return  # too little prefill to say what a block costs
        share = seconds * prefill_tokens / total_tokens
        self._observe("prefill", share * block_size / prefill_tokens)

    def observe_load(self, medium: str, seconds: float, blocks: int) -> None:
        """``blocks`` blocks came from ``medium`` in ``seconds``."""
        if blocks > 0 and seconds >= 0:
            self._observe(medium, seconds / blocks)

    def costs(self) -> BlockCosts:
        """The figures as the contract carries them (defaults where nothing was measured)."""
        d = BlockCosts()
        prefill = self.seconds.get("prefill")
        if prefill is None:
            return d
        return BlockCosts(
            prefill,
            self.seconds.get(MEDIUM_CPU, d.cpu * prefill),
            self.seconds.get(MEDIUM_SHARED, d.shared * prefill),
        )

    def by_source(self) -> dict[str, float]:
        """The gauge's samples: COST_METRIC{source=prefill|CPU|SHARED}."""
        c = self.costs()
        return {"prefill": c.prefill, MEDIUM_CPU: c.cpu, MEDIUM_SHARED: c.shared}
