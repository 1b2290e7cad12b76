"""Batches mixing base rows and rows of three adapters give transformers + peft's fp32 greedy
tokens, token for token: in several orders, through prefill, chunked prefill and decode steps,
on every CPU attention backend, with the CPU fast paths on."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported

import random  # noqa: E402

import pytest  # noqa: E402

from kvmesh.engine import SamplingParams  # noqa: E402
from kvmesh.engine.config import EngineArgs  # noqa: E402
from kvmesh.engine.engine_core import EngineCore  # noqa: E402
from kvmesh.engine.lora import step  # noqa: E402
from kvmesh.engine.lora.adapter import load_adapter  # noqa: E402
from kvmesh.engine.lora.request import LoRARequest  # noqa: E402
from kvmesh.engine.request import Request  # noqa: E402
from tests.engine.conftest import random_prompts  # noqa: E402
from tests.engine.lora.adapters import make_peft_adapter  # noqa: E402
from tests.engine.lora.reference import peft_greedy, peft_greedy_logprobs  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

NEW_TOKENS = 6


def make_core(base_dir, **args) -> EngineCore:
    args.setdefault("num_kv_blocks", 256)
    return EngineCore(EngineArgs(model=base_dir, dtype="float32", **args))


def load_all(core: EngineCore, adapter_dirs: dict[str, str]) -> dict:
    return {
        name: load_adapter(LoRARequest(name, i + 1, path), core.model_config, 16)
        for i, (name, path) in enumerate(sorted(adapter_dirs.items()))
    }


def generate(core: EngineCore, jobs: list[tuple[list[int], object]], logprobs=None) -> list:
    """Greedy outputs of (prompt, adapter or None) jobs, all queued at once; with ``logprobs``
    (a list), each job's sampled tokens' logprobs are appended to it."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, (prompt, adapter) in enumerate(jobs):
        core.scheduler.add_request(
            Request(
                str(i),
                prompt,
                params,
                core.eos_token_ids,
                core.model_id,
                core.block_size,
                core.max_model_len,
                lora=adapter,
            )
        )
    out: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    lps: dict[str, list[float]] = {str(i): [] for i in range(len(jobs))}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend(lp.logprob for lp in o.new_logprobs)
    if logprobs is not None:
        logprobs.extend(lps[str(i)] for i in range(len(jobs)))
    return [out[str(i)] for i in range(len(jobs))]


def jobs_of(names: list[str | None], seed: int) -> list[tuple[list[int], str | None]]:
    prompts = random_prompts(len(names), 3, 40, seed=seed)
    return list(zip(prompts, names))


def check(core, base_dir, adapter_dirs, named_jobs):
    """Each (prompt, adapter name or None) job's greedy tokens and their logprobs equal peft's."""
    adapters = load_all(core, adapter_dirs)
    lps: list[list[float]] = []
    got = generate(core, [(p, adapters.get(n)) for p, n in named_jobs], lps)
    for (prompt, name), tokens, logprobs in zip(named_jobs, got, lps):
        want, want_lps = peft_greedy_logprobs(base_dir, adapter_dirs, name, prompt, NEW_TOKENS)
        assert tokens == list(want), name
        assert logprobs == pytest.approx(want_lps, abs=2e-4), name


MIX = [None, "attn", "mlp", "mixed", None, "mixed", "attn", "mlp", "attn"]


@pytest.mark.parametrize("rows", ["default", "all stacked", "all grouped"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_batch_matches_peft_on_each_backend(
    backend, rows, lora_base_dir, lora_adapter_dirs, monkeypatch
):
    if backend == "triton":
        pytest.importorskip("triton")
    # Short steps run their adapters stacked, long ones grouped (lora/step.py): each way alone.
    limit = {"default": step.STACKED_MAX_ROWS, "all stacked": 10**6, "all grouped": 0}[rows]
    monkeypatch.setattr(step, "STACKED_MAX_ROWS", limit)
    core = make_core(lora_base_dir, attention_backend=backend)
    check(core, lora_base_dir, lora_adapter_dirs, jobs_of(MIX, seed=1))


@pytest.mark.parametrize("order_seed", [0, 1, 2])
def test_orders_and_chunked_prefill_match_peft(order_seed, lora_base_dir, lora_adapter_dirs):
    names = list(MIX)
    random.Random(order_seed).shuffle(names)
    # A 24-token budget splits prompts into chunks that share steps with other rows' decodes.
    core = make_core(lora_base_dir, max_num_batched_tokens=24, max_num_seqs=5)
    check(core, lora_base_dir, lora_adapter_dirs, jobs_of(names, seed=10 + order_seed))


def test_same_prompt_under_each_adapter(lora_base_dir, lora_adapter_dirs):
    # The same prompt in one batch: base rows and adapter rows must not share cached blocks.
    prompt = random_prompts(1, 33, 33, seed=5)[0]
    core = make_core(lora_base_dir)
    jobs = [(prompt, n) for n in (None, "attn", "mlp", "mixed", None, "mixed")]
    check(core, lora_base_dir, lora_adapter_dirs, jobs)
    outs = {
        n: peft_greedy(lora_base_dir, lora_adapter_dirs, n, prompt, NEW_TOKENS) for _, n in jobs
    }
    assert len({tuple(v) for v in outs.values()}) > 1  # the adapters change the output


def test_qwen2_adapters_match_peft(qwen2_lora):
    base_dir, adapter_dirs = qwen2_lora
    core = make_core(base_dir)
    check(core, base_dir, adapter_dirs, jobs_of(["qa", None, "qb", "qb", "qa", None], seed=20))


def test_draft_verification_rows_run_with_their_adapter(tmp_path):
    # A 256-token model whose output continues its history: the n-gram proposer finds drafts,
    # whose verification rows give logits (accepted or not) with the request's adapter.
    base = str(build_tiny_model(tmp_path / "base", "tiny-llama-v256"))
    adapter_dirs = {
        "a": str(make_peft_adapter(tmp_path / "a", base, 4, ["q_proj", "o_proj", "up_proj"], 31)),
        "b": str(make_peft_adapter(tmp_path / "b", base, 2, ["v_proj", "down_proj"], 32)),
    }
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    core = make_core(base, speculative_config=dict(spec, prompt_lookup_max=3))
    prompts = random_prompts(6, 20, 30, seed=30, vocab=256)
    check(core, base, adapter_dirs, list(zip(prompts, ["a", None, "b", "b", "a", None])))
    assert core.stats().spec_decode.num_draft_tokens > 0


def test_async_scheduling_matches_peft(lora_base_dir, lora_adapter_dirs):
    core = make_core(lora_base_dir, async_scheduling=True)
    check(core, lora_base_dir, lora_adapter_dirs, jobs_of(MIX, seed=40))
