"""Block pool and KV-cache manager: unit tests and a hypothesis state machine."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmesh.common.block_keys import block_keys
from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], max_model_len: int = 10_000) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1000), set(), "m", BS, max_model_len)


def test_free_queue_removes_from_the_middle_in_constant_time():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free == 4
    q.appendleft(blocks[2])
    assert q.popleft() is blocks[2]


def test_lru_evicts_least_recent_first_and_tail_blocks_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_events=True)
    a = make_request("a", list(range(100, 108)))  # 2 full blocks
    b = make_request("b", list(range(200, 208)))
    for r in (a, b):
        assert kv.allocate_slots(r, r.num_tokens) is not None
    a_keys, b_keys = a.block_keys(2), b.block_keys(2)
    kv.free(a)  # a finished first: least recently used
    kv.free(b)
    kv.take_events()
    c = make_request("c", list(range(300, 304)) * 4)  # needs 4 blocks: all 4 free cached blocks go
    assert kv.allocate_slots(c, 16) is not None
    # 4 plain free blocks are used first, then none of the cached ones.
    assert kv.pool.take_events() == [
        BlockStored(c.block_keys(4), None, c.all_token_ids, BS, medium="GPU")
    ]
    d = make_request(
        "d", list(range(400, 404)) * 2
    )  # 2 more blocks: evicts a's tail, then a's head
    assert kv.allocate_slots(d, 8) is not None
    removed = [e.block_hashes[0] for e in kv.pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [a_keys[1], a_keys[0]]
    hit_blocks, hit_tokens = kv.get_computed_blocks(make_request("b2", b.all_token_ids + [1]))
    assert hit_tokens == 8 and [blk.key for blk in hit_blocks] == b_keys


def test_a_request_gets_its_blocks_in_ascending_order_after_the_pool_wrapped():
    # A finished request's blocks are freed tail first (eviction order); the next request takes
    # the same blocks, and gets them back in ascending order, so the attention kernels read
    # each head's context forwards (what the hardware prefetchers follow best).
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(100, 124)))  # 6 full blocks: the whole pool, ids 0..5
    assert kv.allocate_slots(a, a.num_tokens) is not None
    assert kv.block_table("a") == [0, 1, 2, 3, 4, 5]
    kv.free(a)  # the free list is now 5, 4, 3, 2, 1, 0 (a's tail evicted first)
    b = make_request("b", list(range(200, 212)))  # 3 blocks: evicts a's tail
    assert kv.allocate_slots(b, b.num_tokens) is not None
    assert kv.block_table("b") == [3, 4, 5]
    c = make_request("c", list(range(300, 312)))
    assert kv.allocate_slots(c, c.num_tokens) is not None
    assert kv.block_table("c") == [0, 1, 2]


def test_a_decoding_request_grows_into_the_block_after_its_last_once_the_pool_has_wrapped():
    # After the wrap, the first block in eviction order is wherever an earlier request's blocks
    # were; a request that grows a block at a time takes the one after its last instead, while
    # that one was freed long enough ago, so its table stays one run of consecutive blocks.
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_events=True)
    done = [make_request(n, list(range(100 * i, 100 * i + 16))) for i, n in enumerate("abc", 1)]
    for r in done:  # 4 full blocks each: a 0-3, b 4-7, c 8-11
        assert kv.allocate_slots(r, r.num_tokens) is not None
    b_keys = done[1].block_keys(4)
    for r in done:  # free list: 3 2 1 0 7 6 5 4 11 10 9 8
        kv.free(r)
    kv.pool.take_events()
    r = make_request("r", list(range(900, 908)))  # 2 blocks: a's 2 and 3, in ascending order
    assert kv.allocate_slots(r, 8) is not None and kv.block_table("r") == [2, 3]
    for token in (1, 2):  # decoding into a new block, twice: b's first two blocks, not a's 1 and 0
        r.num_computed_tokens = r.num_tokens
        r.append_token(token)
        for _ in range(BS - 1):
            r.append_token(token)
        assert kv.allocate_slots(r, BS) is not None
    assert kv.block_table("r") == [2, 3, 4, 5]
    removed = [
        key for e in kv.pool.take_events() if isinstance(e, BlockRemoved) for key in e.block_hashes
    ]
    assert b_keys[0] in removed and b_keys[1] in removed


def test_a_recently_freed_block_keeps_its_turn_even_next_to_a_growing_request():
    def pool_with_block_3_freed(early: bool) -> BlockPool:
        pool = BlockPool(6)
        blocks = pool.allocate(6)
        pool.cache_blocks(blocks, list(range(1, 7)), None, list(range(6 * BS)), BS)
        order = [0, 3, 1, 4, 5] if early else [0, 1, 4, 5, 3]  # block 2 stays with its request
        pool.free([blocks[i] for i in order])
        return pool

    # Block 3 freed second: taken before its turn, after block 2. Freed last: among the half of
    # the blocks the allocation leaves free that was freed most recently, so the head (0) goes.
    assert [b.block_id for b in pool_with_block_3_freed(early=True).allocate(1, after=2)] == [3]
    assert [b.block_id for b in pool_with_block_3_freed(early=False).allocate(1, after=2)] == [0]


def test_cache_hit_caps_at_last_token_and_counts():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    blocks, n = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert n == 4  # the last token must be computed, so only the first block is a hit
    assert kv.prefix_queries == 8 and kv.prefix_hits == 4


def test_a_peek_at_the_cached_prefix_counts_what_a_lookup_would_and_changes_nothing():
    """The sjf order ranks by this peek every step: it must agree with the lookup and leave the
    hit counters (the prefix-cache hit rate users see) alone."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    full, partial = (
        make_request("b", list(range(9))),
        make_request("c", [0, 1, 2, 3, 9, 9, 9, 9, 9]),
    )
    assert [kv.peek_cached_tokens(r) for r in (full, partial)] == [8, 4]
    assert kv.prefix_queries == 0 and kv.prefix_hits == 0
    assert kv.get_computed_blocks(full)[1] == 8 and kv.get_computed_blocks(partial)[1] == 4
    logprobs = make_request("d", list(range(9)))
    logprobs.sampling_params.prompt_logprobs = 1
    assert kv.peek_cached_tokens(logprobs) == 0


