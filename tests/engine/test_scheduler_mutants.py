"""Scheduler: exact step contents at the edges mutation testing found unpinned (docs/mutation.md).

test_scheduler.py checks invariants under random load; these pin what one step schedules:
the budget, the model-length cap, FCFS admission with max_num_seqs, preemption of the newest
request, no admission in a preempting step, chunked and whole prefills, cached-token
accounting, and the bookkeeping of finish, abort and requeue."""

from __future__ import annotations

import pytest

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def sched(num_blocks=16, budget=16, max_seqs=4, max_len=64, chunked=True) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BS), budget, max_seqs, max_len, enable_chunked_prefill=chunked
    )


def req(rid, n, max_tokens=8, tokens=None, max_len=64, **sp) -> Request:
    tokens = tokens if tokens is not None else [1000 * sum(map(ord, rid)) + i for i in range(n)]
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp),
        set(),
        "m",
        BS,
        max_len,
    )


def step(s: Scheduler, token=1) -> SchedulerOutput:
    """One step; every request whose scheduled tokens reach its end samples `token`."""
    out = s.schedule()
    sampled = {
        r.request_id: token
        for r in out.requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
    }
    s.update_from_output(out, sampled)
    return out


def test_output_totals():
    out = SchedulerOutput()
    assert out.is_empty and out.total_tokens == 0
    out.num_scheduled_tokens.update(a=3, b=1)
    assert not out.is_empty and out.total_tokens == 4


def test_a_request_id_is_used_once():
    s = sched()
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="^request id 'a' is already in use$"):
        s.add_request(req("a", 4))
    assert s.num_waiting == 1 and s.has_unfinished()


def test_an_empty_scheduler_schedules_nothing():
    s = sched()
    assert s.schedule().is_empty and not s.has_unfinished()
    assert (s.num_running, s.num_waiting) == (0, 0)


def test_admission_is_fcfs_and_fills_the_budget_exactly():
    s = sched(budget=10)
    for rid, n in (("a", 4), ("b", 6), ("c", 3)):
        s.add_request(req(rid, n))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 6} and [
        r.request_id for r in out.requests
    ] == ["a", "b"]
    assert out.total_tokens == 10 and [r.request_id for r in s.running] == ["a", "b"]
    assert s.num_waiting == 1 and s.waiting[0].request_id == "c"
    assert all(r.status == RequestStatus.RUNNING for r in s.running)
    assert s.running[0].num_computed_tokens == 0  # progress moves only in update_from_output


def test_max_num_seqs_caps_the_running_set():
    s = sched(budget=64, max_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 2))
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"} and s.num_running == 2 and s.num_waiting == 1


def test_decodes_first_then_a_chunk_of_the_next_prompt():
    s = sched(budget=6)
    s.add_request(req("a", 2))
    step(s)
    s.add_request(req("b", 20))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    assert [r.request_id for r in out.requests] == ["a", "b"]
    out = step(s)  # a decodes, b continues its prefill with what is left
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    b = s.requests["b"]
    assert b.num_computed_tokens == 10 and b.num_output_tokens == 0


def test_a_running_prefill_takes_at_most_the_budget():
    s = sched(budget=4)
    s.add_request(req("a", 10))
    assert step(s).num_scheduled_tokens == {"a": 4}
    assert step(s).num_scheduled_tokens == {"a": 4}
    assert step(s).num_scheduled_tokens == {
        "a": 2
    }  # the rest of the prompt, and a token is sampled
    assert s.requests["a"].num_output_tokens == 1


def test_without_chunking_a_prompt_over_the_budget_waits_and_blocks_the_queue():
    s = sched(budget=8, chunked=False)
    s.add_request(req("big", 9))
    s.add_request(req("small", 2))
    out = s.schedule()
    assert out.is_empty and s.num_waiting == 2  # FCFS: small does not overtake
    s2 = sched(budget=8, chunked=False)
    s2.add_request(req("fits", 8))
    assert s2.schedule().num_scheduled_tokens == {"fits": 8}


def test_a_running_request_at_the_model_length_is_skipped_not_blocking_others():
    s = sched(budget=16, max_len=8)  # the scheduler's model length: 8 positions
    s.add_request(req("a", 7, max_tokens=5))
    s.add_request(req("b", 3))
    step(s)
    a = s.requests["a"]
    assert a.num_computed_tokens == 7 and a.num_tokens == 8
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # a computes position 8, the last one
    assert a.num_computed_tokens == 8 and a.num_tokens == 9
    out = s.schedule()  # nothing more fits a; it does not stop b
    assert out.num_scheduled_tokens == {"b": 1} and [r.request_id for r in out.requests] == ["b"]


