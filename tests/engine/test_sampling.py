"""Sampling controls: seeds, filters, stops, limits, logprobs, detokenisation."""

from __future__ import annotations

import math

import pytest

from kvmesh.engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


PROMPTS = random_prompts(6, 5, 60, seed=3)


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 5
    batched = llm.generate(PROMPTS, [sp] + others)[0].token_ids
    assert alone == batched
    different_seed = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )[0].token_ids
    assert different_seed != alone


def test_top_k_one_and_tiny_min_p_are_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    topk1 = llm.generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, top_k=1, ignore_eos=True)
    )
    minp = llm.generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, min_p=1.0, ignore_eos=True)
    )
    assert [o.token_ids for o in topk1] == [o.token_ids for o in greedy]
    assert [o.token_ids for o in minp] == [o.token_ids for o in greedy]


def test_top_p_restricts_to_the_nucleus(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tiny_p = llm.generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True)
    )
    assert [o.token_ids for o in tiny_p] == [o.token_ids for o in greedy]


def test_max_tokens_and_stop_token_ids(llm):
    base = llm.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    assert len(base.token_ids) == 12 and base.finish_reason == "length"
    stop_at = base.token_ids[4]
    first = base.token_ids.index(stop_at)
    out = llm.generate(
        [PROMPTS[1]],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    # min_tokens holds the stop token back.
    held = llm.generate(
        [PROMPTS[1]],
        SamplingParams(
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            stop_token_ids=[stop_at],
            min_tokens=first + 2,
        ),
    )[0]
    assert stop_at not in held.token_ids[: first + 2]


def test_stop_strings_truncate_text(llm):
    base = llm.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )[0]
    text = base.text
    assert len(text) > 10
    stop = text[5:8]
    out = llm.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(
        [PROMPTS[2]],
        SamplingParams(
            max_tokens=20,
            temperature=0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats().kv_cache_usage == 0.0


def test_incremental_text_equals_full_decode(llm):
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[
        0
    ]
    prompt_tail = PROMPTS[3][-4:]
    full = llm.tokenizer.decode(prompt_tail + out.token_ids)
    assert full.endswith(out.text) and len(out.text) > 0


def test_logprobs(llm):
    out = llm.generate(
        [PROMPTS[4]], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    )[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for tok, lp in zip(out.token_ids, lps):
        assert lp.token_id == tok and lp.rank == 1  # greedy picks the most likely token
        assert len(lp.top) == 3 and lp.top[0][0] == tok
        assert math.isclose(lp.top[0][1], lp.logprob, rel_tol=1e-6)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0


def test_chat_uses_the_chat_template(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=64)
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(messages)
    assert len(out.token_ids) == 3
    turn = messages + [{"role": "assistant", "content": "Hello, I am"}]
    cont = llm.chat(
        turn, SamplingParams(max_tokens=2), add_generation_prompt=False, continue_final_message=True
    )[0]
    assert cont.prompt_token_ids == llm.tokenizer.encode_chat(turn, False, True)
    assert llm.tokenizer.decode(cont.prompt_token_ids).endswith("Hello, I am")
    from kvmesh.engine import InvalidParameter

    with pytest.raises(InvalidParameter, match="cannot both be true"):
        llm.chat(turn, continue_final_message=True)


def test_bfloat16_weights_and_cache(tiny_llama_dir):
    fp32 = LLM(tiny_llama_dir, num_kv_blocks=64, dtype="float32")
    bf16 = LLM(tiny_llama_dir, num_kv_blocks=64, dtype="bfloat16")
    runner = bf16.engine.core.runner
    assert (
        runner.kv_caches[0][0].dtype
        == runner.model.embed_tokens.weight.dtype
        == __import__("torch").bfloat16
    )
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a = fp32.generate(PROMPTS[:3], sp)
    b = bf16.generate(PROMPTS[:3], sp)
    assert all(len(o.token_ids) == 8 for o in b)
    # Same model at lower precision: the first greedy token agrees on these well-separated logits.
    assert [o.token_ids[0] for o in a] == [o.token_ids[0] for o in b]


def test_n_samples_per_prompt(llm):
    sp = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=21, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], sp)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    # sample j is the request seeded seed + j, whatever else runs beside it
    for j in range(3):
        alone = llm.generate(
            [PROMPTS[1]],
            SamplingParams(max_tokens=8, temperature=1.0, seed=21 + j, ignore_eos=True),
        )[0]
        assert outs[1].outputs[j].token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    greedy = llm.generate(
        [PROMPTS[0]], SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(Exception, match="fan n > 1 out"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(n=2))


def test_n_samples_compute_the_prompt_once(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=256)
    prompt = list(range(5, 205))  # 12 full blocks of 16 and a tail
    out = llm.generate(
        [prompt], SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    )[0]
    assert len(out.outputs) == 4
    # the first sample registers the prompt's full blocks on allocation; the other three hit them
    # within the same step
    assert llm.stats().prefix_cache_hits == 3 * 192
