"""The shared tier in the engine: its store, the write-through of the blocks each step completes,
and its events handed over from the writer thread."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from kvmesh.engine.kv_offload.block_io import gather_blocks
from kvmesh.engine.kv_offload.shared_store import SharedKVStore, store_fingerprint

log = logging.getLogger(__name__)

GIB = 1024**3


class EventInbox:
    """The store's events, put by its writer thread, taken by the engine thread with the KV
    cache's own."""

    def __init__(self):
        self._lock = threading.Lock()
        self._events: list = []

    def put(self, events: list) -> None:
        with self._lock:
            self._events.extend(events)

    def pending(self) -> bool:
        return bool(self._events)

    def take(self) -> list:
        with self._lock:
            events, self._events = self._events, []
        return events


def build_shared_store(
    args, model_id: str, dtype, kv_shape: tuple[int, ...], block_bytes: int, inbox=None
) -> SharedKVStore | None:
    """The store for ``--kv-shared-dir`` (None: off). ``kv_shape``: one block's KV layout
    (layers, kv_heads, block_size, head_dim); with ``dtype`` and the model it names the
    store's fingerprint, so entries of another layout are never read."""
    if not args.kv_shared_dir:
        return None
    fingerprint = store_fingerprint(model_id, str(dtype), args.block_size, kv_shape)
    store = SharedKVStore(
        args.kv_shared_dir,
        fingerprint,
        block_bytes,
        int(args.kv_shared_size * GIB),
        on_events=inbox.put if inbox is not None else None,
    )
    log.info(
        "shared KV tier: %s (%d entries)%s",
        store.dir,
        store.num_blocks,
        f"; {store.problem}" if store.problem else "",
    )
    return store


@dataclass(frozen=True)
class Completed:
    """A block registered in the prefix cache when its step was scheduled."""

    block: object  # KVBlock
    key: int
    parent: int | None
    token_ids: tuple[int, ...]
    lora: object


class WriteThrough:
    """The blocks a step completes, noted as the pool registers them (at scheduling) and
    written to the store once the step has run: packed here, written behind."""

    def __init__(self, store: SharedKVStore, pool, block_size: int):
        self.store = store
        self.pool = pool
        self.block_size = block_size
        self._noted: list[Completed] = []

    def note(self, block, parent: int | None, token_ids, lora) -> None:
        """BlockPool's ``on_cached``: ``block`` now holds ``block.key``."""
        self._noted.append(Completed(block, block.key, parent, tuple(token_ids), lora))

    def take(self) -> list[Completed]:
        """The blocks of the step being dispatched (noted since the last call)."""
        noted, self._noted = self._noted, []
        return noted

    def write(self, completed: list[Completed], kv_caches) -> None:
        """After the step ran: queue every block that still holds its key (one evicted or
        dropped from the cache since holds other content, or none). One gather for the step's
        blocks; each payload is a row of it, handed over without another copy."""
        if self.store.problem is not None:
            return
        todo = [
            c
            for c in completed
            if self.pool.cached.get(c.key) is c.block and not self.store.contains(c.key)
        ]
        if not todo:
            return
        device = kv_caches[0][0].device
        ids = torch.tensor([c.block.block_id for c in todo], device=device)
        rows = gather_blocks(kv_caches, ids).cpu().view(torch.uint8).numpy()
        for c, row in zip(todo, rows):
            self.store.write_behind(
                c.key,
                c.parent,
                c.token_ids,
                self.block_size,
                None if c.lora is None else c.lora.int_id,
                None if c.lora is None else c.lora.name,
                memoryview(row),
            )