def test_reset_prefix_cache_emits_all_cleared_only_when_idle():
    pool = BlockPool(4, enable_events=True)
    blocks = pool.allocate(1)
    assert not pool.reset_prefix_cache()
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]


def test_keys_match_the_shared_contract_function():
    req = make_request("a", list(range(13)))
    assert req.block_keys(3) == block_keys(list(range(13)), "m", BS)


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions, growth, frees and evictions never break the pool's books."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BS, enable_events=True)
        self.active: dict[str, Request] = {}
        self.n = 0
        self.stored: set[int] = set()  # keys currently advertised via events

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, tokens):
        rid = f"r{self.n}"
        self.n += 1
        req = make_request(rid, tokens)
        blocks, num_computed = self.kv.get_computed_blocks(req)
        assert num_computed % BS == 0 and num_computed < req.num_tokens
        if self.kv.allocate_slots(req, req.num_tokens - num_computed, blocks) is not None:
            req.num_computed_tokens = req.num_tokens
            self.active[rid] = req

    @precondition(lambda self: self.active)
    @rule(data=st.data(), token=st.integers(0, 2))
    def grow(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.active)))
        req = self.active[rid]
        req.append_token(token)
        if self.kv.allocate_slots(req, 1) is not None:
            req.num_computed_tokens += 1
        else:
            req.all_token_ids.pop()

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.active)))
        self.kv.free(self.active.pop(rid))

    @invariant()
    def books_balance(self):
        pool = self.kv.pool
        holders: dict[int, int] = {}
        for rid, req in self.active.items():
            table = self.kv.req_blocks[rid]
            assert len({b.block_id for b in table}) == len(table), "a block twice in one table"
            assert len(table) * BS >= req.num_computed_tokens
            for b in table:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        free_ids = {b.block_id for b in pool.free_queue}
        assert len(free_ids) == pool.free_queue.num_free
        for b in pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), f"ref count of {b}"
            assert (b.ref_cnt == 0) == (b.block_id in free_ids), f"free-list membership of {b}"
        for key, b in pool.cached.items():
            assert b.key == key
        assert set(self.kv.req_blocks) == set(self.active)

    @invariant()
    def events_mirror_the_cache(self):
        for event in self.kv.take_events():
            if isinstance(event, BlockStored):
                assert not (set(event.block_hashes) & self.stored), "stored twice without removal"
                self.stored |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.stored
                self.stored -= set(event.block_hashes)
        assert self.stored == set(self.kv.pool.cached)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
