"""The sidecar's index writer in isolation: events -> BlockIndex -> the Redis block set.

Fast unit tests (no engine, no threads; a real redis-server): what ``make mutation`` runs
against sidecar/index_writer.py (see docs/mutation.md)."""

from __future__ import annotations

import logging

import pytest
import redis

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex, root_key
from kvmesh.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Delivery,
    EventBatch,
)
from kvmesh.common.ports import free_port
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.index_writer import (
    GPU_MEDIA,
    BlockIndex,
    IndexWriter,
    _hashable,
    validate_kvmesh_batch,
)
from kvmesh.sidecar.subscriber import EventsLoop

BS = 4


def cfg(model="m", fmt="kvmesh", redis_url="redis://127.0.0.1:1/0", **kw) -> SidecarConfig:
    return SidecarConfig(
        pod_name="pod-a",
        pod_url="http://127.0.0.1:1",
        model=model,
        redis_url=redis_url,
        block_size=BS,
        engine_format=fmt,
        **kw,
    )


def stored(index: BlockIndex, ev: BlockStored) -> tuple[set[int], set[int]]:
    added, removed = set(), set()
    index.stored(ev, added, removed)
    return added, removed


def batch(*events, seq=0) -> Delivery:
    return Delivery(seq=seq, batch=EventBatch(ts=1.0, events=list(events)))


# -- BlockIndex, kvmesh format (hashes are the contract keys) ---------------------------------


def test_kvmesh_format_stores_and_removes_exactly_the_hashes():
    index = BlockIndex(cfg())
    added, removed = stored(index, BlockStored([11, 12, 13], None, list(range(12)), BS))
    assert added == {11, 12, 13} and removed == set()
    assert sorted(index.keys()) == [11, 12, 13] and index.by_hash == {11: 11, 12: 12, 13: 13}
    added, removed = set(), set()
    index.removed(
        BlockRemoved([99, 12]), added, removed
    )  # 99 was never stored: skipped, not the end
    assert removed == {12} and added == set()
    assert sorted(index.keys()) == [11, 13] and 12 not in index.by_hash and 12 not in index.refs


def test_a_hash_stored_twice_is_counted_once():
    index = BlockIndex(cfg())
    stored(index, BlockStored([5], None, [0] * BS, BS))
    added, _ = stored(index, BlockStored([5, 6], 5, [0] * 2 * BS, BS))
    assert added == {6}  # 5 is not new
    assert index.refs[5] == 1
    removed = set()
    index.removed(BlockRemoved([5]), set(), removed)
    assert removed == {5} and index.keys() == [6]


def test_store_then_remove_in_one_apply_nets_out_and_vice_versa():
    index = BlockIndex(cfg())
    added, removed = set(), set()
    index.stored(BlockStored([1, 2], None, [0] * 2 * BS, BS), added, removed)
    index.removed(BlockRemoved([2]), added, removed)
    assert added == {1} and removed == {2}
    index.stored(BlockStored([2], 1, [0] * BS, BS), added, removed)  # back again
    assert added == {1, 2} and removed == set()


@pytest.mark.parametrize("medium", GPU_MEDIA)
def test_every_gpu_medium_name_is_indexed(medium):
    index = BlockIndex(cfg())
    added, _ = stored(index, BlockStored([7], None, [0] * BS, BS, medium=medium))
    assert added == {7}
    removed = set()
    index.removed(BlockRemoved([7], medium=medium), set(), removed)
    assert removed == {7} and index.keys() == []


@pytest.mark.parametrize("medium", ["CPU", "cpu", "disk", ""])
def test_blocks_on_another_medium_are_not_indexed_or_removed(medium):
    index = BlockIndex(cfg())
    added, _ = stored(index, BlockStored([7], None, [0] * BS, BS, medium=medium))
    assert added == set() and index.keys() == []
    stored(index, BlockStored([8], None, [0] * BS, BS, medium="GPU"))
    removed = set()
    index.removed(
        BlockRemoved([8], medium=medium), set(), removed
    )  # the CPU copy went, not the GPU one
    assert removed == set() and index.keys() == [8]


