"""The persistent batch (input_batch.py) mirrors the KV cache manager's block tables through
growth, a draft's lookahead blocks being replaced, preemption, reuse of a request id and more
requests than rows; the step rows built over it give each token its own cache slot."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.engine.input_batch import InputBatch
from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import SchedulerOutput
from kvmesh.engine.step_rows import StepBuffers, build_step_rows

BS = 4


def make_request(rid: str, n: int) -> Request:
    return Request(
        rid, list(range(1, n + 1)), SamplingParams(max_tokens=10_000), set(), "m", BS, 100_000
    )


def assert_mirrors(batch: InputBatch, kv: KVCacheManager, req: Request, r: int) -> None:
    table = kv.block_table(req.request_id)
    assert batch.tables[r, : len(table)].tolist() == table


def test_rows_follow_the_kv_manager_through_growth_lookahead_preemption_and_reuse():
    rng = random.Random(0)
    kv = KVCacheManager(4096, BS, enable_caching=False)
    batch = InputBatch(
        BS, max_rows=4, max_blocks=2
    )  # small: rows and width must grow, rows be reclaimed
    live: dict[str, Request] = {}
    serial = 0
    for _ in range(400):
        batch.begin_step()
        op = rng.random()
        if op < 0.15 or not live:  # a new request, sometimes under an id that ended before
            rid = f"r{rng.randrange(12)}"
            if rid in live:
                kv.free(live[rid])
            serial += 1
            live[rid] = req = make_request(rid, rng.randrange(1, 20))
            assert kv.allocate_slots(req, req.num_tokens) is not None
            req.num_computed_tokens = req.num_tokens
        elif op < 0.25:  # preempted: freed, later allocated again from scratch
            req = live[rng.choice(sorted(live))]
            kv.free(req)
            req.num_computed_tokens = 0
            assert kv.allocate_slots(req, req.num_tokens) is not None
            req.num_computed_tokens = req.num_tokens
        step = rng.sample(sorted(live), min(len(live), rng.randrange(1, 7)))
        for rid in step:
            req = live[rid]
            num_drafts = rng.choice([0, 0, 3, 6])
            assert kv.allocate_slots(req, 1 + num_drafts) is not None
            r = batch.row(req, kv.req_blocks[rid])
            assert_mirrors(batch, kv, req, r)
            if num_drafts:  # lookahead blocks, released after the step and replaced by others
                batch.trust_only(r, cdiv(req.num_tokens, BS))
                req.append_token(7)
                req.num_computed_tokens += 1
                kv.release_lookahead(req)
                kv.pool.allocate(1)  # the freed blocks go to someone else
            else:
                req.append_token(7)
                req.num_computed_tokens += 1
    assert len(batch._owner) > 4 and batch.tables.shape[1] > 2


def test_step_rows_slots_and_positions_over_mixed_prefill_and_decode():
    kv = KVCacheManager(256, BS, enable_caching=False)
    batch = InputBatch(BS, max_rows=2)
    reqs = [make_request(f"r{i}", n) for i, n in enumerate([9, 1, 14, 5])]
    out = SchedulerOutput()
    for req, (done, n) in zip(
        reqs, [(8, 1), (0, 1), (3, 11), (0, 3)]
    ):  # decode, decode, chunk, chunk
        assert kv.allocate_slots(req, done + n) is not None
        req.num_computed_tokens = done
        out.requests.append(req)
        out.num_scheduled_tokens[req.request_id] = n
    rows = build_step_rows(out, kv, BS, StepBuffers(), batch)
    expect_pos = [8, 0] + list(range(3, 14)) + [0, 1, 2]
    assert rows.positions.tolist() == expect_pos
    owners = [0, 1] + [2] * 11 + [3] * 3
    tables = [kv.block_table(r.request_id) for r in reqs]
    assert rows.slots.tolist() == [
        tables[o][p // BS] * BS + p % BS for o, p in zip(owners, expect_pos)
    ]
    assert rows.ids.tolist() == [reqs[o].all_token_ids[p] for o, p in zip(owners, expect_pos)]
    # the rows that sample: the two decodes and the chunk that ends its prompt
    assert rows.sample.indices.tolist() == [0, 1, 12]
    assert rows.sampling_requests == reqs[:3]
    view = rows.logits_tables(rows.sample)
    assert view[2].tolist() == tables[2][:4] and view[0].tolist()[:3] == tables[0][:3]
    assert np.all(view[1, 1:] == 0)  # zero past each row's context


class Block:
    """A KV block as the batch sees it: only its id."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


