"""Async scheduling: step N+1 is scheduled and prepared while step N runs, its placeholder inputs
filled on the device from N's sampled ids.

Greedy fp32 outputs stay equal to transformers' token for token on every scheduling path
(batched, chunked, prefix hits, preemption, stops mid-batch, max_tokens, aborts in flight, stop
strings, penalties and speculative decoding falling back to synchronous steps, the Triton
backend with CUDA graphs stubbed); the pipeline really overlaps; placeholders never reach the
prefix cache or the KV events; a failing request fails alone.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvmesh.common.kv_events import BlockStored
from kvmesh.engine import LLM, SamplingParams
from kvmesh.engine.config import EngineArgs
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.engine.request import RequestStatus
from tests.engine.conftest import hf_greedy, random_prompts

MAX_NEW = 16
PROMPTS = random_prompts(10, 5, 120, seed=3)


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_llm(model_dir: str, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    llm = LLM(model_dir, dtype="float32", async_scheduling=True, **kw)
    assert llm.engine.core.async_scheduling
    return llm


def assert_hf(model_dir, prompts, outs, max_new=MAX_NEW):
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, max_new, True), (
            f"prompt {i} diverged"
        )


@pytest.fixture(params=["tiny-llama", "tiny-qwen2"])
def model_dir(request):
    return request.getfixturevalue(request.param.replace("-", "_") + "_dir")


# -- parity ----------------------------------------------------------------------------------------
def test_flag_defaults_off_on_the_cpu_and_parses(tiny_llama_dir):
    import argparse

    from kvmesh.engine.cli_args import add_engine_arguments, engine_args_from

    assert not LLM(tiny_llama_dir, num_kv_blocks=16).engine.core.async_scheduling
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args_from(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert engine_args_from(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert engine_args_from(parser.parse_args([])).async_scheduling is None


def test_batched_mixed_lengths_match_transformers(model_dir):
    llm = make_llm(model_dir)
    outs = llm.generate(PROMPTS, greedy())
    assert_hf(model_dir, PROMPTS, outs)
    core = llm.engine.core
    assert core.num_async_steps == core.num_steps > 0 and core.num_sync_steps == 0
    assert (
        llm.stats().kv_cache_usage == 0.0 and not core._in_flight and not core.scheduler.in_flight
    )


def test_chunked_prefill(model_dir):
    llm = make_llm(model_dir, max_num_batched_tokens=32)
    assert max(map(len, PROMPTS)) > 32
    assert_hf(model_dir, PROMPTS, llm.generate(PROMPTS, greedy()))


def test_prefix_cache_hits(tiny_llama_dir):
    prefix = random_prompts(1, 70, 70, seed=9)[0]
    prompts = [prefix + s for s in random_prompts(5, 3, 30, seed=10)]
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=64)
    assert_hf(tiny_llama_dir, prompts[:1], llm.generate(prompts[:1], greedy()))
    outs = llm.generate(prompts[1:], greedy())
    assert_hf(tiny_llama_dir, prompts[1:], outs)
    assert all(o.num_cached_tokens == 64 for o in outs)
    # The first prompt again: everything but the last token's block is served from the cache.
    again = llm.generate([prompts[0]], greedy())[0]
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16


def test_preemption_takes_a_sync_step(model_dir):
    llm = make_llm(model_dir, num_kv_blocks=20, max_num_batched_tokens=256)
    prompts = [p for p in PROMPTS if len(p) + MAX_NEW <= 20 * 16][:8]
    assert sum(-(-(len(p) + MAX_NEW) // 16) for p in prompts) > 20
    outs = llm.generate(prompts, greedy())
    core = llm.engine.core
    assert llm.stats().num_preemptions > 0 and core.num_sync_steps > 0 and core.num_async_steps > 0
    assert_hf(model_dir, prompts, outs)
    assert llm.stats().kv_cache_usage == 0.0


def test_stops_mid_batch_and_max_tokens(tiny_llama_dir):
    """EOS, a stop token id and different max_tokens end requests while the next step, scheduled
    before the stopping token was known, is in flight: nothing after the stop is emitted."""
    prompts = PROMPTS[:6]
    full = [hf_greedy(tiny_llama_dir, p, MAX_NEW, True) for p in prompts]
    llm = make_llm(tiny_llama_dir)
    eos = full[0][4]
    llm.engine.core.eos_token_ids.add(eos)  # an EOS id this model produces
    params = [
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0),  # stops at eos
        greedy(stop_token_ids=[full[1][6]]),
        greedy(1),
        greedy(3),
        greedy(MAX_NEW - 1),
        greedy(),
    ]
    outs = llm.generate(prompts, params)

    def cut(tokens, stops):
        at = [i for i, t in enumerate(tokens) if t in stops]
        return tokens[: at[0] + 1] if at else tokens

    expected = [
        cut(full[0], llm.engine.core.eos_token_ids),
        cut(full[1], {full[1][6]}),
        full[2][:1],
        full[3][:3],
        full[4][:-1],
        full[5],
    ]
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, i
    assert (
        outs[0].outputs[0].finish_reason == "stop" and outs[1].outputs[0].stop_reason == full[1][6]
    )
    assert [o.outputs[0].finish_reason for o in outs[2:]] == ["length"] * 4
    assert llm.stats().kv_cache_usage == 0.0 and not llm.engine.core.scheduler._deferred_free


def test_pipeline_overlaps_and_never_schedules_past_max_tokens(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    core = llm.engine.core
    sched = core.scheduler
    log: list[tuple[str, int]] = []
    scheduled_samples: Counter = Counter()
    real_schedule, real_update = sched.schedule, sched.update_from_async_output

    def schedule(async_step=False):
        out = real_schedule(async_step)
        if not out.is_empty:
            out.test_id = len(log)
            log.append(("schedule", out.test_id))
        for r in out.requests:
            # Placeholders never exceed what max_tokens leaves.
            assert r.num_output_tokens + r.num_output_placeholders <= r.max_output_tokens
            if r.request_id in out.sampling:
                scheduled_samples[r.request_id] += 1
        return out

    def update(out, sampled):
        log.append(("apply", out.test_id))
        return real_update(out, sampled)

    sched.schedule, sched.update_from_async_output = schedule, update
    prompts = PROMPTS[:4]
    max_tokens = [1, 2, 5, 9]
    outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    # Exactly max_tokens samples were scheduled per request: none past the limit.
    assert [scheduled_samples[o.request_id] for o in outs] == max_tokens
    # Step N+1 was scheduled before step N's outputs were applied, for every step but the last.
    steps = [n for k, n in log if k == "schedule"]
    assert sorted(n for k, n in log if k == "apply") == steps  # each applied once
    where = {entry: i for i, entry in enumerate(log)}
    overlapped = [
        n
        for n in steps
        if any(
            k == "schedule" and where[("schedule", n)] < i < where[("apply", n)]
            for i, (k, _) in enumerate(log)
        )
    ]
    assert len(steps) == 9 and overlapped == steps[:-1]


def test_abort_while_in_flight(tiny_llama_dir):
    engine = LLMEngine(
        EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, async_scheduling=True)
    )
    core = engine.core
    prompts = PROMPTS[:3]
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy(), request_id=f"r{i}")
    tokens = {f"r{i}": [] for i in range(3)}
    finish = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.delta_token_ids
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
        steps += 1
        if len(tokens["r1"]) == 3 and "r1" not in finish:
            assert core._in_flight and "r1" in core.scheduler.in_flight  # its next step is running
            engine.abort_request(["r1"])
            held = core.kv.block_table("r1")
            assert held  # not freed while the step in flight writes them
    assert finish == {"r0": "length", "r1": "abort", "r2": "length"}
    assert (
        tokens["r1"] == hf_greedy(tiny_llama_dir, prompts[1], MAX_NEW, True)[:3]
    )  # nothing after the abort
    for rid, p in (("r0", prompts[0]), ("r2", prompts[2])):
        assert tokens[rid] == hf_greedy(tiny_llama_dir, p, MAX_NEW, True)
    assert core.kv.usage == 0.0 and not core.kv.block_table("r1")


def test_an_aborted_id_reused_while_its_step_is_in_flight(tiny_llama_dir):
    """A new request with the id of one aborted while a step holding it is in flight: that step is
    applied first (the old request's blocks are keyed by the id), and both run right."""
    from kvmesh.engine.engine_core import EngineCore

    core = EngineCore(
        EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, async_scheduling=True)
    )
    core.add_request("a", PROMPTS[0], greedy())
    core.add_request("b", PROMPTS[1], greedy())
    got: dict[str, list] = {"a": [], "b": []}
    finished = []
    for _ in range(3):
        for out in core.step():
            got[out.request_id] += out.new_token_ids
    assert "a" in core.scheduler.in_flight and core.kv.block_table("a")
    core.abort_requests(["a"])
    core.add_request("a", PROMPTS[2], greedy())
    assert (
        not core._in_flight
    )  # drained: the old "a" released its blocks before the new one holds any
    got["a"] = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finish_reason == "abort":
                assert not out.new_token_ids
            else:
                got[out.request_id] += out.new_token_ids
            if out.finished:
                finished.append((out.request_id, out.finish_reason))
    assert finished.count(("a", "abort")) == 1 and ("a", "length") in finished
    assert got["a"] == hf_greedy(tiny_llama_dir, PROMPTS[2], MAX_NEW, True)
    assert got["b"] == hf_greedy(tiny_llama_dir, PROMPTS[1], MAX_NEW, True)
    assert core.kv.usage == 0.0


