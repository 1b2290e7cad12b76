"""Block pool and KV-cache manager: the edges mutation testing found unpinned (docs/mutation.md).

The state machine in test_block_pool.py checks the books balance; these pin the exact
behaviour around them: the errors, the event chains when content is computed twice, the
order of the free list, what a failed step's uncache does, and the manager's arithmetic."""

from __future__ import annotations

import pytest

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], **sp) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1000, **sp), set(), "m", BS, 10_000)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# -- FreeBlockQueue and KVBlock ---------------------------------------------------------------


def test_free_queue_order_counts_and_errors():
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2] and q.num_free == 3
    q.remove(blocks[1])
    assert blocks[1].prev_free is None and blocks[1].next_free is None
    with pytest.raises(
        RuntimeError, match=r"KVBlock\(id=1, ref=0, key=None\) is not in the free queue"
    ):
        q.remove(blocks[1])
    q.append(blocks[1])
    assert [b.block_id for b in q] == [0, 2, 1] and q.num_free == 3
    assert [q.popleft().block_id for _ in range(3)] == [0, 2, 1] and q.num_free == 0
    assert list(q) == []
    with pytest.raises(RuntimeError, match="^no free KV blocks$"):
        q.popleft()
    with pytest.raises(
        RuntimeError, match=r"^KVBlock\(id=9, ref=0, key=None\) is not in the free queue$"
    ):
        q.remove(KVBlock(9))  # a block never queued
    q.appendleft(blocks[2])
    q.appendleft(blocks[0])
    assert [b.block_id for b in q] == [0, 2] and q.num_free == 2


def test_block_repr():
    b = KVBlock(7)
    b.ref_cnt, b.key = 2, 99
    assert repr(b) == "KVBlock(id=7, ref=2, key=99)"


# -- BlockPool -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -3])
def test_a_pool_needs_a_block(n):
    with pytest.raises(ValueError, match="^the KV cache needs at least one block$"):
        BlockPool(n)


def test_a_one_block_pool_works_and_events_are_off_by_default():
    pool = BlockPool(1)
    assert pool.enable_events is False and [b.block_id for b in pool.blocks] == [0]
    (b,) = pool.allocate(1)
    assert b.ref_cnt == 1 and pool.num_free_blocks == 0 and pool.usage == 1.0
    pool.cache_blocks([b], [42], None, [1, 2, 3, 4], BS)
    pool.free([b])
    assert pool.allocate(1) == [b] and b.key is None  # evicted on reuse
    assert pool.reset_prefix_cache() is False
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [] and pool.events == []  # no events unless enabled


