"""The compiled decode stack (kernels/decode_stack_cpu.cpp) runs decode steps' layers in one call.

It must compute exactly what the Python layers compute: every decode step it covers is run both
ways on the same inputs and the logits compared bit for bit, on a Llama and a Qwen2 (biases) tiny
model in fp32 and bf16 and on SmolLM2 (the AVX-512 attention path), with row counts from 16 down to 1. Steps it
does not cover (prefill, more rows than the panels take) go to the layers.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine import SamplingParams
from kvmesh.engine.config import EngineArgs
from kvmesh.engine.kernels.onednn_linear import panel_max_rows
from kvmesh.engine.llm_engine import LLMEngine
from tests.engine.conftest import random_prompts


def _engine(model_dir: str, dtype: str = "float32") -> LLMEngine:
    engine = LLMEngine(EngineArgs(model=model_dir, dtype=dtype, num_kv_blocks=256))
    if engine.core.runner.model.decode_stack is None:
        pytest.fail("no decode stack: the CPU kernels failed to build or a linear has no panels")
    return engine


def _run_both_ways(engine: LLMEngine, num_requests: int, vocab: int) -> tuple[list[int], list[int]]:
    """Runs requests of staggered lengths to the end; every step is checked. Returns the row
    counts of the decode steps the stack ran and of those it left to the layers."""
    model = engine.core.runner.model
    forward = model.forward
    stacked, declined, mismatched = [], [], []

    def both(input_ids, positions, kv_caches, meta, logits_indices):
        out = forward(input_ids, positions, kv_caches, meta, logits_indices)
        rows = input_ids.shape[0]
        if not meta.all_decode:
            return out
        if not model._decode_stack_covers(model.embed_tokens(input_ids), meta):
            declined.append(rows)
            return out
        stack, model.decode_stack = model.decode_stack, None
        try:  # the layers rewrite the same K/V into the same slots: the cache ends up the same
            reference = forward(input_ids, positions, kv_caches, meta, logits_indices)
        finally:
            model.decode_stack = stack
        # recorded, not raised: the engine would fail the step's requests and carry on
        (stacked if torch.equal(out, reference) else mismatched).append(rows)
        return out

    model.forward = both
    try:
        for i, prompt in enumerate(random_prompts(num_requests, 5, 60, seed=11, vocab=vocab)):
            engine.add_request(
                prompt, SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True)
            )
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        model.forward = forward
    assert not mismatched, (
        f"the decode stack differs from the layers at these row counts: {mismatched}"
    )
    return stacked, declined


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_decode_stack_equals_the_layers_bit_for_bit(variant, dtype, request):
    engine = _engine(request.getfixturevalue(variant), dtype)
    # transformers initialises biases to zero, where a dropped bias would not show: make them count
    # (in place: the stack holds the same tensors).
    biases = [
        m.bias
        for m in engine.core.runner.model.modules()
        if getattr(m, "panels", None) is not None and m.bias is not None
    ]
    assert bool(biases) == (variant == "tiny_qwen2_dir")  # Qwen2's q/k/v projections have biases
    torch.manual_seed(0)
    for b in biases:
        b.normal_()
    most = panel_max_rows(getattr(torch, dtype))
    stacked, declined = _run_both_ways(engine, most + 4, 49152)
    assert set(range(1, most + 1)) <= set(stacked)  # every row count it takes, checked
    assert declined and min(declined) > most  # more rows than the panels take: the layers


def test_decode_stack_equals_the_layers_on_smollm2(smollm2_dir):
    engine = _engine(smollm2_dir)
    stacked, _ = _run_both_ways(engine, 6, engine.core.runner.config.vocab_size)
    assert set(stacked) == set(range(1, 7))


def test_decode_stack_can_be_turned_off(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("KVMESH_DECODE_STACK", "0")
    engine = LLMEngine(EngineArgs(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64))
    assert engine.core.runner.model.decode_stack is None
