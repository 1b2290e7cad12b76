"""Adapters in the scheduler and the prefix cache: max_loras per step, keys and KV events (no model)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from kvmesh.common.kv_events import BlockStored
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler

BS = 4
MAX_LEN = 256


def adapter(name: str, int_id: int, digest: str = "0" * 16):
    return SimpleNamespace(name=name, int_id=int_id, digest=digest)


def make_request(rid, tokens, max_tokens=4, lora=None):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, tokens, params, set(), "m", BS, MAX_LEN, lora=lora)


def new_scheduler(max_loras, budget=64, max_seqs=16, num_blocks=128, events=False):
    kv = KVCacheManager(num_blocks, BS, enable_caching=True, enable_events=events)
    return Scheduler(kv, budget, max_seqs, MAX_LEN, max_loras=max_loras)


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = {
        r.request_id: 5
        for r in out.requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens
    }
    sched.update_from_output(out, sampled)
    return out


def step_adapters(out) -> set[str]:
    return {r.lora.name for r in out.requests if r.lora is not None}


def test_a_step_holds_at_most_max_loras_adapters_and_the_rest_wait_in_place():
    a, b, c = adapter("a", 1), adapter("b", 2), adapter("c", 3)
    sched = new_scheduler(max_loras=2)
    for rid, lora in (("a1", a), ("b1", b), ("c1", c), ("base", None), ("a2", a), ("c2", c)):
        sched.add_request(make_request(rid, [1, 2, 3], lora=lora))
    out = step(sched)
    # c waits; the base request and a's second request go past it.
    assert [r.request_id for r in out.requests] == ["a1", "b1", "base", "a2"]
    assert [r.request_id for r in sched.waiting] == ["c1", "c2"]
    seen = []
    while sched.has_unfinished():
        out = step(sched)
        seen.append(step_adapters(out))
        assert len(step_adapters(out)) <= 2
    assert {"c"} in seen  # c ran once a and b were done


def test_running_requests_keep_their_slot_while_not_scheduled():
    # Async scheduling: a request whose last token is in flight is running but not scheduled.
    a, b = adapter("a", 1), adapter("b", 2)
    sched = new_scheduler(max_loras=1)
    sched.add_request(make_request("a1", [1] * 4, max_tokens=1, lora=a))
    sched.add_request(make_request("b1", [3] * 4, max_tokens=1, lora=b))
    first = sched.schedule(async_step=True)
    assert list(first.num_scheduled_tokens) == ["a1"]
    assert sched.schedule(async_step=True).is_empty  # a1 still holds the only slot
    sched.update_from_async_output(first, {"a1": 5})
    sched.release(first, ["a1"])
    assert list(sched.schedule(async_step=True).num_scheduled_tokens) == ["b1"]


def test_max_loras_in_every_step_under_random_load_with_preemption():
    rng = random.Random(0)
    loras = [adapter(f"l{i}", i + 1) for i in range(4)] + [None]
    sched = new_scheduler(max_loras=2, budget=24, max_seqs=6, num_blocks=16)
    n = 0
    per_step = []
    for _ in range(300):
        if rng.random() < 0.5:
            n += 1
            prompt = [rng.randrange(50) for _ in range(rng.randint(2, 20))]
            sched.add_request(make_request(f"r{n}", prompt, rng.randint(1, 24), rng.choice(loras)))
        out = step(sched)
        per_step.append(len(step_adapters(out)))
        assert len({id(r.lora) for r in sched.running if r.lora is not None}) <= 2
    assert max(per_step) == 2 and per_step.count(2) > 10
    assert sched.num_preemptions > 0


def test_a_reloaded_name_is_another_adapter_for_the_limit():
    old, new = adapter("a", 1, "1" * 16), adapter("a", 1, "2" * 16)
    sched = new_scheduler(max_loras=1)
    sched.add_request(make_request("old", [1, 2, 3], max_tokens=2, lora=old))
    sched.add_request(make_request("new", [1, 2, 3], max_tokens=2, lora=new))
    out = step(sched)
    assert [r.request_id for r in out.requests] == ["old"]


def _run_alone(sched, request):
    sched.add_request(request)
    while sched.has_unfinished():
        step(sched)
    return request


def test_adapter_blocks_never_hit_for_the_base_or_another_adapter():
    a, b = adapter("a", 1), adapter("b", 2)
    prompt = list(range(1, 18))  # 4 full blocks reusable
    sched = new_scheduler(max_loras=2)
    first = _run_alone(sched, make_request("a1", prompt, lora=a))
    assert first.num_cached_tokens == 0
    for rid, lora in (("base", None), ("b1", b), ("a-other-files", adapter("a", 1, "f" * 16))):
        assert _run_alone(sched, make_request(rid, prompt, lora=lora)).num_cached_tokens == 0
    assert _run_alone(sched, make_request("a2", prompt, lora=a)).num_cached_tokens == 16


def test_block_stored_events_carry_the_adapter_id_and_name():
    a = adapter("sql", 7)
    sched = new_scheduler(max_loras=1, events=True)
    _run_alone(sched, make_request("x", list(range(1, 10)), max_tokens=1, lora=a))
    _run_alone(sched, make_request("y", list(range(20, 29)), max_tokens=1))
    stored = [e for e in sched.kv.take_events() if isinstance(e, BlockStored)]
    assert [(len(e.block_hashes), e.lora_id, e.lora_name) for e in stored] == [
        (2, 7, "sql"),
        (2, None, None),
    ]
    assert stored[0].to_wire()[5:] == [7, "GPU", "sql"]
    assert stored[1].to_wire()[5:] == [None, "GPU"]