def test_running_requests_are_served_oldest_first_within_the_budget():
    s = sched(budget=3)
    for rid in "abc":
        s.add_request(req(rid, 1))
        step(s)
    s.add_request(req("d", 1))
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b", "c"] and s.num_waiting == 1
    s2 = sched(budget=2)
    for rid in "ab":
        s2.add_request(req(rid, 1))
    step(s2)
    s2.add_request(req("c", 1))
    out = s2.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # c waits: no budget left


def test_preemption_takes_the_newest_and_admits_nobody_that_step():
    s = sched(num_blocks=4, budget=64, max_seqs=8)
    s.add_request(req("a", 8, max_tokens=20))
    s.add_request(req("b", 8, max_tokens=20))  # 2 blocks each: the pool is full
    step(s)
    s.add_request(req("c", 1))
    out = step(s)  # a needs a 3rd block: b (newest) is preempted; c is not admitted
    assert out.preempted == ["b"] and out.num_scheduled_tokens == {"a": 1}
    b = s.requests["b"]
    assert (
        b.status == RequestStatus.PREEMPTED
        and b.num_computed_tokens == 0
        and b.num_preemptions == 1
    )
    assert s.num_preemptions == 1 and [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.kv.block_table("b") == [] and s.num_running == 1


def test_a_request_that_cannot_fit_alone_preempts_itself():
    s = sched(num_blocks=2, budget=64)
    s.add_request(req("a", 8, max_tokens=4))
    step(s)
    out = step(s)  # a needs a 3rd block and is the only one running
    assert out.preempted == ["a"] and out.is_empty and s.num_running == 0
    assert s.waiting[0].request_id == "a" and s.num_preemptions == 1


def test_cached_tokens_are_counted_once_at_first_admission():
    s = sched(budget=64)
    tokens = list(range(10, 19))
    s.add_request(req("a", 9, max_tokens=1, tokens=tokens))
    step(s)  # a finishes; its 2 full blocks stay cached
    s.add_request(req("b", 9, max_tokens=3, tokens=tokens))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 1}  # 8 tokens from the cache
    b = s.requests["b"]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    s.update_from_output(out, {"b": 1})
    s.requeue(b)  # recompute from scratch: the cached count stays what the client was told
    b.num_cached_tokens = 5
    out = s.schedule()
    assert (
        b.num_cached_tokens == 5
        and b.num_computed_tokens == 8
        and out.num_scheduled_tokens == {"b": 2}
    )


def test_an_uncached_first_admission_counts_zero_cached_tokens():
    s = sched()
    s.add_request(req("a", 5))
    s.schedule()
    assert s.requests["a"].num_cached_tokens == 0


def test_admission_stops_when_blocks_run_out():
    s = sched(num_blocks=3, budget=64)
    s.add_request(req("a", 8))
    s.add_request(req("b", 8))
    s.add_request(req("c", 2))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 8} and [r.request_id for r in s.waiting] == ["b", "c"]


def test_update_advances_progress_and_finishes_at_max_tokens():
    s = sched(budget=4)
    s.add_request(req("a", 6, max_tokens=2))
    out = s.schedule()
    assert s.update_from_output(out, {}) == []  # a prefill chunk: no token
    assert s.requests["a"].num_computed_tokens == 4
    out = s.schedule()
    (res,) = s.update_from_output(out, {"a": 7})
    a = res[0]
    assert res == (a, 7) and a.num_computed_tokens == 6 and a.output_token_ids == [7]
    assert a.status == RequestStatus.RUNNING
    out = s.schedule()
    (res,) = s.update_from_output(out, {"a": 8})
    assert res == (a, 8) and a.status == RequestStatus.FINISHED_LENGTH
    assert "a" not in s.requests and s.num_running == 0 and s.kv.block_table("a") == []
    assert s.kv.pool.num_free_blocks == 16 and not s.has_unfinished()


def test_a_request_aborted_during_the_step_is_skipped():
    s = sched()
    s.add_request(req("a", 3))
    s.add_request(req("b", 3))
    out = s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    results = s.update_from_output(out, {"a": 1, "b": 2})
    assert [(r.request_id, t) for r, t in results] == [("b", 2)]
    assert s.requests["b"].num_computed_tokens == 3


