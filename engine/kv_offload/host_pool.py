"""The host tier's bookkeeping: which block key holds which host slot, in LRU order, with events.

The payloads themselves live in the runner's host buffer (transfer.py); this pool only decides
slots. A slot that a load of the step being scheduled reads is pinned: no store of that step
takes it (stores run before loads)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.common.kv_events import BlockRemoved, BlockStored
from kvmesh.common.kv_tiers import MEDIUM_CPU


@dataclass(frozen=True)
class HostEntry:
    """A block held by the host tier: its slot and what its events say about it."""

    slot: int
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None


class HostPool:
    def __init__(self, num_slots: int, emit: Callable[[object], None] | None = None):
        if num_slots <= 0:
            raise ValueError("the host tier needs at least one block")
        self.num_slots = num_slots
        self.emit = emit  # where BlockStored / BlockRemoved (medium CPU) go; None: no events
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()  # least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def lookup(self, key: int) -> HostEntry | None:
        """The entry of a key (not touched: a lookup may not lead to a load)."""
        return self.entries.get(key)

    def pin(self, key: int) -> HostEntry:
        """A load of this step reads the key's slot: most recently used, and kept this step."""
        self.entries.move_to_end(key)
        self.pinned.add(key)
        return self.entries[key]

    def unpin_all(self) -> None:
        self.pinned.clear()

    def put(self, key: int, entry_of: Callable[[int], HostEntry]) -> int | None:
        """Hold a key: the slot to copy its block into, or None (already held: only touched; or
        every slot pinned: the block is dropped). ``entry_of(slot)`` builds its entry."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        entry = entry_of(slot)
        self.entries[key] = entry
        if self.emit is not None:
            self.emit(
                BlockStored(
                    [key],
                    entry.parent,
                    list(entry.token_ids),
                    entry.block_size,
                    lora_id=entry.lora_id,
                    medium=MEDIUM_CPU,
                    lora_name=entry.lora_name,
                )
            )
        return slot

    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for key in self.entries:  # the least recently used that no load of this step reads
            if key not in self.pinned:
                slot = self.entries.pop(key).slot
                if self.emit is not None:
                    self.emit(BlockRemoved([key], medium=MEDIUM_CPU))
                return slot
        return None

    def clear(self) -> None:
        """Forget every block (reset_prefix_cache: its AllBlocksCleared covers this tier too)."""
        self.entries.clear()
        self.pinned.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