class Req:
    def __init__(self, rid: str) -> None:
        self.request_id = rid


def blocks(*ids: int) -> list[Block]:
    return [Block(i) for i in ids]


def test_exact_rows_through_growth_reclaim_readd_and_preemption():
    batch = InputBatch(BS, max_rows=2, max_blocks=2)
    a, b = Req("a"), Req("b")
    a_blocks, b_blocks = blocks(10, 11), blocks(20)
    batch.begin_step()
    assert batch.row(a, a_blocks) == 0 and batch.row(b, b_blocks) == 1
    assert batch.tables.tolist() == [[10, 11], [20, 0]]
    assert batch.num_blocks == [2, 1]

    batch.begin_step()  # a grows past the width: the array doubles, b's row is untouched
    a_blocks.append(Block(12))
    assert batch.row(a, a_blocks) == 0
    assert batch.tables.tolist() == [[10, 11, 12, 0], [20, 0, 0, 0]]
    assert batch.full_table(0).tolist() == [10, 11, 12]

    # a request id seen again with a new Request: its old row is freed and taken again
    batch.begin_step()
    a2 = Req("a")
    assert batch.row(a2, blocks(30)) == 0
    assert batch.full_table(0).tolist() == [30]
    assert batch.tables[0].tolist() == [30, 11, 12, 0]  # stale entries past num_blocks stay

    # a new request with every row held: rows not used in this step (b's) are reclaimed
    c = Req("c")
    assert batch.row(c, blocks(40, 41)) == 1
    assert batch.row_of == {"a": 0, "c": 1}
    assert batch.tables[1].tolist() == [40, 41, 0, 0]

    # every row used in this step: the rows double, the new ones handed out lowest first
    d = Req("d")
    assert batch.row(d, blocks(50)) == 2
    assert batch.tables.shape == (4, 4) and batch._free == [3]
    assert batch.row(Req("e"), blocks(60)) == 3

    # b comes back in a later step: all four rows are stale and reclaimed in row_of order, so
    # the last released (e's) is the one taken
    batch.begin_step()
    assert batch.row(Req("b"), blocks(70, 71, 72)) == 3
    assert batch.row_of == {"b": 3}
    assert batch._free == [0, 1, 2]
    assert batch.full_table(3).tolist() == [70, 71, 72]

    # preempted and resumed: same Request, a new block list; the row is rewritten from 0
    batch.begin_step()
    b2 = batch._owner[3]
    resumed = blocks(80)
    assert batch.row(b2, resumed) == 3
    assert batch.full_table(3).tolist() == [80]
    resumed.extend(blocks(81, 82, 83, 84))  # grows again past the width
    assert batch.row(b2, resumed) == 3
    assert batch.tables.shape == (4, 8)
    assert batch.full_table(3).tolist() == [80, 81, 82, 83, 84]


def test_trust_only_rereads_replaced_lookahead_entries():
    batch = InputBatch(BS, max_rows=1, max_blocks=4)
    a = Req("a")
    table = blocks(1, 2, 3)
    batch.begin_step()
    batch.row(a, table)
    batch.trust_only(0, 1)
    assert batch.num_blocks[0] == 1
    table[1:] = blocks(7, 8)  # the lookahead blocks went back to the pool, others came
    batch.begin_step()
    batch.row(a, table)
    assert batch.full_table(0).tolist() == [1, 7, 8]
    batch.trust_only(0, 5)  # never raises what is known
    assert batch.num_blocks[0] == 3


