"""Admission order of waiting requests under each scheduling policy (engine/prefill_order.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings

from kvmesh.engine.cli_args import engine_args_from
from kvmesh.engine.config import EngineArgs
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler
from tests.engine import test_scheduler
from tests.engine.test_token_budget import _parse

BS = 4
MAX_LEN = 256


def new_scheduler(policy="sjf", budget=16, max_seqs=32, num_blocks=256, max_skips=8, caching=True):
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    return Scheduler(kv, budget, max_seqs, MAX_LEN, policy=policy, max_prefill_skips=max_skips)


def add(sched, rid, length, max_tokens=1, priority=0, tokens=None):
    rng = random.Random(rid)
    tokens = tokens if tokens is not None else [rng.randrange(1, 1000) for _ in range(length)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(rid, tokens, params, set(), "m", BS, MAX_LEN, priority=priority)
    sched.add_request(req)
    return req


def step(sched) -> dict[str, int]:
    """One step with a fake model: a request that reaches its prompt's end samples token 7."""
    out = sched.schedule()
    sampled = {
        r.request_id: 7
        for r in out.requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens
    }
    sched.update_from_output(out, sampled)
    return out.num_scheduled_tokens


def order(scheduled: dict[str, int]) -> list[str]:
    return list(scheduled)


def test_sjf_admits_the_shortest_prompts_first():
    sched = new_scheduler(budget=100)
    for rid, n in (("a", 60), ("b", 12), ("c", 30), ("d", 6)):
        add(sched, rid, n)
    got = step(sched)
    assert order(got) == ["d", "b", "c", "a"]
    assert got == {"d": 6, "b": 12, "c": 30, "a": 52}  # the longest gets what is left


def test_sjf_ranks_the_front_of_a_long_queue_only(monkeypatch):
    from kvmesh.engine import prefill_order

    monkeypatch.setattr(prefill_order, "SJF_WINDOW", 2)
    sched = new_scheduler(budget=100)
    for rid, n in (("a", 30), ("b", 20), ("c", 5), ("d", 4)):
        add(sched, rid, n)
    assert order(step(sched)) == ["b", "a", "c", "d"]  # the rest in arrival order


def test_fcfs_admits_in_arrival_order():
    sched = new_scheduler("fcfs", budget=100)
    for rid, n in (("a", 60), ("b", 12), ("c", 30), ("d", 6)):
        add(sched, rid, n)
    assert step(sched) == {"a": 60, "b": 12, "c": 28}


def test_sjf_counts_the_prompt_after_prefix_cache_hits():
    sched = new_scheduler(budget=20)
    prefix = [random.Random(1).randrange(1, 1000) for _ in range(48)]
    add(sched, "warm", 48, tokens=prefix)
    while sched.has_unfinished():
        step(sched)  # its 12 blocks stay in the prefix cache
    add(sched, "y", 30)  # first, and shorter as a prompt
    x = add(sched, "x", 64, tokens=prefix + list(range(1, 17)))  # 48 cached: 16 to compute
    assert step(sched) == {"x": 16, "y": 4}
    assert x.num_cached_tokens == 48


def test_a_started_prefill_finishes_before_a_shorter_newcomer():
    sched = new_scheduler(budget=16)
    add(sched, "a", 40)
    assert step(sched) == {"a": 16}
    add(sched, "b", 4)
    assert step(sched) == {"a": 16}
    assert step(sched) == {"a": 8, "b": 4}


def test_a_preempted_request_goes_back_first():
    sched = new_scheduler(budget=16, caching=False)  # a recomputes all of it
    a = add(sched, "a", 12, max_tokens=5)
    assert step(sched) == {"a": 12}
    add(sched, "b", 4)
    sched.requeue(a)  # a recomputes its 13 tokens: longer than b, yet it had started
    assert step(sched) == {"a": 13, "b": 3}


def test_aging_admits_a_passed_over_prompt_first():
    sched = new_scheduler(budget=8, max_skips=2)
    add(sched, "long", 30)
    for i in range(6):
        add(sched, f"s{i}", 4)
    assert step(sched) == {"s0": 4, "s1": 4}
    assert sched.requests["long"].prefill_skips == 2
    assert step(sched) == {"long": 8}  # aged: ahead of the shorter s2..s5
    assert step(sched) == {"long": 8}  # then it runs: a started prefill finishes first


