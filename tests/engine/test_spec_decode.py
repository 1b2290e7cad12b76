"""Speculative decoding end to end: greedy output equals transformers' (and the engine's own
non-speculative output) token for token, batched, chunked, with prefix hits and preemption;
drafts really are accepted (each test checks the counters); stop / max_tokens / min_tokens /
logprobs / penalties behave as without speculation; KV events never carry an unverified
block; sampling keeps its distribution.

Models: SmolLM2 on copy-heavy chat prompts (a real model copies: most drafts are accepted), and
tiny random models with a 256-token vocabulary (tests/tiny_models.py): a Llama whose attention is
scaled down, so its output often continues its own history (drafts accepted and rejected), and a
Qwen2 at full strength, where nearly every draft is rejected.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported (no GPU here)

import math  # noqa: E402
import random  # noqa: E402
from collections import Counter  # noqa: E402

import pytest  # noqa: E402

from kvmesh.common.block_keys import block_key  # noqa: E402
from kvmesh.common.kv_events import BlockRemoved, BlockStored  # noqa: E402
from kvmesh.engine import LLM, SamplingParams  # noqa: E402
from tests.engine.conftest import hf_greedy  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    "acceptance_threshold": 0.0,
    "disable_by_batch_size": None,
}  # always draft: the paths get traffic
# Tiny random models rarely repeat a 2-gram: look up single tokens so drafts are proposed often.
SPEC_TINY = dict(SPEC, prompt_lookup_min=1, prompt_lookup_max=3)

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens, and wound the clockwork that turned the beam across the dark water.",
    "Our team ships a release every second Tuesday. Before each release we freeze the main branch, run the "
    "full test suite twice, and write a short note that lists every change a user might notice.",
    "To bake the bread, mix the flour, water, salt and yeast, then knead the dough for ten minutes. Let it "
    "rise for an hour, shape it into a loaf, and bake it at two hundred degrees for forty minutes.",
    "The river rises in the northern hills, flows past three old mills and a stone bridge, and reaches the "
    "sea at a wide estuary where herons fish in the shallow water at low tide.",
]
EDITS = [
    "changing every 'the' to 'a'",
    "in the past tense",
    "adding the word 'quietly' once",
    "without any change",
]
SYSTEM = (
    "You are a precise copy editor. You repeat the text you are given with only the edit asked for, "
    "and you never add comments before or after it."
)


@pytest.fixture(scope="module")
def smollm2_copy(smollm2_dir):
    from kvmesh.common.tokenizer import KVMeshTokenizer

    tok = KVMeshTokenizer(smollm2_dir)
    prompts = [
        tok.encode_chat(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Repeat this text {edit}:\n\n{p}"},
            ]
        )
        for p, edit in zip(PASSAGES, EDITS)
    ]
    return smollm2_dir, prompts


@pytest.fixture(scope="module")
def tiny_v256(tmp_path_factory):
    return {
        v: str(build_tiny_model(tmp_path_factory.mktemp(v), v))
        for v in ("tiny-llama-v256", "tiny-qwen2-v256")
    }


def tiny_prompts(n: int, seed: int, lo: int = 5, hi: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens: int, ignore_eos: bool = True, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, **kw)


def assert_hf(model_dir, prompts, outs, max_tokens, ignore_eos=True):
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.token_ids == hf_greedy(model_dir, p, max_tokens, ignore_eos), (
            f"prompt {i} diverged"
        )


def spec_stats(llm: LLM):
    return llm.stats().spec_decode


# -- parity with transformers ----------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["tiny-llama-v256", "tiny-qwen2-v256"])
@pytest.mark.parametrize("mode", ["batched", "chunked", "prefix", "preempt"])
def test_tiny_greedy_parity(tiny_v256, variant, mode):
    model_dir = tiny_v256[variant]
    prompts = tiny_prompts(12, seed=3)
    kw = {
        "batched": dict(num_kv_blocks=512),
        "chunked": dict(num_kv_blocks=512, max_num_batched_tokens=24),
        "prefix": dict(num_kv_blocks=512, max_num_batched_tokens=64),
        "preempt": dict(num_kv_blocks=20, max_num_batched_tokens=256),
    }[mode]
    if mode == "prefix":
        head = tiny_prompts(1, seed=9, lo=70, hi=70)[0]
        prompts = [head + p[:20] for p in prompts[:6]]
    if mode == "preempt":
        prompts = [p for p in prompts if len(p) + 48 <= 20 * 16][:10]
    llm = LLM(model_dir, dtype="float32", speculative_config=SPEC_TINY, **kw)
    if mode == "prefix":
        assert_hf(model_dir, prompts[:1], llm.generate(prompts[:1], greedy(48)), 48)
        outs = llm.generate(prompts[1:], greedy(48))
        assert_hf(model_dir, prompts[1:], outs, 48)
        assert all(o.num_cached_tokens >= 64 for o in outs)
    else:
        assert_hf(model_dir, prompts, llm.generate(prompts, greedy(48)), 48)
    s = spec_stats(llm)
    if variant == "tiny-llama-v256":  # weak attention: its output continues its history
        assert s.num_draft_tokens > s.num_accepted_tokens > 0  # drafts were accepted, and rejected
    else:  # full-strength attention: drafts are proposed and (nearly all) rejected
        assert s.num_draft_tokens > 100
    if mode == "preempt":
        assert llm.stats().num_preemptions > 0
    if mode == "chunked":
        assert llm.stats().num_steps > 0


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_tiny_greedy_parity_on_every_attention_backend(tiny_v256, backend):
    """Verification rows (the last verified token and its drafts, each giving logits) through each
    backend's attention metadata, chunked and after a prefix hit; Triton under the interpreter."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
    model_dir = tiny_v256["tiny-llama-v256"]
    head = tiny_prompts(1, seed=9, lo=40, hi=40)[0]
    prompts = [head + p[:20] for p in tiny_prompts(6, seed=3)]
    llm = LLM(
        model_dir,
        dtype="float32",
        speculative_config=SPEC_TINY,
        attention_backend=backend,
        num_kv_blocks=256,
        max_num_batched_tokens=32,
    )
    assert llm.engine.core.runner.backend.name == backend
    assert_hf(model_dir, prompts[:1], llm.generate(prompts[:1], greedy(40)), 40)
    assert_hf(model_dir, prompts[1:], llm.generate(prompts[1:], greedy(40)), 40)
    s = spec_stats(llm)
    assert s.num_draft_tokens > s.num_accepted_tokens > 0
    assert llm.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("mode", ["batched", "chunked", "prefix", "preempt"])