def test_allocate_takes_exactly_what_is_free_and_names_the_shortfall():
    pool = BlockPool(4)
    got = pool.allocate(4)
    assert [b.block_id for b in got] == [0, 1, 2, 3] and all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    pool.free(got[:1])
    with pytest.raises(RuntimeError, match=r"^asked for 2 blocks, 1 free$"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # nothing taken by the refused call
    assert pool.allocate(0) == []
    assert pool.usage == 0.75


def test_free_drops_one_reference_and_refuses_a_double_free():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and b.block_id not in free_ids(pool)
    pool.free([b])
    assert b.ref_cnt == 0 and b.block_id in free_ids(pool)
    with pytest.raises(RuntimeError, match=r"^double free of KVBlock\(id=0, ref=0, key=None\)$"):
        pool.free([b])
    assert b.ref_cnt == 0 and free_ids(pool).count(0) == 1


def test_freed_blocks_without_content_go_to_the_head_cached_ones_to_the_tail():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_blocks([a, b], [10, 11], None, list(range(8)), BS)
    pool.free([a, c, b, d])
    # c and d hold nothing: first to be reused (d freed last, so in front); a then b kept in LRU order.
    assert free_ids(pool) == [3, 2, 0, 1]


def test_touch_takes_a_free_cached_block_off_the_free_list():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_blocks([a], [5], None, [0] * BS, BS)
    pool.free([a, b])
    assert pool.lookup(5) is a and pool.lookup(6) is None
    pool.touch([a])
    assert a.ref_cnt == 1 and 0 not in free_ids(pool) and pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 2


def test_eviction_emits_the_key_and_forgets_it():
    pool = BlockPool(2, enable_events=True)
    a, b = pool.allocate(2)
    pool.cache_blocks([a, b], [1, 2], None, list(range(8)), BS)
    assert (a.parent_key, b.parent_key) == (None, 1)
    pool.free([b, a])
    pool.take_events()
    pool.allocate(2)
    assert pool.take_events() == [BlockRemoved([2]), BlockRemoved([1])]
    assert a.key is None and a.parent_key is None and b.key is None and b.parent_key is None
    assert pool.cached == {}


def test_cache_blocks_emits_one_chained_event_per_run():
    pool = BlockPool(8, enable_events=True)
    pool.cache_blocks(pool.allocate(1), [9], None, [0] * BS, BS)
    pool.take_events()
    blocks = pool.allocate(3)
    tokens = list(range(100, 112))
    pool.cache_blocks(blocks, [1, 2, 3], 9, tokens, BS)
    assert pool.take_events() == [BlockStored([1, 2, 3], 9, tokens, BS, medium="GPU")]
    assert [b.parent_key for b in blocks] == [9, 1, 2] and [b.key for b in blocks] == [1, 2, 3]


def test_content_computed_twice_splits_the_event_chain_at_the_duplicate():
    pool = BlockPool(8, enable_events=True)
    (first,) = pool.allocate(1)
    pool.cache_blocks([first], [11], None, [0] * BS, BS)
    pool.take_events()
    blocks = pool.allocate(4)
    tokens = list(range(200, 216))
    # Keys 10 and 12/13 are new, 11 is already held by `first`.
    pool.cache_blocks(blocks, [10, 11, 12, 13], None, tokens, BS)
    assert pool.take_events() == [
        BlockStored([10], None, tokens[0:4], BS, medium="GPU"),
        BlockStored([12, 13], 11, tokens[8:16], BS, medium="GPU"),
    ]
    assert blocks[1].key is None and pool.lookup(11) is first  # the first copy is kept
    assert [b.parent_key for b in blocks] == [None, None, 11, 12]


def test_a_duplicate_first_block_starts_the_chain_from_it_and_a_trailing_one_ends_it():
    pool = BlockPool(8, enable_events=True)
    held = pool.allocate(2)
    pool.cache_blocks(held, [1, 3], None, [0] * 8, BS)
    pool.take_events()
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [1, 2, 3], None, list(range(12)), BS)
    assert pool.take_events() == [BlockStored([2], 1, [4, 5, 6, 7], BS, medium="GPU")]
    pool.cache_blocks(
        pool.allocate(2), [1, 3], None, list(range(8)), BS
    )  # all duplicates: no event
    assert pool.take_events() == []


def test_blocks_whose_parent_left_the_cache_wait_for_a_cached_key():
    pool = BlockPool(8, enable_events=True)
    (held,) = pool.allocate(1)
    pool.cache_blocks([held], [7], None, [0] * BS, BS)
    pool.take_events()
    blocks = pool.allocate(4)
    tokens = list(range(300, 316))
    pool.cache_blocks(blocks, [5, 6, 7, 8], 99, tokens, BS)  # parent 99 is not cached
    assert pool.take_events() == [BlockStored([8], 7, tokens[12:16], BS, medium="GPU")]
    assert [b.key for b in blocks] == [None, None, None, 8] and blocks[3].parent_key == 7
    assert pool.lookup(5) is None and pool.lookup(6) is None


def test_caching_an_already_cached_block_is_refused():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_blocks([b], [5], None, [0] * BS, BS)
    with pytest.raises(RuntimeError, match=r"^KVBlock\(id=0, ref=1, key=5\) is already cached$"):
        pool.cache_blocks([b], [6], None, [0] * BS, BS)


