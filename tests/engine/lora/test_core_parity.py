"""Mixed batches of base and adapter requests equal transformers + PEFT token for token (greedy,
fp32) under every scheduling path: one batch, async scheduling, chunked prefill, prefix hits,
preemption and n-gram speculation, on each CPU attention backend; no step holds more than
max_loras adapters."""

from __future__ import annotations

import pytest

from kvmesh.engine import LLM, SamplingParams
from kvmesh.engine.lora.request import LoRARequest
from tests.engine.conftest import random_prompts
from tests.engine.lora.adapters import make_peft_adapter
from tests.engine.lora.conftest import ADAPTERS
from tests.engine.lora.reference import peft_greedy
from tests.tiny_models import build_tiny_model

MAX_NEW = 10
ORDER = (None, "attn", "mlp", "mixed")  # the adapter of prompt i is ORDER[i % 4]
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}

MODES = {
    "async": dict(num_kv_blocks=512, max_loras=2, async_scheduling=True),
    "batched": dict(num_kv_blocks=512, max_loras=3),
    "chunked": dict(num_kv_blocks=512, max_loras=2, max_num_batched_tokens=32),
    "prefix": dict(num_kv_blocks=512, max_loras=3, max_num_batched_tokens=64),
    "preempt": dict(num_kv_blocks=8, max_loras=2, max_num_batched_tokens=256),
    "spec": dict(num_kv_blocks=512, max_loras=3, speculative_config=SPEC),
}


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def lora_requests(adapter_dirs: dict[str, str], n: int) -> list[LoRARequest | None]:
    ids = {name: i + 1 for i, name in enumerate(sorted(adapter_dirs))}
    out = []
    for i in range(n):
        name = ORDER[i % len(ORDER)]
        out.append(None if name is None else LoRARequest(name, ids[name], adapter_dirs[name]))
    return out


def prompts_for(mode: str) -> list[list[int]]:
    if mode == "prefix":  # one long head, so that later requests of each adapter hit its blocks
        head = random_prompts(1, 40, 40, seed=5)[0]
        return [head + tail for tail in random_prompts(12, 3, 12, seed=6)]
    if mode == "spec":  # a 256-token vocabulary: n-gram lookups find the last tokens again
        return random_prompts(8, 8, 16, seed=7, vocab=256)
    if mode == "preempt":  # 2 to 3 blocks each, 8 blocks in all
        return random_prompts(8, 20, 40, seed=8)
    return random_prompts(8, 5, 30, seed=4)


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A 256-token-vocabulary base whose greedy output repeats its history, and its adapters."""
    root = tmp_path_factory.mktemp("lora-spec")
    base = str(build_tiny_model(root / "base", "tiny-llama-v256"))
    return base, {
        name: str(make_peft_adapter(root / name, base, r, t, seed, rslora=rs))
        for name, (r, t, seed, rs) in ADAPTERS.items()
    }


def record_steps(llm: LLM) -> list[set[str]]:
    """The adapters of each step's scheduled requests, recorded as the scheduler hands them out."""
    scheduler = llm.engine.core.scheduler
    schedule = scheduler.schedule
    steps: list[set[str]] = []

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append({r.lora.name for r in out.requests if r.lora is not None})
        return out

    scheduler.schedule = recording
    return steps


def assert_reference(base_dir, adapter_dirs, prompts, loras, outputs):
    for prompt, lora, out in zip(prompts, loras, outputs):
        name = None if lora is None else lora.lora_name
        expected = peft_greedy(base_dir, adapter_dirs, name, prompt, MAX_NEW)
        assert list(out.outputs[0].token_ids) == expected, lora


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_mixed_adapters_equal_peft(request, lora_base_dir, lora_adapter_dirs, mode, backend):
    if mode == "spec":
        lora_base_dir, lora_adapter_dirs = request.getfixturevalue("spec_model")
    kw = MODES[mode]
    llm = LLM(
        lora_base_dir,
        dtype="float32",
        enable_lora=True,
        max_cpu_loras=3,
        attention_backend=backend,
        **kw,
    )
    steps = record_steps(llm)
    prompts = prompts_for(mode)
    loras = lora_requests(lora_adapter_dirs, len(prompts))
    if mode == "prefix":  # one request per adapter first, then the rest read their blocks
        first = llm.generate(prompts[:4], greedy(), lora_request=loras[:4])
        assert_reference(lora_base_dir, lora_adapter_dirs, prompts[:4], loras[:4], first)
        outs = llm.generate(prompts[4:], greedy(), lora_request=loras[4:])
        assert_reference(lora_base_dir, lora_adapter_dirs, prompts[4:], loras[4:], outs)
        assert all(o.num_cached_tokens >= 32 for o in outs)
    else:
        outs = llm.generate(prompts, greedy(), lora_request=loras)
        assert_reference(lora_base_dir, lora_adapter_dirs, prompts, loras, outs)
    assert max(len(s) for s in steps) == kw["max_loras"]
    stats = llm.stats()
    if mode == "preempt":
        assert stats.num_preemptions > 0
    if mode == "async":
        assert llm.engine.core.num_async_steps > 0
    if mode == "spec":
        assert stats.spec_decode.num_draft_tokens > 0
    assert stats.running_lora_adapters == stats.waiting_lora_adapters == []
    core = llm.engine.core
    assert [core.loras.refcount(core.lora_adapter(e["name"])) for e in core.list_loras()] == [0] * 3
