"""Greedy bf16 outputs match transformers' bf16 ones on the CPU, except at near-ties.

Two bf16 implementations round differently (summation order, where a value is cast), so a
divergence is allowed only where it is one: at the first position the two runs differ,
transformers' fp32 logits of the two candidate tokens (teacher-forced on the shared prefix) lie
within twice transformers' own bf16 rounding there (the largest |bf16 - fp32| logit of the row),
as bench/gpu_parity.py weighs its bf16 runs. Single requests, a batch, chunked prefill and prefix
hits; the compiled kernels (bf16 panels, the decode stack, prefill attention on the built-in
model's head size) and the plain torch path.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvmesh.engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts

MAX_NEW = 24


@functools.lru_cache(maxsize=4)
def _hf(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@functools.lru_cache(maxsize=256)
def _hf_bf16_greedy(model_dir: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    model = _hf(model_dir, torch.bfloat16)
    out, ids = [], list(prompt)
    with torch.inference_mode():  # no KV cache: each step recomputes, as simple as it gets
        for _ in range(MAX_NEW):
            tok = int(model(torch.tensor([ids])).logits[0, -1].float().argmax())
            out.append(tok)
            ids.append(tok)
    return tuple(out)


def near_tie(model_dir: str, prefix: list[int], expected: int, got: int) -> tuple[bool, str]:
    """Whether `got` instead of `expected` after `prefix` is a near-tie, and the numbers."""
    with torch.inference_mode():
        ids = torch.tensor([prefix])
        row32 = _hf(model_dir, torch.float32)(ids).logits[0, -1].float()
        row16 = _hf(model_dir, torch.bfloat16)(ids).logits[0, -1].float()
    gap32 = float(row32[expected] - row32[got])
    rounding = float((row16 - row32).abs().max())
    return abs(gap32) <= 2 * rounding, f"fp32 gap {gap32:.5f}, bf16 rounding {rounding:.5f}"


def assert_bf16_parity(model_dir: str, prompts, outputs) -> int:
    """Each output equals transformers' bf16 greedy one up to a near-tie; returns how many
    diverged (each at a near-tie)."""
    diverged = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        expected = list(_hf_bf16_greedy(model_dir, tuple(prompt)))
        got = list(out.token_ids)
        n = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if n is None:
            assert len(got) == len(expected)
            continue
        diverged += 1
        ok, numbers = near_tie(model_dir, prompt + expected[:n], expected[n], got[n])
        assert ok, f"prompt {i} diverged at token {n} beyond bf16 rounding: {numbers}"
    return diverged


def _shared_prefix_prompts() -> list[list[int]]:
    prefix = random_prompts(1, 70, 70, seed=7)[0]
    return [prefix + s for s in random_prompts(4, 6, 40, seed=8)]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def model_dir(request) -> str:
    return request.getfixturevalue(request.param.replace("-", "_") + "_dir")


PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(12, 5, 200, seed=1)


def _llm(model_dir: str, **engine_args) -> LLM:
    engine_args.setdefault("num_kv_blocks", 512)
    return LLM(model_dir, dtype="bfloat16", **engine_args)


def test_bf16_end_to_end(model_dir):
    """Weights and KV cache in bf16; decode rows on the bf16 panels and the decode stack."""
    llm = _llm(model_dir)
    runner = llm.engine.core.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.model.layers[0].mlp.down_proj.packed.dtype == torch.bfloat16
    assert runner.model.layers[0].mlp.down_proj.panels.dtype == torch.bfloat16
    assert runner.model.packed_lm_head.panels.dtype == torch.bfloat16
    assert runner.model.decode_stack is not None
    prompt = max(PROMPTS, key=len)
    assert_bf16_parity(model_dir, [prompt], llm.generate([prompt], PARAMS))


def test_bf16_batched(model_dir):
    llm = _llm(model_dir)
    outs = llm.generate(PROMPTS, PARAMS)
    # Near-ties are the exception: most prompts match to the last token.
    assert assert_bf16_parity(model_dir, PROMPTS, outs) <= len(PROMPTS) // 2
    assert llm.stats().num_steps < sum(len(o.token_ids) for o in outs) / 4


def test_bf16_chunked_prefill(model_dir):
    llm = _llm(model_dir, max_num_batched_tokens=32)
    assert max(len(p) for p in PROMPTS) > 32
    assert_bf16_parity(model_dir, PROMPTS, llm.generate(PROMPTS, PARAMS))


def test_bf16_prefix_cache_hits(model_dir):
    llm = _llm(model_dir, max_num_batched_tokens=64)
    first, *rest = _shared_prefix_prompts()
    assert_bf16_parity(model_dir, [first], llm.generate([first], PARAMS))
    outs = llm.generate(rest, PARAMS)
    assert all(o.num_cached_tokens >= 64 for o in outs)
    assert_bf16_parity(model_dir, rest, outs)


def test_bf16_plain_torch_path(model_dir, monkeypatch):
    """Without the compiled kernels and oneDNN, bf16 runs on plain torch ops, to the same parity."""
    from kvmesh.engine.kernels import cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setenv("KVMESH_ONEDNN", "0")
    llm = _llm(model_dir, max_num_batched_tokens=64)
    assert llm.engine.core.runner.cpu_ops is None
    assert_bf16_parity(model_dir, PROMPTS, llm.generate(PROMPTS, PARAMS))


def test_bf16_builtin_model(smollm2_dir):
    """The built-in model on a few chat prompts, batched."""
    from kvmesh.common.tokenizer import KVMeshTokenizer

    tok = KVMeshTokenizer(smollm2_dir)
    questions = ["What is the capital of France?", "List three fruits.", "Why is the sky blue?"]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    llm = _llm(smollm2_dir)
    # Head size 64: its prefills take the compiled prefill attention (the tiny models' 16 do not).
    assert llm.engine.core.runner.backend.cpu_prefill_attention
    assert_bf16_parity(smollm2_dir, prompts, llm.generate(prompts, PARAMS))