def test_finish_request_wherever_it_is():
    s = sched(budget=4, max_seqs=1)
    s.add_request(req("run", 3))
    s.add_request(req("wait", 3))
    step(s)
    assert s.finish_request("nobody", RequestStatus.FINISHED_ABORTED) is None
    w = s.finish_request("wait", RequestStatus.FINISHED_ABORTED)
    assert (
        w.request_id == "wait" and w.status == RequestStatus.FINISHED_ABORTED and s.num_waiting == 0
    )
    r = s.finish_request("run", RequestStatus.FINISHED_STOPPED)
    assert (
        r.status == RequestStatus.FINISHED_STOPPED and s.num_running == 0 and not s.has_unfinished()
    )
    assert s.kv.pool.num_free_blocks == 16 and s.kv.block_table("run") == []
    assert s.finish_request("run", RequestStatus.FINISHED_ABORTED) is None


def test_finish_a_preempted_request_in_the_queue():
    s = sched()
    s.add_request(req("a", 3))
    step(s)
    a = s.requests["a"]
    s.requeue(a)
    assert a.status == RequestStatus.PREEMPTED and s.num_waiting == 1 and s.num_running == 0
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is a and s.num_waiting == 0


def test_requeue_sends_the_request_to_the_front_to_recompute():
    s = sched(max_seqs=2)
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    s.add_request(req("c", 5))
    step(s)
    a = s.requests["a"]
    s.requeue(a)
    assert [r.request_id for r in s.waiting] == ["a", "c"] and [
        r.request_id for r in s.running
    ] == ["b"]
    assert a.num_computed_tokens == 0 and a.num_preemptions == 1 and s.num_preemptions == 1
    assert s.kv.block_table("a") == []
    out = s.schedule()  # b decodes; a comes back first (its first block is a prefix hit), c waits
    assert out.num_scheduled_tokens == {"b": 1, "a": 2} and a.num_computed_tokens == 4


def test_chunked_prefill_is_on_by_default():
    s = Scheduler(KVCacheManager(16, BS), 4, 4, 64)
    s.add_request(req("a", 10))
    assert s.schedule().num_scheduled_tokens == {"a": 4}


def test_a_request_preempted_twice_counts_two():
    s = sched()
    s.add_request(req("a", 5))
    for n in (1, 2):
        step(s)
        a = s.requests["a"]
        s.requeue(a)
        assert a.num_preemptions == n and s.num_preemptions == n and a.num_computed_tokens == 0


def test_a_skipped_request_in_the_middle_of_the_running_list():
    s = sched(budget=16, max_len=8)
    for rid, n in (("x", 2), ("y", 2), ("a", 7), ("z", 2)):
        s.add_request(req(rid, n, max_tokens=20))
    step(s)
    step(s)  # a reaches the model length
    assert s.requests["a"].num_computed_tokens == 8
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["x", "y", "z"]
    assert out.num_scheduled_tokens == {"x": 1, "y": 1, "z": 1}


def test_the_last_token_of_budget_admits_a_one_token_chunk():
    s = sched(budget=5)
    s.add_request(req("a", 4))
    s.add_request(req("b", 6))
    assert s.schedule().num_scheduled_tokens == {"a": 4, "b": 1}


def test_a_re_admission_keeps_the_first_cached_count_even_when_it_was_zero():
    s = sched(budget=64)
    s.add_request(req("a", 9))
    out = s.schedule()
    a = s.requests["a"]
    assert a.num_cached_tokens == 0
    s.update_from_output(out, {"a": 1})
    s.requeue(a)  # its blocks stay cached: the re-admission hits them
    s.schedule()
    assert a.num_computed_tokens == 8 and a.num_cached_tokens == 0


def test_prefix_hit_blocks_join_the_block_table():
    s = sched(budget=64)
    tokens = list(range(10, 19))
    s.add_request(req("a", 9, max_tokens=1, tokens=tokens))
    out = s.schedule()
    a_blocks = s.kv.block_table("a")
    s.update_from_output(out, {"a": 1})  # a finishes
    s.add_request(req("b", 9, tokens=tokens))
    s.schedule()
    table = s.kv.block_table("b")
    assert len(table) == 3 and table[:2] == a_blocks[:2]


def test_a_request_without_a_token_does_not_stop_the_others():
    s = sched()
    s.add_request(req("a", 3))
    s.add_request(req("b", 3))
    out = s.schedule()
    results = s.update_from_output(out, {"b": 5})  # as if a's step were a chunk
    assert [(r.request_id, t) for r, t in results] == [("b", 5)]
    assert s.requests["a"].num_computed_tokens == 3 and s.requests["a"].num_output_tokens == 0
