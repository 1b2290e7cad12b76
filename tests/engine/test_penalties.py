"""Repetition, frequency and presence penalties: against a per-token reference, and greedy fp32
outputs against transformers (repetition_penalty) and against transformers' logits with
OpenAI's penalties applied step by step."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvmesh.engine import LLM, SamplingParams
from kvmesh.engine.penalties import apply_penalties
from tests.engine.conftest import _hf_model, hf_greedy, random_prompts


def reference(logits: torch.Tensor, req) -> torch.Tensor:
    """One token at a time, straight from the definitions."""
    sp, out = req.sampling_params, logits.clone()
    seen = set(req.prompt_token_ids) | set(req.output_token_ids)
    for t in range(out.shape[0]):
        if t in seen and sp.repetition_penalty != 1.0:
            out[t] = (
                out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
            )
        n = req.output_token_ids.count(t)
        out[t] -= sp.frequency_penalty * n + sp.presence_penalty * (n > 0)
        out[t] += (sp.logit_bias or {}).get(t, 0.0)
    return out


def test_penalties_match_a_per_token_reference():
    rng = random.Random(0)
    vocab = 50
    reqs = []
    for _ in range(7):
        bias = rng.choice([None, {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)}])
        sp = SamplingParams(
            presence_penalty=rng.choice([0.0, 0.7, -0.4]),
            frequency_penalty=rng.choice([0.0, 0.3]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
            logit_bias=bias,
        )
        reqs.append(
            SimpleNamespace(
                sampling_params=sp,
                prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))],
                output_token_ids=[rng.randrange(vocab) for _ in range(rng.randrange(0, 20))],
            )
        )
    reqs.append(
        SimpleNamespace(
            sampling_params=SamplingParams(frequency_penalty=1.0),
            prompt_token_ids=[1],
            output_token_ids=[],
        )
    )  # nothing generated yet: nothing to penalise
    logits = torch.randn(len(reqs), vocab)
    got = apply_penalties(logits, reqs)
    for i, req in enumerate(reqs):
        torch.testing.assert_close(got[i], reference(logits[i], req))
    plain = [
        SimpleNamespace(
            sampling_params=SamplingParams(), prompt_token_ids=[1], output_token_ids=[2]
        )
    ]
    row = logits[:1]
    assert apply_penalties(row, plain) is row  # no penalty asked: no copy, no change


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32
    )  # chunked prefill too


PROMPTS = random_prompts(5, 4, 40, seed=11, vocab=256)


def test_repetition_penalty_matches_transformers(llm, tiny_llama_dir):
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    outs = llm.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(tiny_llama_dir, prompt, 24, True, repetition_penalty=1.8)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in plain] != [
        o.token_ids for o in outs
    ]  # the penalty changed something


def _hf_openai_penalised(
    model_dir: str, prompt: list[int], n: int, frequency: float, presence: float
) -> list[int]:
    model = _hf_model(model_dir)
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_frequency_and_presence_penalties_match_a_step_by_step_reference(llm, tiny_llama_dir):
    sp = SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=0.6, presence_penalty=0.4
    )
    # mixed in a batch with unpenalised requests, which must stay untouched
    outs = llm.generate(
        PROMPTS, [sp, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 2 + [sp]
    )
    for i in (0, 2, 4):
        assert outs[i].token_ids == _hf_openai_penalised(tiny_llama_dir, PROMPTS[i], 16, 0.6, 0.4)
    for i in (1, 3):
        assert outs[i].token_ids == hf_greedy(tiny_llama_dir, PROMPTS[i], 16, True)


def test_logit_bias_forces_and_bans_tokens(llm):
    greedy = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    forced = llm.generate(
        PROMPTS[:2],
        SamplingParams(
            max_tokens=6, temperature=0.7, seed=3, ignore_eos=True, logit_bias={77: 100.0}
        ),
    )
    assert all(o.token_ids == [77] * 6 for o in forced)
    banned_tok = greedy[0].token_ids[0]
    banned = llm.generate(
        PROMPTS[:1],
        SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, logit_bias={banned_tok: -100.0}
        ),
    )[0]
    assert banned_tok not in banned.token_ids
    assert (
        greedy[1].token_ids
        == llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[
            0
        ].token_ids
    )


def test_invalid_penalties_and_biases_are_refused(llm):
    from kvmesh.engine import InvalidParameter

    for kw, name in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ]:
        with pytest.raises(InvalidParameter, match=name):
            SamplingParams(**kw)
    with pytest.raises(InvalidParameter, match="outside the vocabulary"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={10**7: 1.0}))
    assert not llm.engine.has_unfinished_requests()  # nothing half-submitted