@pytest.mark.parametrize("max_skips", [0, 1, 3, 5])
def test_aging_bounds_how_many_later_prompts_overtake(max_skips):
    sched = new_scheduler(budget=8, max_skips=max_skips)
    add(sched, "long", 30)
    overtook, n = 0, 0
    for _ in range(20):
        for _ in range(2):  # shorter prompts keep arriving, more than a step admits
            add(sched, f"s{n}", 4)
            n += 1
        got = order(step(sched))
        if "long" in got:
            overtook += got.index("long")  # later arrivals admitted before it in its step
            break
        overtook += len(got)
    else:
        pytest.fail("the long prompt was never admitted")
    assert overtook == max_skips


def test_max_skips_zero_is_fcfs():
    sched = new_scheduler(budget=100, max_skips=0)
    for rid, n in (("a", 60), ("b", 12), ("c", 30), ("d", 6)):
        add(sched, rid, n)
    assert step(sched) == {"a": 60, "b": 12, "c": 28}


def test_priority_admits_lower_values_first_then_arrival():
    sched = new_scheduler("priority", budget=8)
    for rid, prio in (("a", 1), ("b", 0), ("c", 1), ("d", 0), ("e", -1)):
        add(sched, rid, 4, priority=prio)
    assert step(sched) == {"e": 4, "b": 4}
    assert step(sched) == {"d": 4, "a": 4}
    assert step(sched) == {"c": 4}


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_no_step_leaves_budget_unused_while_work_waits(policy):
    rng = random.Random(5)
    sched = new_scheduler(policy, budget=24, max_seqs=64, num_blocks=4096)
    n = 0
    for _ in range(300):
        for _ in range(rng.choice((0, 0, 1, 2))):
            add(sched, f"r{n}", rng.randint(1, 60), rng.randint(1, 6), priority=rng.randrange(3))
            n += 1
        waiting_before = sched.num_waiting
        out = step(sched)
        if waiting_before and sched.num_waiting:  # someone was left waiting: budget was all used
            assert sum(out.values()) == 24
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.pool.num_free_blocks == 4096


def test_the_same_work_takes_as_many_steps_under_each_policy():
    """Every step is full while work waits, so only the drain at the end can differ: by at most
    one request's decode tail (8 tokens here)."""

    def run(policy):
        rng = random.Random(9)
        sched = new_scheduler(policy, budget=32, num_blocks=4096)
        for i in range(40):
            add(sched, f"r{i}", rng.randint(5, 90), rng.randint(1, 8))
        steps, tokens = 0, 0
        while sched.has_unfinished():
            tokens += sum(step(sched).values())
            steps += 1
        return steps, tokens

    fcfs_steps, fcfs_tokens = run("fcfs")
    for policy in ("sjf", "priority"):
        steps, tokens = run(policy)
        assert tokens == fcfs_tokens
        assert abs(steps - fcfs_steps) <= 8


class SjfSchedulerMachine(test_scheduler.SchedulerMachine):
    """The scheduler's invariants under random load (tests/engine/test_scheduler.py), under sjf
    with a low aging bound so that aged and preempted requests mix with short ones."""

    def __init__(self):
        super().__init__()
        kv = KVCacheManager(test_scheduler.NUM_BLOCKS, test_scheduler.BS)
        self.sched = Scheduler(kv, 12, 3, test_scheduler.MAX_LEN, policy="sjf", max_prefill_skips=2)


TestSjfSchedulerMachine = SjfSchedulerMachine.TestCase
TestSjfSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)


def test_policy_flag_defaults_to_sjf_for_serve_and_fcfs_elsewhere():
    assert EngineArgs().scheduling_policy == "fcfs"
    assert engine_args_from(_parse([]), server=True).scheduling_policy == "sjf"
    assert engine_args_from(_parse([])).scheduling_policy == "fcfs"
    args = engine_args_from(
        _parse(["--scheduling-policy", "fcfs", "--max-prefill-skips", "3"]), server=True
    )
    assert (args.scheduling_policy, args.max_prefill_skips) == ("fcfs", 3)
    with pytest.raises(SystemExit):
        _parse(["--scheduling-policy", "lpm"])
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(scheduling_policy="lpm").validate()


def test_priority_travels_to_the_core_process():
    import msgspec

    from kvmesh.engine.core_messages import AddRequest

    msg = AddRequest("r", [1, 2], SamplingParams(max_tokens=1), priority=-4)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=AddRequest)
    assert decoded.priority == -4


def test_a_priority_outside_the_priority_policy_is_refused():
    from kvmesh.engine.prefill_order import check_priority
    from kvmesh.engine.sampling_params import InvalidParameter

    check_priority(0, "sjf")
    check_priority(5, "priority")
    for policy in ("fcfs", "sjf"):
        with pytest.raises(InvalidParameter) as exc:
            check_priority(1, policy)
        assert exc.value.param == "priority"