def test_clear_forgets_everything():
    index = BlockIndex(cfg())
    stored(index, BlockStored([1, 2], None, [0] * 2 * BS, BS))
    index.clear()
    assert index.keys() == [] and not index.by_hash and not index.refs
    added, _ = stored(index, BlockStored([1], None, [0] * BS, BS))
    assert added == {1}


# -- BlockIndex, vLLM format (opaque hashes; keys recomputed from the token ids) --------------


def test_vllm_format_chains_from_the_root_then_from_the_parent():
    index = BlockIndex(cfg(fmt="vllm"))
    tokens = list(range(100, 100 + 3 * BS))
    keys = block_keys(tokens, "m", BS)
    added, _ = stored(index, BlockStored([b"h0", b"h1"], None, tokens[: 2 * BS], BS))
    assert added == set(keys[:2]) and index.by_hash == {b"h0": keys[0], b"h1": keys[1]}
    added, _ = stored(index, BlockStored([b"h2"], b"h1", tokens[2 * BS :], BS))
    assert added == {keys[2]} and index.by_hash[b"h2"] == keys[2]
    # Removal goes through the hash -> key map.
    removed = set()
    index.removed(BlockRemoved([b"h1"]), set(), removed)
    assert removed == {keys[1]}


def test_vllm_format_uses_the_model_root_and_the_events_block_size():
    index = BlockIndex(cfg(model="other-model", fmt="vllm"))
    tokens = list(range(2 * 8))
    added, _ = stored(
        index, BlockStored([b"a", b"b"], None, tokens, 8)
    )  # engine blocks of 8, not BS
    assert added == set(block_keys(tokens, "other-model", 8))
    assert index._root == root_key("other-model")


def test_vllm_format_skips_a_chain_whose_parent_is_unknown(caplog):
    index = BlockIndex(cfg(fmt="vllm"))
    with caplog.at_level(logging.DEBUG, logger="kvmesh.sidecar"):
        added, _ = stored(index, BlockStored([b"x", b"y"], b"never-seen", [1] * 2 * BS, BS))
    assert added == set() and index.keys() == [] and not index.by_hash
    assert [r.getMessage() for r in caplog.records] == [
        "BlockStored with unknown parent; 2 blocks not indexed"
    ]


def test_vllm_format_bytearray_and_memoryview_hashes_are_the_same_block():
    index = BlockIndex(cfg(fmt="vllm"))
    stored(index, BlockStored([bytearray(b"h0")], None, [1] * BS, BS))
    added, _ = stored(index, BlockStored([b"h1"], memoryview(b"h0"), [2] * BS, BS))
    assert len(added) == 1 and set(index.by_hash) == {b"h0", b"h1"}
    removed = set()
    index.removed(BlockRemoved([memoryview(b"h1"), bytearray(b"h0")]), set(), removed)
    assert len(removed) == 2 and index.keys() == []


def test_vllm_format_two_hashes_with_one_key_keep_it_until_both_are_gone():
    index = BlockIndex(cfg(fmt="vllm"))
    tokens = [3] * BS
    (key,) = block_keys(tokens, "m", BS)
    added, _ = stored(index, BlockStored([b"first"], None, tokens, BS))
    assert added == {key}
    added, _ = stored(index, BlockStored([b"second"], None, tokens, BS))  # same content, other hash
    assert added == set() and index.refs[key] == 2
    removed = set()
    index.removed(BlockRemoved([b"first"]), set(), removed)
    assert removed == set() and index.keys() == [key] and index.refs[key] == 1
    index.removed(BlockRemoved([b"second"]), set(), removed)
    assert removed == {key} and index.keys() == [] and key not in index.refs


