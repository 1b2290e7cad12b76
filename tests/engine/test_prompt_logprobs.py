"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log-softmax at every
prompt position: chunked prefill, beside ordinary requests, around the prefix cache, under
preemption, on the tiny model's torch path and the built-in model's kernel path."""

from __future__ import annotations

import functools

import pytest
import torch

from kvmesh.engine import LLM, SamplingParams
from tests.engine.conftest import _hf_model, hf_greedy, random_prompts


@functools.lru_cache(maxsize=64)
def hf_prompt_logprobs(model_dir: str, prompt: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(
            _hf_model(model_dir)(torch.tensor([prompt])).logits[0].float(), dim=-1
        )


def assert_matches_hf(model_dir: str, prompt: list[int], got, k: int, atol: float = 2e-4) -> None:
    lp = hf_prompt_logprobs(model_dir, tuple(prompt))
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entry, row = got[pos], lp[pos - 1]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(float(row[prompt[pos]]), abs=atol)
        chosen = row[prompt[pos]]  # rank: 1 + tokens more likely, up to ties within float noise
        assert (
            int((row > chosen + atol).sum()) + 1 <= entry.rank <= int((row >= chosen - atol).sum())
        )
        top_ids = [t for t, _ in entry.top]
        assert len(top_ids) == k
        if k:
            assert float(row[top_ids[0]]) == pytest.approx(float(row.max()), abs=atol)


PARAMS = dict(max_tokens=4, temperature=0, ignore_eos=True)


def test_prompt_logprobs_match_transformers_under_chunking_and_batching(tiny_llama_dir):
    llm = LLM(
        tiny_llama_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16
    )  # 40-token prompts: 3+ chunks
    prompts = random_prompts(4, 20, 45, seed=5, vocab=256)
    params = [SamplingParams(prompt_logprobs=2, **PARAMS), SamplingParams(**PARAMS)] * 2
    outs = llm.generate(prompts, params)
    for i in (0, 2):
        assert_matches_hf(tiny_llama_dir, prompts[i], outs[i].prompt_logprobs, 2)
    for i in (1, 3):
        assert outs[i].prompt_logprobs is None
    # the generated tokens are untouched by the extra rows
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_llama_dir, p, 4, True) for p in prompts]


def test_prompt_logprobs_bypass_the_prefix_cache_and_survive_preemption(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=12, max_num_batched_tokens=64)
    prompt = random_prompts(1, 40, 41, seed=9, vocab=256)[0]
    llm.generate([prompt], SamplingParams(**PARAMS))
    warm = llm.generate([prompt], SamplingParams(**PARAMS))[0]
    assert warm.num_cached_tokens > 0  # an ordinary request hits the cache
    scored = llm.generate([prompt], SamplingParams(prompt_logprobs=0, **PARAMS))[0]
    assert scored.num_cached_tokens == 0  # every position computed, so every position scored
    assert_matches_hf(tiny_llama_dir, prompt, scored.prompt_logprobs, 0)
    # 12 blocks of 16 cannot hold four 40-token prompts with 40 new tokens each: preemption
    prompts = random_prompts(4, 38, 42, seed=13, vocab=256)
    outs = llm.generate(
        prompts, SamplingParams(prompt_logprobs=1, max_tokens=40, temperature=0, ignore_eos=True)
    )
    assert llm.stats().num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert_matches_hf(tiny_llama_dir, p, o.prompt_logprobs, 1)
        assert o.token_ids == hf_greedy(tiny_llama_dir, p, 40, True)


def test_prompt_logprobs_on_the_builtin_model(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    prompt = llm.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=3, **PARAMS))[0]
    assert_matches_hf(smollm2_dir, prompt, out.prompt_logprobs, 3, atol=1e-3)
    # a predictable continuation scores far better than chance
    rome = prompt.index(llm.tokenizer.encode(" Rome", add_special_tokens=False)[0])
    assert out.prompt_logprobs[rome].rank <= 5
