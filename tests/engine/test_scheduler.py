"""Scheduler invariants under random load, with a fake model (no torch compute)."""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler

BS = 4
NUM_BLOCKS = 16
MAX_LEN = NUM_BLOCKS * BS


def new_scheduler(budget=16, max_seqs=4, chunked=True, caching=True):
    kv = KVCacheManager(NUM_BLOCKS, BS, enable_caching=caching)
    return Scheduler(kv, budget, max_seqs, MAX_LEN, enable_chunked_prefill=chunked)


def make_request(rid, tokens, max_tokens):
    return Request(
        rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), set(), "m", BS, MAX_LEN
    )


def fake_step(sched: Scheduler, rng: random.Random):
    out = sched.schedule()
    sampled = {
        r.request_id: rng.randrange(3)
        for r in out.requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
    }
    return out, sched.update_from_output(out, sampled)


def test_decodes_and_prefill_chunks_share_a_step():
    sched = new_scheduler(budget=8)
    sched.add_request(make_request("a", [1] * 3, 10))
    out, _ = fake_step(sched, random.Random(0))
    assert out.num_scheduled_tokens == {"a": 3}
    sched.add_request(make_request("b", [2] * 20, 5))
    out, _ = fake_step(sched, random.Random(0))
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # a decodes, b gets the rest as a chunk


def test_preempts_most_recent_and_requeues_it_first():
    sched = new_scheduler(budget=64, max_seqs=8)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [i] * 20, 40))  # 5 blocks each, 16 in the pool
    rng = random.Random(0)
    preempted = []
    for _ in range(30):
        out, _ = fake_step(sched, rng)
        preempted += out.preempted
    assert preempted and preempted[0] == "r2"
    assert sched.num_preemptions == len(preempted)


def test_without_chunked_prefill_a_prompt_runs_whole():
    sched = new_scheduler(budget=MAX_LEN, chunked=False)
    sched.add_request(make_request("a", [1] * 30, 2))
    out, _ = fake_step(sched, random.Random(0))
    assert out.num_scheduled_tokens == {"a": 30}


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rng = random.Random(0)
        self.sched = new_scheduler(budget=12, max_seqs=3)
        self.n = 0
        self.finished: set[str] = set()
        self.submitted: set[str] = set()

    @rule(length=st.integers(1, 40), max_tokens=st.integers(1, 20), token=st.integers(0, 2))
    def add(self, length, max_tokens, token):
        rid = f"r{self.n}"
        self.n += 1
        tokens = [token] * (length // 2) + [
            self.rng.randrange(3) for _ in range(length - length // 2)
        ]
        self.sched.add_request(make_request(rid, tokens, min(max_tokens, MAX_LEN - length)))
        self.submitted.add(rid)

    @rule()
    def step(self):
        out, results = fake_step(self.sched, self.rng)
        assert out.total_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        for req in out.requests:
            assert out.num_scheduled_tokens[req.request_id] >= 1
        for req, _ in results:
            if req.status.finished:
                self.finished.add(req.request_id)

    @rule(data=st.data())
    def abort(self, data):
        live = sorted(self.sched.requests)
        if live:
            rid = data.draw(st.sampled_from(live))
            self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            self.finished.add(rid)

    @invariant()
    def blocks_accounted(self):
        kv = self.sched.kv
        held = sum(len(kv.req_blocks.get(r.request_id, [])) for r in self.sched.running)
        in_use = kv.num_blocks - kv.pool.num_free_blocks
        assert in_use <= held  # shared prefix blocks are counted once in the pool
        for req in self.sched.waiting:
            assert req.request_id not in kv.req_blocks, "a waiting request holds blocks"
        for req in self.sched.running:
            assert req.num_computed_tokens <= req.num_tokens

    def teardown(self):
        # Every admitted request finishes: no request is ever stuck.
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            _, results = fake_step(self.sched, self.rng)
            self.finished.update(r.request_id for r, _ in results if r.status.finished)
        assert not self.sched.has_unfinished(), "requests left stuck"
        assert self.finished == self.submitted
        assert self.sched.kv.pool.num_free_blocks == NUM_BLOCKS


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
