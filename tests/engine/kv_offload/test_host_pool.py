"""The host tier's bookkeeping: LRU slots, pins, and its events (medium CPU, self-describing)."""

from __future__ import annotations

from kvmesh.common.kv_events import BlockRemoved, BlockStored
from kvmesh.engine.kv_offload.host_pool import HostEntry, HostPool


def entry(parent, tokens, lora=(None, None)):
    return lambda slot: HostEntry(slot, parent, tuple(tokens), 2, *lora)


def test_put_emits_a_self_describing_cpu_event():
    events = []
    pool = HostPool(2, events.append)
    assert pool.put(11, entry(None, [1, 2], (3, "ad"))) == 0
    assert events == [BlockStored([11], None, [1, 2], 2, lora_id=3, medium="CPU", lora_name="ad")]


def test_lru_eviction_frees_the_oldest_slot_and_says_so():
    events = []
    pool = HostPool(2, events.append)
    s1 = pool.put(1, entry(None, [1, 2]))
    pool.put(2, entry(1, [3, 4]))
    assert pool.put(1, entry(None, [1, 2])) is None  # held: touched, no copy, no event
    del events[:]
    s3 = pool.put(3, entry(2, [5, 6]))  # 2 is now the least recently used
    assert 2 not in pool and 1 in pool and 3 in pool
    assert s3 != s1
    assert events == [
        BlockRemoved([2], medium="CPU"),
        BlockStored([3], 2, [5, 6], 2, medium="CPU"),
    ]


def test_a_pinned_key_keeps_its_slot_until_unpinned():
    pool = HostPool(1)
    pool.put(1, entry(None, [1, 2]))
    pool.pin(1)
    assert pool.put(2, entry(1, [3, 4])) is None  # every slot pinned: dropped
    assert 1 in pool and 2 not in pool
    pool.unpin_all()
    assert pool.put(2, entry(1, [3, 4])) == 0 and 1 not in pool


def test_lookup_does_not_touch():
    pool = HostPool(2)
    pool.put(1, entry(None, [1, 2]))
    pool.put(2, entry(1, [3, 4]))
    assert pool.lookup(1).slot == 0
    pool.put(3, entry(2, [5, 6]))
    assert 1 not in pool  # still the least recently used


def test_clear_forgets_everything_without_events():
    events = []
    pool = HostPool(2, events.append)
    pool.put(1, entry(None, [1, 2]))
    del events[:]
    pool.clear()
    assert len(pool) == 0 and events == []
    assert pool.put(2, entry(None, [1, 2])) == 0
