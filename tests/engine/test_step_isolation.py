"""A fault inside an engine step fails only the request that causes it.

The step is run again in halves until the failure is pinned to its request; the others keep
their results (seeded ones draw the same noise), and KV that the failed request never wrote
leaves the prefix cache, with any request that read it this step sent back to recompute.
"""

from __future__ import annotations

import pytest

from kvmesh.engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts

POISON = 7777  # a prompt holding this token id triggers the injected fault
PROMPTS = random_prompts(5, 20, 50, seed=11)


@pytest.fixture()
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=16)


def inject_fault(monkeypatch, llm, poisoned, before: bool):
    """Make runner.execute raise whenever a poisoned request is in the batch: ``before`` the model
    runs (its KV is never written), or after it ran and sampled (generators have advanced)."""
    runner = llm.engine.core.runner
    real = runner.execute
    batches: list[int] = []

    def execute(out, kv):
        bad = any(poisoned(r) for r in out.requests)
        if bad and before:
            batches.append(len(out.requests))
            raise RuntimeError("injected fault")
        result = real(out, kv)
        if bad:
            batches.append(len(out.requests))
            raise RuntimeError("injected fault")
        return result

    monkeypatch.setattr(runner, "execute", execute)
    return batches


def clean(llm, prompts, params):
    """The outputs without the fault, computed in their own cache namespace."""
    return [o.token_ids for o in llm.generate(prompts, params, cache_salt="clean")]


def test_one_poisoned_request_fails_alone_and_the_others_are_unchanged(llm, monkeypatch):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True)
    params = [greedy, seeded, greedy, greedy, seeded]
    expected = clean(llm, PROMPTS, params)
    prompts = list(PROMPTS)
    prompts[2] = prompts[2][:10] + [POISON] + prompts[2][10:]
    batches = inject_fault(monkeypatch, llm, lambda r: POISON in r.prompt_token_ids, before=False)

    outs = llm.generate(prompts, params)

    assert max(batches) == 5  # the poisoned request shared its step with the four others
    assert outs[2].finish_reason == "error" and "injected fault" in outs[2].error
    assert outs[2].token_ids == []
    for i in (0, 1, 3, 4):
        assert outs[i].finish_reason == "length" and outs[i].error is None
        assert outs[i].token_ids == expected[i], i  # greedy and seeded alike: nothing drifted
    stats = llm.stats()
    assert stats.step_failures == {"request": 1, "batch": 0}
    assert stats.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()


def test_kv_the_failed_request_never_wrote_is_not_served_from_the_cache(llm, monkeypatch):
    # Two samples of one 40-token prompt: sample 0 (seed 666) computes the prompt's two full
    # blocks, sample 1 (seed 667) hits them in the same step. Sample 0 fails before the model
    # runs, so those blocks hold nothing: sample 1 must recompute, and the blocks must leave
    # the prefix cache.
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    sp = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=666, ignore_eos=True)
    expected_667 = clean(
        llm, [prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=667, ignore_eos=True)
    )
    batches = inject_fault(monkeypatch, llm, lambda r: r.sampling_params.seed == 666, before=True)

    out = llm.generate([prompt], sp)[0]

    assert max(batches) == 2
    assert out.outputs[0].finish_reason == "error"
    assert out.outputs[1].finish_reason == "length" and out.outputs[1].token_ids == expected_667[0]
    assert llm.stats().num_preemptions >= 1  # sample 1 was sent back to recompute
    again = llm.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=667, ignore_eos=True)
    )[0]
    assert again.token_ids == expected_667[0]
    assert llm.stats().kv_cache_usage == 0.0


def test_a_fault_every_request_hits_loses_the_batch_and_is_counted_so(llm, monkeypatch):
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = clean(llm, PROMPTS[:3], sp)
    inject_fault(monkeypatch, llm, lambda r: True, before=True)
    outs = llm.generate(PROMPTS[:3], sp)
    assert [o.finish_reason for o in outs] == ["error"] * 3
    assert llm.stats().step_failures == {"request": 0, "batch": 1}
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], sp)] == expected  # the engine carries on