def test_stop_strings_through_llm_engine(tiny_llama_dir):
    """A stop string (the frontend's abort) ends a request whose next step is in flight: the same
    text and tokens as without async scheduling."""
    prompts = PROMPTS[:4]
    sync = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=256, async_scheduling=False)
    plain = sync.generate(prompts, greedy())
    stop = plain[1].outputs[0].text[3:7]
    assert stop.strip()
    params = [greedy(), greedy(stop=[stop]), greedy(), greedy(stop=[stop])]
    want = sync.generate(prompts, params)
    got = make_llm(tiny_llama_dir).generate(prompts, params)
    assert got[1].outputs[0].finish_reason == "stop" and got[1].outputs[0].stop_reason == stop
    for w, g in zip(want, got):
        assert (g.outputs[0].text, g.outputs[0].token_ids, g.outputs[0].finish_reason) == (
            w.outputs[0].text,
            w.outputs[0].token_ids,
            w.outputs[0].finish_reason,
        )


def test_penalties_and_min_tokens_take_sync_steps(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    core = llm.engine.core
    prompts = PROMPTS[:3]
    params = [
        greedy(),
        SamplingParams(
            max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.5
        ),
        greedy(),
    ]
    outs = llm.generate(prompts, params)
    assert outs[1].outputs[0].token_ids == hf_greedy(
        tiny_llama_dir, prompts[1], MAX_NEW, True, repetition_penalty=1.5
    )
    assert_hf(tiny_llama_dir, [prompts[0], prompts[2]], [outs[0], outs[2]])
    assert core.num_sync_steps > 0
    # min_tokens (EOS banned until reached): synchronous until reached, async after.
    eos = hf_greedy(tiny_llama_dir, prompts[0], MAX_NEW, True)[2]
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=6)
    sync = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=256, async_scheduling=False)
    sync.engine.core.eos_token_ids.add(eos)
    want = sync.generate([prompts[0]], sp)[0].outputs[0].token_ids
    core.num_sync_steps = core.num_async_steps = 0
    core.eos_token_ids.add(eos)
    got = llm.generate([prompts[0]], sp)[0].outputs[0].token_ids
    assert got == want and len(got) >= 6 and eos not in got[:5]
    assert core.num_sync_steps >= 5 and core.num_async_steps > 0