def test_uncache_forgets_only_the_blocks_own_entries():
    pool = BlockPool(4, enable_events=True)
    a, b, c = pool.allocate(3)
    pool.cache_blocks([a, b], [1, 2], None, list(range(8)), BS)
    pool.cache_blocks([c], [2], 1, [0] * BS, BS)  # c computed key 2 again: not stored
    pool.take_events()
    pool.uncache([c])  # c holds no key: nothing happens
    assert pool.take_events() == [] and pool.lookup(2) is b
    c.key = 1  # a stale key that now belongs to another block: must not evict a
    pool.uncache([c])
    assert pool.lookup(1) is a and pool.take_events() == []
    c.key = None
    pool.uncache([b, a])
    assert pool.take_events() == [BlockRemoved([2]), BlockRemoved([1])]
    assert pool.cached == {} and a.key is None and b.key is None and a.parent_key is None
    pool.free([a, b, c])
    assert pool.num_free_blocks == 4


def test_reset_prefix_cache_forgets_every_key():
    pool = BlockPool(2, enable_events=True)
    a, b = pool.allocate(2)
    pool.cache_blocks([a, b], [1, 2], None, list(range(8)), BS)
    pool.free([a, b])
    assert pool.lookup(2) is b
    assert pool.reset_prefix_cache() is True
    assert all(blk.key is None and blk.parent_key is None for blk in pool.blocks)
    assert pool.lookup(1) is None and pool.take_events()[-1] == AllBlocksCleared()
    assert pool.take_events() == []


# -- KVCacheManager --------------------------------------------------------------------------


def test_cdiv():
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_manager_defaults_and_block_table():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    assert (
        kv.enable_caching is True and kv.num_blocks == 6 and kv.usage == 0.0 and kv.block_size == BS
    )
    assert kv.pool.enable_events is False
    r = make_request("a", list(range(9)))
    new = kv.allocate_slots(r, 9)
    assert [b.block_id for b in new] == [0, 1, 2] and kv.block_table("a") == [0, 1, 2]
    assert kv.usage == pytest.approx(0.5) and kv.block_table("nobody") == []
    assert kv.num_cached_blocks["a"] == 2  # two full blocks registered
    kv.free(r)
    assert kv.block_table("a") == [] and "a" not in kv.num_cached_blocks and kv.usage == 0.0
    kv.free(r)  # freeing twice is harmless
    assert kv.pool.num_free_blocks == 6


def test_allocate_slots_grows_one_block_at_a_time_and_refuses_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    r = make_request("a", list(range(4)))
    assert len(kv.allocate_slots(r, 4)) == 1
    r.num_computed_tokens = 4
    r.append_token(9)
    assert len(kv.allocate_slots(r, 1)) == 1  # token 5 needs a second block
    r.num_computed_tokens = 5
    r.append_token(9)
    assert kv.allocate_slots(r, 1) == []  # token 6 fits in block 2
    other = make_request("b", list(range(50, 59)))
    assert kv.allocate_slots(other, 9) is None  # needs 3 blocks, 1 free: nothing changes
    assert (
        kv.pool.num_free_blocks == 1
        and kv.block_table("b") == []
        and "b" not in kv.num_cached_blocks
    )
    assert (
        len(kv.allocate_slots(make_request("c", [1, 2, 3]), 3)) == 1
    )  # exactly the last free block


def test_a_hit_on_a_free_cached_block_counts_against_the_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)  # both blocks cached and free; 3 free in all
    b = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])  # 13 tokens: 2 hits + 2 new blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits) == 2
    assert kv.allocate_slots(b, 5, hits) is None  # 2 hits on free blocks + 2 new > 3 free
    c = make_request("c", list(range(8)) + [7])  # 2 hits + 1 new == 3 free
    hits, n = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, 1, hits)
    assert len(new) == 1 and kv.block_table("c") == [b.block_id for b in hits] + [new[0].block_id]
    assert kv.pool.num_free_blocks == 0 and all(b.ref_cnt == 1 for b in hits)
    assert kv.num_cached_blocks["c"] == 2