def test_vllm_format_warns_once_about_a_block_size_mismatch(caplog):
    index = BlockIndex(cfg(fmt="vllm"))
    with caplog.at_level(logging.WARNING, logger="kvmesh.sidecar"):
        stored(index, BlockStored([b"a"], None, [1] * 8, 8))
        stored(index, BlockStored([b"b"], b"a", [1] * 8, 8))
        stored(index, BlockStored([b"c"], b"b", [1] * BS, BS))  # matching size: no warning
    warnings = [r for r in caplog.records if "block size" in r.getMessage()]
    assert len(warnings) == 1
    assert (
        warnings[0].getMessage()
        == "engine block size 8 != --block-size 4: keys will not match the router's"
    )


def test_kvmesh_format_never_warns_about_block_size(caplog):
    index = BlockIndex(cfg())
    with caplog.at_level(logging.WARNING, logger="kvmesh.sidecar"):
        stored(index, BlockStored([1], None, [1] * 8, 8))
    assert not caplog.records


def test_hashable():
    assert _hashable(bytearray(b"ab")) == b"ab" and type(_hashable(bytearray(b"ab"))) is bytes
    assert type(_hashable(memoryview(b"ab"))) is bytes and _hashable(memoryview(b"ab")) == b"ab"
    assert _hashable(5) == 5 and _hashable(b"x") == b"x"


# -- validation of --engine-format kvmesh batches ------------------------------------------


@pytest.mark.parametrize("h", [0, 1, 2**64 - 1])
def test_uint64_hashes_are_valid(h):
    validate_kvmesh_batch(
        EventBatch(1.0, [BlockStored([h], h, [0] * BS, BS), BlockRemoved([h]), AllBlocksCleared()])
    )


@pytest.mark.parametrize("h", [-1, 2**64, b"\x00" * 8, True, 1.0])
@pytest.mark.parametrize("where", ["stored", "parent", "removed"])
def test_a_hash_that_is_not_a_uint64_is_a_decode_error(h, where):
    ev = {
        "stored": BlockStored([1, h], None, [0] * 2 * BS, BS),
        "parent": BlockStored([1], h, [0] * BS, BS),
        "removed": BlockRemoved([2, h]),
    }[where]
    with pytest.raises(DecodeError) as exc:
        validate_kvmesh_batch(EventBatch(1.0, [AllBlocksCleared(), ev]))
    assert str(exc.value) == (
        f"block hash {h!r:.40} is not a uint64 contract key "
        "(an engine with its own hashes needs --engine-format vllm)"
    )


# -- IndexWriter.apply -----------------------------------------------------------------------


def test_apply_collects_adds_and_removes_across_batches():
    sc = IndexWriter(cfg())
    added, removed, full = sc.apply(
        [
            batch(BlockStored([1, 2, 3], None, [0] * 3 * BS, BS)),
            batch(BlockRemoved([3]), BlockStored([4], 2, [0] * BS, BS), seq=1),
        ]
    )
    assert (added, removed, full) == ({1, 2, 4}, {3}, False)
    added, removed, full = sc.apply([batch(BlockRemoved([1]))])
    assert (added, removed, full) == (set(), {1}, False)
    assert sorted(sc.index.keys()) == [2, 4]


def test_apply_a_reset_drops_the_index_and_asks_for_a_full_rewrite():
    sc = IndexWriter(cfg())
    sc.apply([batch(BlockStored([1, 2], None, [0] * 2 * BS, BS))])
    added, removed, full = sc.apply(
        [
            batch(BlockStored([3], 2, [0] * BS, BS), BlockRemoved([1])),
            Delivery(seq=None, reset="engine restarted"),
            batch(BlockStored([9], None, [0] * BS, BS), seq=0),
        ]
    )
    assert full is True and added == {9} and removed == set()
    assert sc.index.keys() == [9] and sc.stats["resets"] == 1
    sc.apply([Delivery(seq=None, reset="again"), Delivery(seq=None, reset="and again")])
    assert sc.stats["resets"] == 3 and sc.index.keys() == []