def test_speculative_decoding_runs_synchronously(tmp_path):
    from tests.tiny_models import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "m", "tiny-llama-v256"))
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "acceptance_threshold": 0.0,
        "disable_by_batch_size": None,
    }
    prompts = random_prompts(3, 10, 40, seed=4, vocab=256)
    llm = make_llm(model_dir, speculative_config=spec)
    outs = llm.generate(prompts, greedy(24))
    assert_hf(model_dir, prompts, outs, 24)
    core = llm.engine.core
    assert core.num_async_steps == 0 and core.num_sync_steps == core.num_steps
    assert llm.stats().spec_decode.num_drafts > 0


# -- the prefix cache and KV events ---------------------------------------------------------------
def _stored(llm) -> Counter:
    return Counter(
        (tuple(e.block_hashes), tuple(e.token_ids))
        for e in llm.engine.core.take_kv_events()
        if isinstance(e, BlockStored)
    )


def test_no_placeholder_is_cached_or_published(tiny_llama_dir):
    """The KV events of an async run equal those of a sync run: each block is stored once its
    tokens are all known (including blocks completed by generated tokens)."""
    prefix = random_prompts(1, 40, 40, seed=21)[0]
    prompts = [prefix + s for s in random_prompts(4, 1, 20, seed=22)] + PROMPTS[:3]
    params = [greedy(40), greedy(33), greedy(17), greedy(48), greedy(8), greedy(30), greedy(47)]
    runs = {}
    for mode in (False, True):
        llm = LLM(
            tiny_llama_dir,
            dtype="float32",
            num_kv_blocks=256,
            enable_kv_events=True,
            async_scheduling=mode,
            max_num_batched_tokens=48,
        )
        outs = llm.generate(prompts, params)
        runs[mode] = (_stored(llm), [o.outputs[0].token_ids for o in outs])
    assert runs[True][1] == runs[False][1]
    assert runs[True][0] == runs[False][0]
    # Generated tokens did complete blocks that were published (a placeholder would show as 0s).
    stored_tokens = {t for _, tokens in runs[True][0] for t in tokens}
    generated = {t for out in runs[True][1] for t in out}
    assert generated & stored_tokens
    assert sum(runs[True][0].values()) > len(prompts)