def test_smollm2_copy_parity(smollm2_copy, mode):
    model_dir, prompts = smollm2_copy
    kw = {
        "batched": dict(num_kv_blocks=512),
        "chunked": dict(num_kv_blocks=512, max_num_batched_tokens=32),
        "prefix": dict(num_kv_blocks=512),
        "preempt": dict(num_kv_blocks=24, max_model_len=384),
    }[mode]
    llm = LLM(model_dir, dtype="float32", speculative_config=SPEC, **kw)
    if mode == "prefix":  # the system prompt's blocks are hits for the later requests
        assert_hf(model_dir, prompts[:1], llm.generate(prompts[:1], greedy(48, False)), 48, False)
        outs = llm.generate(prompts[1:], greedy(48, False))
        assert_hf(model_dir, prompts[1:], outs, 48, False)
        assert all(o.num_cached_tokens >= 32 for o in outs)
    else:
        outs = llm.generate(prompts, greedy(48, False))
        assert_hf(model_dir, prompts, outs, 48, False)
    s = spec_stats(llm)
    assert (
        s.num_accepted_tokens > 0.5 * s.num_draft_tokens > 0
    )  # a real model copies: most are accepted
    assert s.accepted_per_pos[3] > 0  # whole drafts (4 tokens + a bonus) went through
    if mode == "preempt":
        assert llm.stats().num_preemptions > 0
    # Fewer steps than tokens: the point of it.
    assert llm.stats().num_steps < sum(len(o.token_ids) for o in outs)


# -- behaves exactly as without speculation ---------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(smollm2_copy):
    model_dir, prompts = smollm2_copy
    return (
        LLM(model_dir, dtype="float32", num_kv_blocks=512),
        LLM(model_dir, dtype="float32", num_kv_blocks=512, speculative_config=SPEC),
        prompts,
    )