def test_apply_all_blocks_cleared_is_a_full_rewrite():
    sc = IndexWriter(cfg())
    sc.apply([batch(BlockStored([1, 2], None, [0] * 2 * BS, BS))])
    added, removed, full = sc.apply(
        [batch(BlockRemoved([1]), AllBlocksCleared(), BlockStored([5], None, [0] * BS, BS))]
    )
    assert full is True and added == {5} and removed == set()
    assert sc.index.keys() == [5] and sc.stats["clears"] == 1 and sc.stats["resets"] == 0
    sc.apply([batch(AllBlocksCleared(), AllBlocksCleared())])
    assert sc.stats["clears"] == 3


def test_apply_nothing():
    sc = IndexWriter(cfg())
    assert sc.apply([]) == (set(), set(), False)


# -- writing the block set -------------------------------------------------------------------


@pytest.fixture
def writer(redis_server, model_name):
    w = IndexWriter(cfg(model=model_name, redis_url=redis_server.url))
    yield w
    w.close()


def test_incremental_write_adds_and_removes_key_hex_members(writer, redis_server):
    r = redis_server.client()
    r.sadd(writer.blocks_key, key_hex(1), key_hex(2))
    writer.dirty = False
    writer.incremental({3, 2**64 - 1}, {1})
    assert r.smembers(writer.blocks_key) == {key_hex(2), key_hex(3), "ffffffffffffffff"}
    assert writer.stats["incremental_writes"] == 1 and not writer.dirty
    writer.incremental(set(), {2, 3})  # only removals
    writer.incremental({7}, set())  # only additions
    assert r.smembers(writer.blocks_key) == {key_hex(7), "ffffffffffffffff"}
    assert writer.stats["incremental_writes"] == 3
    assert writer.blocks_key == rl.blocks_key(writer.cfg.model, "pod-a")


def test_full_rewrite_replaces_the_set_with_the_index(writer, redis_server, caplog):
    r = redis_server.client()
    r.sadd(writer.blocks_key, key_hex(100), key_hex(1))  # a previous incarnation's set
    writer.apply([batch(BlockStored([1, 2, 3], None, [0] * 3 * BS, BS))])
    writer.backoff = 3.0
    writer.withdrawn = True
    writer.full_rewrite()
    assert r.smembers(writer.blocks_key) == {key_hex(1), key_hex(2), key_hex(3)}
    assert not r.exists(writer.blocks_key + ":tmp")
    assert writer.stats["full_rewrites"] == 1 and writer.dirty is False
    assert writer.backoff == 0.1 and writer.withdrawn is False
    assert not [
        rec for rec in caplog.records if "rewrote" in rec.getMessage()
    ]  # the first write is quiet
    writer.apply([batch(BlockRemoved([3]))])
    with caplog.at_level(logging.INFO, logger="kvmesh.sidecar"):
        writer.full_rewrite()  # a later rewrite is logged
    assert [rec.getMessage() for rec in caplog.records] == ["rewrote 2 block keys to Redis"]
    assert writer.stats["full_rewrites"] == 2 and r.smembers(writer.blocks_key) == {
        key_hex(1),
        key_hex(2),
    }


class _Feed:
    """A subscriber stand-in: hands out queued deliveries, advancing next_seq on poll as the real one does."""

    def __init__(self):
        self.queue: list[Delivery] = []
        self.next_seq: int | None = None

    def poll(self, timeout_ms: int) -> list[Delivery]:
        out, self.queue = self.queue, []
        for d in out:
            if d.seq is not None:
                self.next_seq = d.seq + 1
        return out