# -- step failures -----------------------------------------------------------------------------------
POISON = 7777


def test_a_failing_request_fails_alone_under_async(tiny_llama_dir, monkeypatch):
    """A request whose step raises (here from its 5th step on) fails alone; the step
    dispatched after the failed one is undone and redone; the others' tokens are unchanged."""
    prompts = PROMPTS[:5]
    prompts[2] = prompts[2][:3] + [POISON] + prompts[2][3:]
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=99, ignore_eos=True)
    params = [greedy(), seeded, greedy(), greedy(), seeded]
    clean = LLM(
        tiny_llama_dir, dtype="float32", num_kv_blocks=256, async_scheduling=False
    ).generate(prompts, params)
    llm = make_llm(tiny_llama_dir)
    runner = llm.engine.core.runner
    real_run = runner.run
    faults = []
    runs = [0]

    def run(step, prev=None):
        result = real_run(step, prev)
        poisoned = [r for r in step.requests if POISON in r.prompt_token_ids]
        runs[0] += bool(poisoned)
        if poisoned and runs[0] >= 5:  # from its 5th step on (it has 4 tokens then)
            faults.append(len(step.requests))
            raise RuntimeError("injected fault")
        return result

    monkeypatch.setattr(runner, "run", run)
    core = llm.engine.core
    reverted = []
    real_revert = core._revert
    monkeypatch.setattr(
        core, "_revert", lambda batch: (reverted.append(len(batch.request_ids)), real_revert(batch))
    )
    outs = llm.generate(prompts, params)
    assert max(faults) == 5
    assert reverted == [5]  # the step dispatched after the failed one was undone
    assert outs[2].outputs[0].finish_reason == "error" and "injected fault" in outs[2].error
    assert len(outs[2].outputs[0].token_ids) == 4
    for i in (0, 1, 3, 4):
        assert outs[i].outputs[0].token_ids == clean[i].outputs[0].token_ids, i
        assert outs[i].outputs[0].finish_reason == "length"
    stats = llm.stats()
    assert stats.step_failures == {"request": 1, "batch": 0}
    assert stats.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()