def _same(pair, params: SamplingParams, prompts=None):
    plain, spec, default_prompts = pair
    prompts = prompts or default_prompts
    before = spec_stats(spec).num_accepted_tokens
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    for x, y in zip(a, b):
        assert y.token_ids == x.token_ids and y.text == x.text
        assert (y.finish_reason, y.outputs[0].stop_reason) == (
            x.finish_reason,
            x.outputs[0].stop_reason,
        )
    assert spec_stats(spec).num_accepted_tokens > before  # speculation was really at work
    return a, b


def test_max_tokens(pair):
    for n in (3, 6, 11):
        a, _ = _same(pair, greedy(n))
        assert all(len(o.token_ids) == n and o.finish_reason == "length" for o in a)


def test_stop_token_inside_an_accepted_run(pair):
    plain, spec, prompts = pair
    ref = plain.generate(prompts, greedy(40))
    # A token the copy emits well into its output: with drafts of 4, it lands inside an accepted run.
    stops = [o.token_ids[17] for o in ref]
    for prompt, stop in zip(prompts, stops):
        a, b = _same(pair, greedy(40, stop_token_ids=[stop]), [prompt])
        assert a[0].finish_reason == "stop" and a[0].outputs[0].stop_reason == stop
        assert len(a[0].token_ids) <= 18


def test_stop_string(pair):
    plain, _, prompts = pair
    ref = plain.generate(prompts, greedy(40))
    for prompt, out in zip(prompts, ref):
        word = out.text[len(out.text) // 2 :].split()[1]  # a word from the middle of the copy
        a, _ = _same(pair, greedy(40, stop=[word]), [prompt])
        assert a[0].finish_reason == "stop" and word not in a[0].text


def test_min_tokens(pair):
    plain, _, prompts = pair
    ref = plain.generate(prompts, greedy(30))
    stop = ref[0].token_ids[3]  # would stop at output 4, but min_tokens holds it back
    a, _ = _same(pair, greedy(30, stop_token_ids=[stop], min_tokens=12), prompts[:1])
    assert len(a[0].token_ids) >= 12


def test_logprobs(pair):
    plain, spec, prompts = pair
    params = greedy(24, logprobs=3)
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        lx, ly = x.outputs[0].logprobs, y.outputs[0].logprobs
        assert len(lx) == len(ly) == len(x.token_ids)
        for p, q in zip(lx, ly):
            assert (p.token_id, p.rank) == (q.token_id, q.rank)
            assert [t for t, _ in p.top] == [t for t, _ in q.top]
            assert math.isclose(p.logprob, q.logprob, abs_tol=1e-3)


@pytest.mark.parametrize(
    "penalty",
    [dict(repetition_penalty=1.05), dict(frequency_penalty=0.2), dict(presence_penalty=0.3)],
)
def test_penalties(pair, penalty):
    # Penalties fight copying, so drafts are rejected more often; the outputs must still agree.
    _same(pair, greedy(32, **penalty))


# -- KV events and the prefix cache --------------------------------------------------------------------------
def test_kv_events_and_prefix_cache_never_see_unverified_tokens(smollm2_copy):
    model_dir, prompts = smollm2_copy
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=512,
        speculative_config=SPEC,
        enable_kv_events=True,
    )
    core = llm.engine.core
    params = greedy(48, False)
    finals: dict[str, list[int]] = {}
    ids = [llm.engine.add_request(p, params) for p in prompts]
    events = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        events += core.take_kv_events()
        # Every cached block of every running request holds verified tokens only.
        for req in core.scheduler.running:
            n = core.kv.num_cached_blocks[req.request_id]
            assert n * 16 <= req.num_tokens
            blocks = core.kv.req_blocks[req.request_id][:n]
            assert [b.key for b in blocks if b.key is not None] == [
                k for b, k in zip(blocks, req.block_keys(n)) if b.key is not None
            ]
            finals[req.request_id] = req.all_token_ids
    assert spec_stats(llm).num_draft_tokens > spec_stats(llm).num_accepted_tokens > 0
    assert not [e for e in events if isinstance(e, BlockRemoved)]  # nothing stored was taken back
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored
    # Each stored block's tokens are a block of some request's final (verified) tokens, at its place
    # in the chain: the keys recomputed from the tokens are the keys the engine announced.
    chains = {}
    for toks in finals.values():
        for k, key in enumerate(_keys(core, toks)):
            chains[key] = toks[k * 16 : (k + 1) * 16]
    for e in stored:
        parent = e.parent_block_hash
        for i, key in enumerate(e.block_hashes):
            toks = e.token_ids[i * 16 : (i + 1) * 16]
            assert chains.get(key) == toks
            assert block_key(parent if parent is not None else _root(core), toks) == key
            parent = key
    assert set(ids)


