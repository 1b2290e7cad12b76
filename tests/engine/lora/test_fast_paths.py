"""Which paths run a step with adapter rows: the compiled decode stack and the CUDA graphs (full
and piecewise) step aside for it, and take base-only steps again after; an engine that never
sees an adapter row never installs the LoRA context."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported

import pytest  # noqa: E402

from tests.engine.conftest import random_prompts  # noqa: E402
from tests.engine.lora.reference import peft_greedy  # noqa: E402
from tests.engine.lora.test_lora_parity import (  # noqa: E402
    MIX,
    NEW_TOKENS,
    check,
    generate,
    jobs_of,
    make_core,
)
from tests.engine.test_gpu_execution import FakeGraphAPI  # noqa: E402


class CountingStack:
    """The compiled decode stack, its forward calls counted."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def set_kv_caches(self, *a):
        self.stack.set_kv_caches(*a)

    def forward(self, *a):
        self.calls += 1
        return self.stack.forward(*a)


def _base_only(core, base_dir, adapter_dirs, seed):
    prompts = random_prompts(3, 4, 20, seed=seed)
    got = generate(core, [(p, None) for p in prompts])
    assert got == [peft_greedy(base_dir, adapter_dirs, None, p, NEW_TOKENS) for p in prompts]


def test_decode_stack_steps_aside_for_adapter_rows(lora_base_dir, lora_adapter_dirs):
    core = make_core(lora_base_dir, attention_backend="cpu")
    model = core.runner.model
    if model.decode_stack is None:
        pytest.skip("the compiled CPU kernels (decode stack) are not built here")
    model.decode_stack = stack = CountingStack(model.decode_stack)
    _base_only(core, lora_base_dir, lora_adapter_dirs, seed=3)
    assert stack.calls > 0 and model.lora is None  # no LoRA context without an adapter row
    before = stack.calls
    check(core, lora_base_dir, lora_adapter_dirs, jobs_of(["attn", "mixed", "mlp"], seed=4))
    assert stack.calls == before and model.lora is not None
    _base_only(core, lora_base_dir, lora_adapter_dirs, seed=5)
    assert stack.calls > before and model.lora.rows is None


def test_cuda_graphs_step_aside_for_adapter_rows(lora_base_dir, lora_adapter_dirs):
    pytest.importorskip("triton")
    core = make_core(lora_base_dir, attention_backend="triton", num_kv_blocks=64, max_num_seqs=4)
    runner = core.runner
    runner.capture_cuda_graphs(
        4, core.max_model_len, api=FakeGraphAPI(), decode=True, piecewise_sizes=[8, 16, 32, 64]
    )
    _base_only(core, lora_base_dir, lora_adapter_dirs, seed=6)
    full, piecewise = runner.graphs.num_replays, runner.piecewise.num_replays
    assert full > 0 and piecewise > 0
    check(core, lora_base_dir, lora_adapter_dirs, jobs_of(["mixed", None, "attn", "mlp"], seed=7))
    assert (runner.graphs.num_replays, runner.piecewise.num_replays) == (full, piecewise)
    _base_only(core, lora_base_dir, lora_adapter_dirs, seed=8)
    assert runner.graphs.num_replays > full and runner.piecewise.num_replays > piecewise


def test_mixed_batch_with_every_cpu_fast_path(lora_base_dir, lora_adapter_dirs):
    # The default CPU engine: fused ops, oneDNN / panel linears, compiled attention.
    core = make_core(lora_base_dir)
    check(core, lora_base_dir, lora_adapter_dirs, jobs_of(MIX + MIX, seed=9))
