"""Greedy fp32 outputs equal transformers' token for token, under every scheduling path.

Each case runs the same prompts through (a) one request, (b) one 16-request batch,
(c) chunked prefill with a 32-token step budget, (d) prefix-cache hits, (e) a KV pool
so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import pytest

from kvmesh.common.tokenizer import KVMeshTokenizer
from kvmesh.engine import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three fruits.",
    "How do I boil an egg?",
    "What is 12 times 7?",
    "Name a famous painter.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "What does a KV cache store?",
    "Describe a cat in one sentence.",
    "What is the boiling point of water?",
    "Suggest a name for a dog.",
    "What is photosynthesis?",
    "Translate 'hello' to Spanish.",
    "Tell me a fun fact about octopuses.",
]
LONG_SYSTEM = (
    "You are a careful assistant for a platform team that serves language models on "
    "Kubernetes. Answer briefly, prefer concrete commands, and never invent flags that "
    "do not exist. If a question is ambiguous, say what you assume before answering."
)


class Case:
    def __init__(
        self,
        name: str,
        model_dir: str,
        prompts: list[list[int]],
        shared: list[list[int]],
        max_new_tokens: int,
        ignore_eos: bool,
    ):
        self.name, self.model_dir, self.prompts, self.shared = name, model_dir, prompts, shared
        self.max_new_tokens, self.ignore_eos = max_new_tokens, ignore_eos

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_new_tokens, temperature=0.0, ignore_eos=self.ignore_eos
        )

    def expected(self, prompt: list[int]) -> list[int]:
        return hf_greedy(self.model_dir, prompt, self.max_new_tokens, self.ignore_eos)

    def llm(self, **engine_args) -> LLM:
        engine_args.setdefault("num_kv_blocks", 512)
        return LLM(self.model_dir, dtype="float32", **engine_args)


def _shared_prefix_prompts(seed: int) -> list[list[int]]:
    prefix = random_prompts(1, 70, 70, seed=seed)[0]
    suffixes = random_prompts(6, 6, 40, seed=seed + 1)
    return [prefix + s for s in suffixes]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "smollm2"])
def case(request) -> Case:
    if request.param == "smollm2":
        model_dir = request.getfixturevalue("smollm2_dir")
        tok = KVMeshTokenizer(model_dir)
        # Mixed lengths: some questions carry a preamble of growing size.
        contents = [
            q if i % 3 == 0 else f"{LONG_SYSTEM[: 18 * i]}\n{q}" for i, q in enumerate(QUESTIONS)
        ]
        prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in contents]
        shared = [
            tok.encode_chat(
                [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}]
            )
            for q in QUESTIONS[:6]
        ]
        return Case("smollm2", model_dir, prompts, shared, 32, ignore_eos=False)
    model_dir = request.getfixturevalue(request.param.replace("-", "_") + "_dir")
    prompts = random_prompts(16, 5, 200, seed=1)
    return Case(request.param, model_dir, prompts, _shared_prefix_prompts(7), 32, ignore_eos=True)


def _assert_same(case: Case, prompts, outputs) -> None:
    assert len(outputs) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.token_ids == case.expected(prompt), (
            f"{case.name}: prompt {i} diverged from transformers"
        )


def test_single_request(case):
    llm = case.llm()
    prompt = max(case.prompts, key=len)
    _assert_same(case, [prompt], llm.generate([prompt], case.params))


def test_batched_mixed_lengths(case):
    llm = case.llm()
    # The CPU fast path is what these tests prove: decode-size rows on the panel kernel, prefill
    # chunks on oneDNN (kernels/onednn_linear.py).
    assert llm.engine.core.runner.model.packed_lm_head.panels is not None
    assert llm.engine.core.runner.model.layers[0].mlp.down_proj.panels is not None
    assert len({len(p) for p in case.prompts}) > 8  # really mixed
    outs = llm.generate(case.prompts, case.params)
    _assert_same(case, case.prompts, outs)
    # All 16 ran together: far fewer steps than running them one by one.
    assert llm.stats().num_steps < sum(len(o.token_ids) for o in outs) / 4


def test_chunked_prefill(case):
    llm = case.llm(max_num_batched_tokens=32)
    assert max(len(p) for p in case.prompts) > 32  # some prompts must be split into chunks
    _assert_same(case, case.prompts, llm.generate(case.prompts, case.params))


def test_prefix_cache_hits(case):
    llm = case.llm(max_num_batched_tokens=64)
    first, rest = case.shared[0], case.shared[1:]
    _assert_same(case, [first], llm.generate([first], case.params))
    outs = llm.generate(rest, case.params)
    _assert_same(case, rest, outs)
    for prompt, out in zip(rest, outs):
        common = next(
            (i for i, (a, b) in enumerate(zip(first, prompt)) if a != b),
            min(len(first), len(prompt)),
        )
        expected_hit = min(common // 16, (len(prompt) - 1) // 16) * 16
        assert expected_hit >= 16
        assert out.num_cached_tokens == expected_hit
    # The same prompt again: everything but the last token's block is served from the cache.
    again = llm.generate([first], case.params)[0]
    assert again.num_cached_tokens == (len(first) - 1) // 16 * 16
    assert again.token_ids == case.expected(first)
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_hits <= stats.prefix_cache_queries


def test_preemption_by_recompute(case):
    llm = case.llm(num_kv_blocks=20, max_num_batched_tokens=256)
    prompts = [p for p in case.prompts if len(p) + case.max_new_tokens <= 20 * 16][:12]
    need = sum(-(-(len(p) + case.max_new_tokens) // 16) for p in prompts)
    assert need > 2 * 20  # the pool cannot hold them all
    outs = llm.generate(prompts, case.params)
    assert llm.stats().num_preemptions > 0
    _assert_same(case, prompts, outs)
    assert llm.stats().kv_cache_usage == 0.0  # everything freed at the end


def test_plain_torch_path(case, monkeypatch):
    """Without the compiled CPU kernels and the oneDNN linears (no compiler, KVMESH_CPU_KERNELS=0,
    KVMESH_ONEDNN=0, or a non-CPU device), the plain torch ops give the same tokens."""
    from kvmesh.engine.kernels import cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setenv("KVMESH_ONEDNN", "0")
    llm = case.llm(max_num_batched_tokens=64)
    assert llm.engine.core.runner.cpu_ops is None
    assert llm.engine.core.runner.model.packed_lm_head is None
    _assert_same(case, case.prompts, llm.generate(case.prompts, case.params))


@pytest.mark.parametrize("policy", ["sjf", "priority"])
def test_admission_order_changes_no_token(case, policy):
    """Shortest prompt first (aged after 2 passes) or by priority, under a 32-token budget and a
    pool small enough to preempt: who runs when changes, never a request's tokens."""
    llm = case.llm(
        num_kv_blocks=24,
        max_num_batched_tokens=32,
        scheduling_policy=policy,
        max_prefill_skips=2,
    )
    prompts = [p for p in case.prompts if len(p) + case.max_new_tokens <= 24 * 16][:12]
    priority = [(i * 7) % 3 for i in range(len(prompts))] if policy == "priority" else None
    outs = llm.generate(prompts, case.params, priority=priority)
    _assert_same(case, prompts, outs)
    assert llm.stats().kv_cache_usage == 0.0