def test_prefix_hits_stop_at_the_first_miss_and_keep_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    hits, n = kv.get_computed_blocks(
        make_request("b", list(range(4)) + [99] * 4 + list(range(8, 13)))
    )
    assert n == 4 and len(hits) == 1  # the second block differs: later equal blocks are not hits
    hits, n = kv.get_computed_blocks(make_request("c", list(range(13))))
    assert n == 12 and [h.block_id for h in hits] == [0, 1, 2]
    hits, n = kv.get_computed_blocks(make_request("d", list(range(12))))
    assert n == 8  # 12 tokens: the last one is computed, so block 3 cannot be a hit
    assert kv.prefix_queries == 13 + 13 + 12 and kv.prefix_hits == 4 + 12 + 8


def test_no_prefix_hits_with_caching_off_or_prompt_logprobs():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    assert kv.pool.cached == {} and kv.get_computed_blocks(make_request("b", list(range(13)))) == (
        [],
        0,
    )
    assert kv.prefix_queries == 0  # no lookup was made, so none is counted
    kv2 = KVCacheManager(num_blocks=8, block_size=BS)
    kv2.allocate_slots(make_request("a", list(range(12))), 12)
    assert kv2.get_computed_blocks(make_request("b", list(range(13)), prompt_logprobs=1)) == ([], 0)
    assert kv2.get_computed_blocks(make_request("b", list(range(13)), prompt_logprobs=0)) == ([], 0)
    assert kv2.prefix_queries == 0


def test_chunks_register_their_full_blocks_chained_from_the_previous_chunk():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_events=True)
    r = make_request("a", list(range(100, 111)))  # 11 tokens: 2 full blocks
    keys = r.block_keys(2)
    kv.allocate_slots(r, 3)  # first chunk: no full block yet
    assert kv.take_events() == [] and kv.num_cached_blocks["a"] == 0
    r.num_computed_tokens = 3
    kv.allocate_slots(r, 3)  # tokens 3..5: block 0 is full
    assert kv.take_events() == [
        BlockStored([keys[0]], None, list(range(100, 104)), BS, medium="GPU")
    ]
    r.num_computed_tokens = 6
    kv.allocate_slots(r, 5)  # the rest: block 1 is full, chained from block 0
    assert kv.take_events() == [
        BlockStored([keys[1]], keys[0], list(range(104, 108)), BS, medium="GPU")
    ]
    assert kv.num_cached_blocks["a"] == 2


def test_a_prefix_hit_registers_only_the_new_blocks_chained_from_the_hit():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_events=True)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.take_events()
    b = make_request("b", list(range(13)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    kv.allocate_slots(b, 5, hits)
    keys = b.block_keys(3)
    assert kv.take_events() == [
        BlockStored([keys[2]], keys[1], list(range(8, 12)), BS, medium="GPU")
    ]
    assert kv.num_cached_blocks["b"] == 3


def test_scheduled_tokens_beyond_the_request_register_nothing_more():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_events=True)
    r = make_request("a", list(range(6)))
    kv.allocate_slots(
        r, 10
    )  # more slots than tokens (lookahead): only block 0 is full of real tokens
    (ev,) = kv.take_events()
    assert ev.block_hashes == r.block_keys(1) and kv.num_cached_blocks["a"] == 1


def test_blocks_written_by_the_next_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request("a", list(range(10)))
    blocks = kv.allocate_slots(r, 10)
    assert kv.blocks_written(r, 10) == blocks
    r.num_computed_tokens = 4
    assert kv.blocks_written(r, 1) == blocks[1:2]
    assert kv.blocks_written(r, 5) == blocks[1:3]
    r.num_computed_tokens = 3
    assert kv.blocks_written(r, 2) == blocks[0:2]
    assert kv.blocks_written(make_request("x", [1]), 1) == []


def test_a_finished_requests_tail_is_evicted_before_its_head():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    r = make_request("a", list(range(12)))
    blocks = kv.allocate_slots(r, 12)
    kv.free(r)
    assert free_ids(kv.pool) == [b.block_id for b in reversed(blocks)]


def test_manager_reset_and_events_pass_through():
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_events=True)
    r = make_request("a", list(range(4)))
    kv.allocate_slots(r, 4)
    assert kv.reset_prefix_cache() is False
    kv.free(r)
    assert kv.reset_prefix_cache() is True
    events = kv.take_events()
    assert isinstance(events[0], BlockStored) and events[-1] == AllBlocksCleared()
    assert kv.take_events() == []