def test_table_view_covers_each_rows_context_and_zeroes_past_it():
    batch = InputBatch(BS, max_rows=4, max_blocks=4)
    batch.begin_step()
    r0 = batch.row(Req("a"), blocks(1, 2, 3))
    r1 = batch.row(Req("b"), blocks(4, 5))
    view = batch.table_view(np.array([r1, r0]), np.array([5, 9]))
    assert view.tolist() == [[4, 5, 0], [1, 2, 3]]
    assert batch.table_view(np.array([r0]), np.array([0])).tolist() == [[0]]
    assert batch.table_view(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).shape == (
        0,
        1,
    )
    # a token's slot: its block's id times the block size plus its offset in the block
    positions = np.arange(9)
    slots = view[1][positions // BS] * BS + positions % BS
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12]


class RowModel:
    """The row allocation the batch promises: a free stack handing out the lowest row first,
    stale rows (not used in this step) reclaimed in the order they were assigned when none is
    free, the rows doubled when none is stale."""

    def __init__(self, rows: int) -> None:
        self.free = list(range(rows - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        self.owner: dict[int, object] = {}
        self.last: dict[int, int] = {}
        self.rows = rows

    def row(self, req, step: int) -> int:
        r = self.row_of.get(req.request_id)
        if r is None or self.owner[r] is not req:
            if r is not None:
                del self.row_of[req.request_id]
                self.free.append(r)
            if not self.free:
                for rid, s in list(self.row_of.items()):
                    if self.last[s] < step:
                        del self.row_of[rid]
                        self.free.append(s)
            if not self.free:
                self.free = list(range(2 * self.rows - 1, self.rows - 1, -1))
                self.rows *= 2
            r = self.free.pop()
            self.row_of[req.request_id], self.owner[r] = r, req
        self.last[r] = step
        return r


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_rows_and_tables_match_a_reference_model(data):
    batch = InputBatch(BS, max_rows=2, max_blocks=2)
    model = RowModel(2)
    reqs: dict[str, Req] = {}
    tables: dict[str, list[Block]] = {}
    next_id = iter(range(1, 10_000))
    for step in range(1, data.draw(st.integers(1, 12)) + 1):
        batch.begin_step()
        ids = data.draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4, unique=True))
        rows, lens, seen = [], [], []
        for rid in ids:
            op = data.draw(st.sampled_from(["grow", "same", "new", "preempt", "lookahead"]))
            if rid not in reqs or op == "new":  # (re)added under its id: a new Request
                reqs[rid], tables[rid] = Req(rid), []
            elif op == "preempt":  # freed and allocated again: a new block list
                tables[rid] = []
            grow = data.draw(st.integers(0 if tables[rid] else 1, 5))
            tables[rid].extend(Block(next(next_id)) for _ in range(grow))
            r = batch.row(reqs[rid], tables[rid])
            assert r == model.row(reqs[rid], step)
            seen.append([b.block_id for b in tables[rid]])
            assert batch.full_table(r).tolist() == seen[-1]
            if op == "lookahead":  # the last block may be replaced before the next step
                batch.trust_only(r, len(tables[rid]) - 1)
                tables[rid][-1] = Block(next(next_id))
            rows.append(r)
            lens.append(data.draw(st.integers(0, len(tables[rid]) * BS)))
        assert len(set(rows)) == len(rows)
        assert batch.row_of == model.row_of
        view = batch.table_view(np.array(rows), np.array(lens))
        width = max(1, max(-(-n // BS) for n in lens))
        for line, ref, n in zip(view.tolist(), seen, lens):
            used = -(-n // BS)
            assert line == ref[:used] + [0] * (width - used)