def _root(core):
    from kvmesh.common.block_keys import root_key

    return root_key(core.model_id, None)


def _keys(core, toks):
    keys, parent = [], _root(core)
    for k in range(len(toks) // 16):
        parent = block_key(parent, toks[k * 16 : (k + 1) * 16])
        keys.append(parent)
    return keys


# -- when it pays ----------------------------------------------------------------------------------------------
def test_disable_by_batch_size(smollm2_copy):
    model_dir, prompts = smollm2_copy
    same_len = [prompts[0]] * 3  # three requests that run together to the end
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=512,
        speculative_config=dict(SPEC, disable_by_batch_size=3),
    )
    llm.generate(same_len, greedy(16))
    s = spec_stats(llm)
    assert s.num_drafts == 0 and s.num_steps_disabled_by_batch > 0
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=512,
        speculative_config=dict(SPEC, disable_by_batch_size=4),
    )
    llm.generate(same_len, greedy(16))
    assert spec_stats(llm).num_accepted_tokens > 0


def test_low_acceptance_turns_speculation_off_per_request(tiny_v256):
    """Random weights hardly ever accept a draft: after acceptance_min_drafts verifications the
    request stops drafting, re-probing now and then; with the rule off it drafts all along."""
    model_dir = tiny_v256["tiny-llama-v256"]
    prompts = tiny_prompts(4, seed=11, lo=100, hi=150)
    always = LLM(model_dir, dtype="float32", num_kv_blocks=512, speculative_config=SPEC_TINY)
    ruled = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=512,
        speculative_config=dict(
            SPEC_TINY, acceptance_threshold=0.3, acceptance_min_drafts=3, reprobe_interval=8
        ),
    )
    a = always.generate(prompts, greedy(96))
    b = ruled.generate(prompts, greedy(96))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    sa, sb = spec_stats(always), spec_stats(ruled)
    assert sa.num_accepted_tokens < 0.3 * sa.num_draft_tokens  # low acceptance indeed
    assert sb.num_drafts < sa.num_drafts / 2


# -- sampling keeps its distribution ------------------------------------------------------------------------
def _chi2_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    na, nb = sum(a.values()), sum(b.values())
    cells = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest_a = na - sum(a[k] for k in cells)
    rest_b = nb - sum(b[k] for k in cells)
    obs = [(a[k], b[k]) for k in cells] + ([(rest_a, rest_b)] if rest_a + rest_b > 0 else [])
    stat = 0.0
    for x, y in obs:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, max(len(obs) - 1, 1)


def test_sampling_distribution_on_the_tiny_model(tmp_path_factory):
    """Temperature sampling with drafts vs without, 600 samples each: the distribution of each of
    the first output positions agrees (two-sample chi-square at p = 0.001), while drafts were both
    accepted and rejected along the way.

    The model has no attention (its next-token distribution depends on the current token only) and
    the prompt is its own greedy chain, so a draft (what followed the current token in the prompt)
    is the likeliest next token: accepted often, rejected often enough."""
    from tests.engine.test_spec_units import _chi2_critical

    model_dir = str(build_tiny_model(tmp_path_factory.mktemp("noattn"), "tiny-llama-v256-noattn"))
    plain = LLM(model_dir, dtype="float32", num_kv_blocks=2048, max_num_seqs=600, seed=1)
    prompt = [7] + plain.generate([[7]], greedy(60))[0].token_ids
    params = SamplingParams(n=600, max_tokens=5, temperature=1.0, top_k=4, ignore_eos=True)
    spec = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=2048,
        max_num_seqs=600,
        seed=2,
        speculative_config=SPEC_TINY,
    )
    a = plain.generate([prompt], params)[0].outputs
    b = spec.generate([prompt], params)[0].outputs
    s = spec_stats(spec)
    assert 0.9 * s.num_draft_tokens > s.num_accepted_tokens > 200, s
    for pos in range(1, 5):  # position 0 comes from the prompt's step: no drafts there
        stat, df = _chi2_two_sample(
            Counter(o.token_ids[pos] for o in a), Counter(o.token_ids[pos] for o in b)
        )
        assert stat < _chi2_critical(df), (pos, stat, df)