# -- the GPU path on the CPU: Triton under the interpreter, CUDA graphs stubbed ---------------------
def test_triton_backend_with_graphs_fills_placeholders_before_replay(tiny_llama_dir):
    pytest.importorskip("triton")
    from tests.engine.test_gpu_execution import FakeGraphAPI

    llm = make_llm(tiny_llama_dir, attention_backend="triton", num_kv_blocks=64, max_num_seqs=4)
    runner = llm.engine.core.runner
    runner.capture_cuda_graphs(4, llm.engine.core.max_model_len, api=FakeGraphAPI())
    graphs = runner.graphs
    seen = []
    real_replay = graphs.replay

    def replay(input_ids, positions, meta):
        seen.append(input_ids.clone())
        return real_replay(input_ids, positions, meta)

    graphs.replay = replay
    prompts = random_prompts(3, 4, 12, seed=5)
    outs = llm.generate(prompts, greedy(4))
    assert_hf(tiny_llama_dir, prompts, outs, 4)
    assert graphs.num_replays == 3  # tokens 2-4: decode steps of 3 rows, their inputs placeholders
    # What the graphs took were the previous steps' tokens (filled on the device), never the 0s.
    for k, ids in enumerate(seen):
        assert ids.tolist() == [o.outputs[0].token_ids[k] for o in outs]


# -- the scheduler alone, under random load ------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_scheduler_pipeline_under_random_load(seed):
    """The scheduler driven as the engine drives it (schedule N+1, then apply N; a blocked async
    schedule drains and takes a sync step), with random tokens, stop ids, aborts and a small pool:
    nothing is scheduled past max_tokens, every request ends with its limit (or earlier at a stop
    / abort), and every block comes back."""
    import random

    from kvmesh.engine.kv_cache_manager import KVCacheManager
    from kvmesh.engine.request import Request
    from kvmesh.engine.scheduler import Scheduler

    rng = random.Random(seed)
    bs, num_blocks, max_len = 4, 12, 48
    kv = KVCacheManager(num_blocks, bs, enable_caching=True)
    sched = Scheduler(kv, 16, 4, max_len)
    reqs = {}
    for i in range(12):
        sp = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, stop_token_ids=[0])
        r = Request(
            f"r{i}",
            [rng.randrange(1, 5) for _ in range(rng.randint(1, 20))],
            sp,
            set(),
            "m",
            bs,
            max_len,
        )
        sched.add_request(r)
        reqs[r.request_id] = r
    in_flight = []
    aborted = set()

    def apply(out):
        sampled = {rid: rng.randrange(0, 9) for rid in out.sampling}
        sched.update_from_async_output(out, sampled)
        sched.release(out, list(out.num_scheduled_tokens))

    for _ in range(500):
        if not sched.has_unfinished() and not in_flight:
            break
        out = sched.schedule(async_step=True)
        for r in out.requests:
            assert r.num_output_tokens + r.num_output_placeholders <= r.max_output_tokens
            assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders
        if not out.is_empty:
            in_flight.append(out)
        if len(in_flight) > 1 or (in_flight and out.is_empty):
            apply(in_flight.pop(0))
        if out.blocked:  # drain, then a synchronous step (which may preempt)
            while in_flight:
                apply(in_flight.pop(0))
            s = sched.schedule()
            tokens = {
                r.request_id: rng.randrange(0, 9)
                for r in s.requests
                if r.num_computed_tokens + s.num_scheduled_tokens[r.request_id] == r.num_tokens
            }
            sched.update_from_output(s, tokens)
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
    assert not sched.has_unfinished() and not in_flight
    for rid, r in reqs.items():
        out = r.output_token_ids
        assert len(out) <= r.max_output_tokens
        if rid not in aborted and 0 not in out:
            assert len(out) == r.max_output_tokens, rid
        if 0 in out:
            assert out.index(0) == len(out) - 1  # nothing after the stop
    assert (
        kv.pool.num_free_blocks == num_blocks and not sched.in_flight and not sched._deferred_free
    )


