"""Greedy fp32 outputs with a host tier equal transformers' and a cold run's, token for token,
when the prefix comes back from the host tier: alone, under chunked prefill, with async
scheduling, in a batch, under preemption; prompt and sampled logprobs too. The tier off changes
nothing. Small KV caches make the engine evict, so the hits really come from the CPU tier."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine import LLM, SamplingParams
from kvmesh.engine.config import ModelConfig
from tests.engine.conftest import hf_greedy, random_prompts

NEW = 8
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def host_gib(model_dir: str, blocks: int) -> float:
    per_block = ModelConfig.from_dir(model_dir).kv_bytes_per_block(16, torch.float32)
    return blocks * per_block / 2**30


def engine(model_dir: str, tier: bool = True, **kw) -> LLM:
    args = dict(num_kv_blocks=16, dtype="float32", device="cpu", enable_kv_events=True)
    args["max_model_len"] = 16 * args["num_kv_blocks"] if "num_kv_blocks" not in kw else None
    if tier:
        args["kv_offloading_size"] = host_gib(model_dir, 64)
    args.update(kw)
    return LLM(model_dir, **args)


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 64, 64, seed=11)[0]  # 4 blocks
    tails = random_prompts(4, 5, 20, seed=12)
    fillers = random_prompts(3, 100, 110, seed=13)  # together more than the whole KV cache
    return prefix, [prefix + t for t in tails], fillers


def evict_prefix(llm: LLM, first: list[int], fillers) -> None:
    llm.generate([first], PARAMS)
    for f in fillers:  # one at a time: each pushes older blocks out of the 16-block cache
        llm.generate([f], PARAMS)


def cpu_hits(out) -> int:
    return out.num_cached_tokens_by_medium["CPU"]


def from_cache_and_host(out, n: int) -> bool:
    """The prompt's first n tokens were not computed: the KV cache's leading run (the fillers
    may have left its first block), the rest from the host tier, at least half of it."""
    by = out.num_cached_tokens_by_medium
    return by["GPU"] + by["CPU"] == n == out.num_cached_tokens and by["CPU"] >= n // 2


@pytest.mark.parametrize(
    "kw",
    [{}, {"max_num_batched_tokens": 16}, {"async_scheduling": True}],
    ids=["plain", "chunked", "async"],
)
def test_a_prefix_from_the_host_tier_is_exact(tiny_llama_dir, prompts, kw):
    prefix, asks, fillers = prompts
    llm = engine(tiny_llama_dir, **kw)
    evict_prefix(llm, asks[0], fillers)
    out = llm.generate([asks[1]], PARAMS)[0]
    assert from_cache_and_host(out, len(prefix))
    cold = engine(tiny_llama_dir, tier=False).generate([asks[1]], PARAMS)[0]
    assert out.token_ids == cold.token_ids == hf_greedy(tiny_llama_dir, asks[1], NEW, True)
    stats = llm.stats().kv_tiers
    assert stats.hit_tokens["CPU"] == cpu_hits(out) and stats.blocks["CPU"] > 0


def test_a_batch_with_some_requests_hitting_the_tier(tiny_llama_dir, prompts):
    prefix, asks, fillers = prompts
    llm = engine(tiny_llama_dir, num_kv_blocks=24, max_model_len=384)
    evict_prefix(llm, asks[0], fillers + random_prompts(2, 100, 110, seed=14))
    batch = [asks[1], fillers[0][:40], asks[2], asks[3]]
    outs = llm.generate(batch, PARAMS)
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(tiny_llama_dir, prompt, NEW, True)
    assert from_cache_and_host(outs[0], len(prefix))
    # the others sharing the prefix hit the blocks the first one loaded (in the KV cache now)
    assert outs[2].num_cached_tokens == outs[3].num_cached_tokens == len(prefix)


def test_preemption_with_the_host_tier_is_exact(tiny_llama_dir, prompts):
    prefix, asks, fillers = prompts
    llm = engine(tiny_llama_dir, num_kv_blocks=8, max_model_len=128)
    llm.generate([asks[0]], PARAMS)
    batch = [asks[1], asks[2], asks[3], fillers[0][:60], fillers[1][:60]]
    outs = llm.generate(batch, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert llm.stats().num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(tiny_llama_dir, prompt, 24, True)
    assert llm.stats().kv_tiers.hit_tokens["CPU"] > 0


def test_prompt_logprobs_are_the_same_with_the_prefix_in_the_tier(tiny_llama_dir, prompts):
    prefix, asks, fillers = prompts
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    llm = engine(tiny_llama_dir)
    evict_prefix(llm, asks[0], fillers)
    assert llm.engine.core.tiers.host.lookup(llm_keys(llm, asks[1])[3]) is not None
    with_tier = llm.generate([asks[1]], params)[0]
    without = engine(tiny_llama_dir, tier=False).generate([asks[1]], params)[0]
    assert with_tier.num_cached_tokens == 0  # prompt logprobs skip every tier
    assert with_tier.prompt_logprobs == without.prompt_logprobs
    assert with_tier.token_ids == without.token_ids


def llm_keys(llm: LLM, prompt: list[int]) -> list[int]:
    from kvmesh.engine.request import Request

    core = llm.engine.core
    req = Request("k", prompt, PARAMS, set(), core.model_id, 16, core.max_model_len)
    return req.block_keys(len(prompt) // 16)


def test_sampled_logprobs_of_a_reloaded_prefix_equal_the_recomputed(tiny_llama_dir, prompts):
    prefix, asks, fillers = prompts
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=5)
    tiered = engine(tiny_llama_dir)
    evict_prefix(tiered, asks[0], fillers)
    reloaded = tiered.generate([asks[1]], params)[0]
    assert from_cache_and_host(reloaded, len(prefix))
    gpu = engine(tiny_llama_dir, tier=False)  # the same prefix, a KV-cache hit
    gpu.generate([asks[0]], PARAMS)
    hit = gpu.generate([asks[1]], params)[0]
    assert hit.num_cached_tokens == len(prefix)
    assert reloaded.outputs[0].logprobs == hit.outputs[0].logprobs  # the very same KV
    cold = engine(tiny_llama_dir, tier=False).generate([asks[1]], params)[0]
    for a, b in zip(reloaded.outputs[0].logprobs, cold.outputs[0].logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_the_tier_off_changes_nothing(tiny_llama_dir, prompts):
    prefix, asks, fillers = prompts
    runs = []
    for tier in (False, True):
        llm = engine(tiny_llama_dir, tier=tier)
        evict_prefix(llm, asks[0], fillers)
        out = llm.generate([asks[1]], PARAMS)[0]
        runs.append((out, llm.engine.core.take_kv_events(), llm.stats()))
    (off, off_events, off_stats), (on, on_events, _) = runs
    assert off.token_ids == on.token_ids
    assert off.num_cached_tokens_by_medium is None and off_stats.kv_tiers is None
    assert all(getattr(e, "medium", None) != "CPU" for e in off_events)
    assert any(getattr(e, "medium", None) == "CPU" for e in on_events)


def test_reset_prefix_cache_empties_the_host_tier(tiny_llama_dir, prompts):
    prefix, asks, fillers = prompts
    llm = engine(tiny_llama_dir)
    evict_prefix(llm, asks[0], fillers)
    assert llm.engine.core.reset_prefix_cache()
    out = llm.generate([asks[1]], PARAMS)[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == hf_greedy(tiny_llama_dir, asks[1], NEW, True)
