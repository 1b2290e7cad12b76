"""The persistent batch (input_batch.py) mirrors the KV cache manager's block tables through
growth, a draft's lookahead blocks being replaced, preemption, reuse of a request id and more
requests than rows; the step rows built over it give each token its own cache slot."""

from __future__ import annotations

import random

import numpy as np

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