def test_core_loop_last_resort_with_steps_in_flight(tiny_llama_dir, monkeypatch):
    """A fault outside the model run (here applying a step's outputs) reaches the core loop's last
    resort with a step in flight: every request ends with an error, the step in flight is
    dropped, all blocks come back, and the engine serves the next requests right."""
    from kvmesh.engine.core_messages import AddRequest
    from kvmesh.engine.core_proc import CoreLoop, EngineStepError
    from kvmesh.engine.engine_core import EngineCore

    core = EngineCore(
        EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, async_scheduling=True)
    )
    loop = CoreLoop(core)
    for i in range(3):
        assert loop.add(AddRequest(f"r{i}", PROMPTS[i], greedy())) is None
    loop.step()
    loop.step()
    assert core._in_flight
    real = core.scheduler.update_from_async_output
    monkeypatch.setattr(
        core.scheduler,
        "update_from_async_output",
        lambda *a: (_ for _ in ()).throw(RuntimeError("bookkeeping fault")),
    )
    items = loop.step()
    assert sorted(rid for rid, item in items if isinstance(item, EngineStepError)) == [
        "r0",
        "r1",
        "r2",
    ]
    assert not core._in_flight and not core.scheduler.in_flight and core.kv.usage == 0.0
    monkeypatch.setattr(core.scheduler, "update_from_async_output", real)
    assert loop.add(AddRequest("again", PROMPTS[3], greedy())) is None
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for rid, o in loop.step() if rid == "again" for t in o.new_token_ids]
    assert tokens == hf_greedy(tiny_llama_dir, PROMPTS[3], MAX_NEW, True)


def test_a_request_admitted_in_the_undone_step_recomputes(tiny_llama_dir, monkeypatch):
    """A request admitted in the step dispatched after a failed one: that step is undone, the
    request goes back to the queue and recomputes from scratch, with transformers' tokens."""
    from kvmesh.engine.engine_core import EngineCore

    core = EngineCore(
        EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, async_scheduling=True)
    )
    prompts = PROMPTS[:3]
    poisoned = prompts[1][:3] + [POISON] + prompts[1][3:]
    real_run = core.runner.run
    runs = [0]

    def run(step, prev=None):
        result = real_run(step, prev)
        if any(POISON in r.prompt_token_ids for r in step.requests):
            runs[0] += 1
            if runs[0] >= 5:
                raise RuntimeError("injected fault")
        return result

    monkeypatch.setattr(core.runner, "run", run)
    core.add_request("a", prompts[0], greedy())
    core.add_request("p", poisoned, greedy())
    got: dict[str, list] = {"a": [], "p": [], "x": []}
    finish = {}

    def step():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finish[out.request_id] = out.finish_reason

    for _ in range(5):
        step()  # the 5th call dispatched p's failing run
    core.add_request("x", prompts[2], greedy())  # admitted in the next step, which will be undone
    step()
    x = core.scheduler.requests["x"]
    assert finish.get("p") == "error" and x.num_preemptions == 1 and x.num_computed_tokens == 0
    while core.has_unfinished_requests():
        step()
    assert finish == {"a": "length", "p": "error", "x": "length"}
    assert got["a"] == hf_greedy(tiny_llama_dir, prompts[0], MAX_NEW, True)
    assert got["x"] == hf_greedy(tiny_llama_dir, prompts[2], MAX_NEW, True)
    assert len(got["p"]) == 4 and core.kv.usage == 0.0 and core.stats().num_preemptions == 0