def test_indexed_seq_moves_only_once_the_batch_is_in_redis(writer, redis_server):
    """indexed_seq says which events Redis holds (what a reader may wait for); the subscriber's
    next_seq moves at poll, before the write."""
    r = redis_server.client()
    loop = EventsLoop(writer.cfg, writer, writer.stats)
    feed = loop.subscriber = _Feed()
    assert writer.indexed_seq is None  # dirty until the first rewrite
    feed.queue = [batch(BlockStored([1, 2], None, [0] * 2 * BS, BS), seq=0)]
    loop.iteration()  # the first write is the full rewrite
    assert writer.indexed_seq == 1 and r.smembers(writer.blocks_key) == {key_hex(1), key_hex(2)}
    feed.queue = [batch(BlockStored([3], 2, [0] * BS, BS), seq=1)]
    writer.redis = redis.Redis.from_url(
        f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2
    )
    loop.iteration()  # the write fails: the batch was polled but is not in Redis
    assert feed.next_seq == 2 and writer.indexed_seq is None
    writer.redis = redis_server.client()
    writer.retry_at = 0.0
    loop.iteration()  # nothing new: the rewrite catches up
    assert writer.indexed_seq == 2 and r.smembers(writer.blocks_key) == {
        key_hex(k) for k in (1, 2, 3)
    }
    writer.dirty = True  # e.g. the heartbeat found the set lost
    assert writer.indexed_seq is None


def test_full_rewrite_of_an_empty_index_deletes_the_set(writer, redis_server):
    r = redis_server.client()
    r.sadd(writer.blocks_key, key_hex(100))
    r.sadd(writer.blocks_key + ":tmp", key_hex(5))  # left over by a crash mid-rewrite
    writer.full_rewrite()
    assert not r.exists(writer.blocks_key) and not r.exists(writer.blocks_key + ":tmp")
    assert writer.dirty is False and writer.stats["full_rewrites"] == 1


def test_full_rewrite_of_a_large_index_writes_every_key(writer, redis_server):
    r = redis_server.client()
    n = 25_003  # more than two SADD chunks
    writer.index.refs.update(range(1, n + 1))
    writer.full_rewrite()
    assert r.scard(writer.blocks_key) == n
    assert r.sismember(writer.blocks_key, key_hex(1)) and r.sismember(writer.blocks_key, key_hex(n))
    assert r.sismember(writer.blocks_key, key_hex(10_000)) and r.sismember(
        writer.blocks_key, key_hex(10_001)
    )


def test_redis_down_marks_the_set_dirty_and_backs_off(model_name, caplog):
    sc = IndexWriter(
        cfg(model=model_name, redis_url=f"redis://127.0.0.1:{free_port()}/0", max_backoff=0.35)
    )
    try:
        sc.dirty = False
        with caplog.at_level(logging.WARNING, logger="kvmesh.sidecar"):
            sc.incremental({1}, set())
        (rec,) = caplog.records
        assert (
            rec.getMessage().startswith("Redis write failed (Error ")
            and "keeping state in memory" in rec.getMessage()
        )
        assert sc.dirty and sc.stats["redis_errors"] == 1 and sc.stats["incremental_writes"] == 0
        assert sc.backoff == pytest.approx(0.2)
        sc.index.refs.update([1])
        sc.full_rewrite()
        assert sc.dirty and sc.stats["redis_errors"] == 2 and sc.stats["full_rewrites"] == 0
        assert sc.backoff == pytest.approx(0.35)  # doubled, capped at max_backoff
        caplog.clear()
        sc.dirty = False
        with caplog.at_level(logging.WARNING, logger="kvmesh.sidecar"):
            sc.full_rewrite()
        assert [r.getMessage()[:26] for r in caplog.records] == ["Redis write failed (Error "]
        assert isinstance(sc.redis, redis.Redis)
    finally:
        sc.close()


def test_the_first_rewrite_after_a_redis_error_is_logged(writer, redis_server, caplog):
    writer.stats["redis_errors"] = 1
    writer.index.refs.update([4])
    with caplog.at_level(logging.INFO, logger="kvmesh.sidecar"):
        writer.full_rewrite()
    assert [rec.getMessage() for rec in caplog.records] == ["rewrote 1 block keys to Redis"]
    assert redis_server.client().smembers(writer.blocks_key) == {key_hex(4)}
