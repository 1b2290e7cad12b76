"""The tiers behind the KV cache, as the KV-cache manager sees them: lookups past the cache's
leading run, copy-on-evict to the host tier, and the transfers a step runs before its forward.

``shared`` is the shared tier's store (shared_store.py's ``SharedKVStore``), None when it is
off: it is read on lookup (``contains`` then ``read``, a verified payload or None)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from kvmesh.common.kv_tiers import MEDIA, MEDIUM_CPU, MEDIUM_GPU, MEDIUM_SHARED
from kvmesh.engine.kv_offload.costs import BlockCostMeter
from kvmesh.engine.kv_offload.host_pool import HostEntry, HostPool
from kvmesh.engine.kv_offload.transfer import KVLoad, KVStore, Transfers

GIB = 1024**3


@dataclass(frozen=True)
class TierHit:
    """A block found past the KV cache's leading run: in the host tier (its slot) or the shared
    tier (its verified payload)."""

    key: int
    medium: str
    host_slot: int | None = None
    payload: bytes | None = None


@dataclass
class TierStats:
    """The tiers' figures for /metrics."""

    blocks: dict[str, int] = field(default_factory=dict)  # medium -> blocks held
    hit_tokens: dict[str, int] = field(default_factory=dict)  # medium -> prompt tokens not computed
    costs: dict[str, float] = field(default_factory=dict)  # source -> seconds per block


class KVTiers:
    def __init__(self, block_size: int, host_blocks: int = 0, shared=None, shared_events=None):
        self.block_size = block_size
        self.host = HostPool(host_blocks) if host_blocks > 0 else None
        self.shared = shared
        self.shared_events = shared_events  # shared_tier.EventInbox: the store's events, or None
        self.meter = BlockCostMeter()
        self.pending = Transfers()
        self.hit_tokens: Counter[str] = Counter({m: 0 for m in MEDIA})

    def set_emit(self, emit) -> None:
        """Where the host tier's events go (the block pool's event list)."""
        if self.host is not None:
            self.host.emit = emit

    # -- copy-on-evict --------------------------------------------------------------------
    def offload(self, block) -> None:
        """A cached block of the KV cache is being evicted (its content is still there until the
        step runs): copy it into the host tier."""
        if self.host is None or block.token_ids is None:
            return
        lora = block.lora

        def entry(slot: int) -> HostEntry:
            return HostEntry(
                slot,
                block.parent_key,
                block.token_ids,
                self.block_size,
                None if lora is None else lora.int_id,
                None if lora is None else lora.name,
            )

        slot = self.host.put(block.key, entry)
        if slot is not None:
            self.pending.stores.append(KVStore(block.block_id, slot))

    # -- lookup and loads ------------------------------------------------------------------
    def lookup(self, keys: list[int]) -> list[TierHit]:
        """The leading run of ``keys`` that the tiers hold, block by block: the host tier first,
        then the shared tier; the first block neither holds ends it."""
        hits: list[TierHit] = []
        for key in keys:
            entry = self.host.lookup(key) if self.host is not None else None
            if entry is not None:
                hits.append(TierHit(key, MEDIUM_CPU, host_slot=entry.slot))
                continue
            payload = self._read_shared(key)
            if payload is None:
                break
            hits.append(TierHit(key, MEDIUM_SHARED, payload=payload))
        return hits

    def _read_shared(self, key: int) -> bytes | None:
        if self.shared is None or not self.shared.contains(key):
            return None
        t0 = time.perf_counter()
        payload = self.shared.read(key)
        if payload is not None:  # the file's read; the copy into the cache is timed as a load
            self.meter.observe_read(MEDIUM_SHARED, time.perf_counter() - t0, 1)
        return payload

    def pin(self, hits: list[TierHit]) -> None:
        """The hits will be loaded this step: no store of this step may take their slots."""
        for hit in hits:
            if hit.host_slot is not None:
                self.host.pin(hit.key)

    def load(self, hits: list[TierHit], blocks) -> None:
        """Fill fresh KV-cache blocks from the hits (pinned before those blocks were allocated)."""
        for hit, block in zip(hits, blocks):
            self.pending.loads.append(KVLoad(block.block_id, hit.host_slot, hit.payload))
            self.hit_tokens[hit.medium] += self.block_size

    def take_transfers(self) -> Transfers:
        """The copies scheduled since the last call (the step about to run executes them)."""
        transfers, self.pending = self.pending, Transfers()
        if self.host is not None:
            self.host.unpin_all()
        return transfers

    def clear(self) -> None:
        """reset_prefix_cache: the host tier forgets everything (no block is in use)."""
        if self.host is not None:
            self.host.clear()
        self.pending.stores.clear()

    def stats(self, gpu_blocks: int) -> TierStats:
        blocks = {
            MEDIUM_GPU: gpu_blocks,
            MEDIUM_CPU: len(self.host) if self.host is not None else 0,
        }
        if self.shared is not None:  # present only when on: its sample says the tier is on
            blocks[MEDIUM_SHARED] = self.shared.num_blocks
        return TierStats(
            blocks=blocks, hit_tokens=dict(self.hit_tokens), costs=self.meter.by_source()
        )


def by_medium(gpu_blocks: int, hits: list[TierHit], block_size: int) -> dict[str, int]:
    """A request's cached tokens by the tier each came from."""
    out = {m: 0 for m in MEDIA}
    out[MEDIUM_GPU] = gpu_blocks * block_size
    for hit in hits:
        out[hit.medium] += block_size
    return out


def host_blocks_for(size_gib: float | None, block_bytes: int) -> int:
    """Blocks a host tier of ``size_gib`` GiB holds (0: no host tier)."""
    if size_gib is None:
        return 0
    blocks = int(size_gib * GIB) // block_bytes
    if blocks < 1:
        raise ValueError(
            f"--kv-offloading-size {size_gib} GiB holds no block of {block_bytes} bytes"
        )
    return blocks


def build_tiers(args, block_bytes: int, shared=None, shared_events=None) -> KVTiers | None:
    """The engine's tiers from its arguments (EngineArgs); None when none is on. The shared
    tier's store (shared_tier.build_shared_store) plugs in as ``KVTiers.shared``, its events
    arrive in ``shared_events``."""
    host_blocks = host_blocks_for(args.kv_offloading_size, block_bytes)
    if not host_blocks and shared is None:
        return None
    return KVTiers(args.block_size, host_blocks, shared, shared_events)
