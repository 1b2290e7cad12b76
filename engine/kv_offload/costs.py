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
        self.read_seconds: dict[str, float] = {}  # "SHARED" -> a file's read, per block

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

    def observe_read(self, medium: str, seconds: float, blocks: int) -> None:
        """``blocks`` blocks were read from ``medium``'s files in ``seconds`` (before their
        load): part of what a block from that tier costs."""
        if blocks > 0 and seconds >= 0:
            old = self.read_seconds.get(medium)
            per_block = seconds / blocks
            self.read_seconds[medium] = (
                per_block if old is None else old + self.alpha * (per_block - old)
            )

    def _load(self, medium: str, default: float) -> float:
        """A load's seconds: its copy, plus its read where it has files."""
        copy, read = self.seconds.get(medium), self.read_seconds.get(medium)
        if copy is None and read is None:
            return default
        return (copy or 0.0) + (read or 0.0)

    def costs(self) -> BlockCosts:
        """The figures as the contract carries them (defaults where nothing was measured)."""
        d = BlockCosts()
        prefill = self.seconds.get("prefill")
        if prefill is None:
            return d
        return BlockCosts(
            prefill,
            self._load(MEDIUM_CPU, d.cpu * prefill),
            self._load(MEDIUM_SHARED, d.shared * prefill),
        )

    def by_source(self) -> dict[str, float]:
        """The gauge's samples: COST_METRIC{source=prefill|CPU|SHARED}."""
        c = self.costs()
        return {"prefill": c.prefill, MEDIUM_CPU: c.cpu, MEDIUM_SHARED: c.shared}
