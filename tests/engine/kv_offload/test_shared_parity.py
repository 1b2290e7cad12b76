"""The shared tier in the engine: a prefix one engine wrote is served to another, exactly.

Greedy fp32 on a tiny random-weight model: engine A computes prompts and writes the shared
directory; engine B, fresh, on the same directory, serves their prefixes from it (checked by
``cached_tokens_by_medium``) with the tokens of a cold run and of transformers, under chunked
prefill and preemption; a damaged entry is recomputed; a store of another layout is ignored.
"""

from __future__ import annotations

import pytest

from kvmesh.common.kv_events import BlockStored
from kvmesh.engine import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts

BS = 16
MAX_NEW = 12
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


def _prompts(n: int, seed: int) -> list[list[int]]:
    prefix = random_prompts(1, 80, 80, seed=seed)[0]
    return [prefix + s for s in random_prompts(n, 5, 40, seed=seed + 1)]


def _engine(model_dir, shared_dir, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    return LLM(model_dir, dtype="float32", kv_shared_dir=str(shared_dir), kv_shared_size=0.05, **kw)


def _write(model_dir, shared_dir, prompts, **kw) -> LLM:
    """Engine A: compute the prompts, wait for its writes."""
    a = _engine(model_dir, shared_dir, **kw)
    a.generate(prompts, PARAMS)
    a.engine.core.tiers.shared.flush()
    return a


def _assert_exact(model_dir, prompts, outs) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == hf_greedy(model_dir, prompt, MAX_NEW, True), f"prompt {i}"


def _shared_tokens(out) -> int:
    return out.num_cached_tokens_by_medium["SHARED"]


def test_another_engine_serves_the_prefix_from_the_shared_tier(model_dir, tmp_path):
    prompt = _prompts(1, seed=3)[0]
    a = _write(model_dir, tmp_path, [prompt], enable_kv_events=True)
    stored = [e for e in a.engine.core.take_kv_events() if isinstance(e, BlockStored)]
    shared_keys = [k for e in stored if e.medium == "SHARED" for k in e.block_hashes]
    assert len(shared_keys) == len(prompt) // BS  # every full prompt block, once
    b = _engine(model_dir, tmp_path)
    out = b.generate([prompt], PARAMS)[0]
    hit = (len(prompt) - 1) // BS * BS
    assert _shared_tokens(out) == hit and out.num_cached_tokens == hit
    assert out.num_cached_tokens_by_medium["GPU"] == 0
    _assert_exact(model_dir, [prompt], [out])
    stats = b.stats().kv_tiers
    assert stats.hit_tokens["SHARED"] == hit and stats.costs["SHARED"] > 0


def test_chunked_prefill_and_batching_over_shared_hits(model_dir, tmp_path):
    prompts = _prompts(6, seed=5)
    _write(model_dir, tmp_path, prompts[:2])
    b = _engine(model_dir, tmp_path, max_num_batched_tokens=32)
    outs = b.generate(prompts, PARAMS)
    _assert_exact(model_dir, prompts, outs)
    assert _shared_tokens(outs[0]) == (len(prompts[0]) - 1) // BS * BS
    assert all(
        _shared_tokens(o) + o.num_cached_tokens_by_medium["GPU"] >= 80 // BS * BS for o in outs[1:]
    )


def test_preemption_with_shared_hits(model_dir, tmp_path):
    prompts = _prompts(8, seed=9)
    _write(model_dir, tmp_path, prompts[:3])
    b = _engine(model_dir, tmp_path, num_kv_blocks=16, max_num_batched_tokens=256)
    outs = b.generate(prompts, PARAMS)
    assert b.stats().num_preemptions > 0
    _assert_exact(model_dir, prompts, outs)
    assert sum(_shared_tokens(o) for o in outs) > 0


def test_a_damaged_entry_is_recomputed(model_dir, tmp_path):
    prompt = _prompts(1, seed=11)[0]
    a = _write(model_dir, tmp_path, [prompt])
    store = a.engine.core.tiers.shared
    key = list(store._lru)[2]  # written in chain order: the third block of the prompt
    path = store.path_of(key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    b = _engine(model_dir, tmp_path)
    out = b.generate([prompt], PARAMS)[0]
    _assert_exact(model_dir, [prompt], [out])
    assert _shared_tokens(out) == 2 * BS  # the blocks before the damaged one
    shared = b.engine.core.tiers.shared
    assert shared.stats["corrupt"] == 1
    shared.flush()  # B computed the block again and wrote it through: whole again
    assert path.read_bytes() != bytes(data) and shared.read(key) is not None


@pytest.mark.parametrize(
    "other", [{"block_size": 32}, {"served_model_name": "another-model"}], ids=["bs", "model"]
)
def test_a_store_of_another_layout_or_model_is_ignored(model_dir, tmp_path, other):
    prompt = _prompts(1, seed=13)[0]
    _write(model_dir, tmp_path, [prompt], **other)
    b = _engine(model_dir, tmp_path)
    out = b.generate([prompt], PARAMS)[0]
    assert _shared_tokens(out) == 0 and out.num_cached_tokens == 0
    _assert_exact(model_dir, [prompt], [out])


def test_async_scheduling_writes_and_reads_the_shared_tier(model_dir, tmp_path):
    prompts = _prompts(3, seed=17)
    _write(model_dir, tmp_path, prompts[:1], async_scheduling=True)
    b = _engine(model_dir, tmp_path, async_scheduling=True, max_num_batched_tokens=32)
    outs = b.generate(prompts, PARAMS)
    assert b.engine.core.num_async_steps > 0
    _assert_exact(model_dir, prompts, outs)
    assert _shared_tokens(outs[0]) == (len(prompts[0]) - 1) // BS * BS


def test_an_unwritable_directory_serves_on(model_dir, tmp_path):
    (tmp_path / "file").write_text("")
    prompt = _prompts(1, seed=19)[0]
    a = _engine(model_dir, tmp_path / "file" / "kv")
    assert a.engine.core.tiers.shared.problem
    _assert_exact(model_dir, [prompt], a.generate([prompt], PARAMS))


def test_host_and_shared_tiers_together(model_dir, tmp_path):
    """The shared tier serves what a fresh engine never computed; once unrelated prompts have
    pushed those blocks out of its small KV cache, the host tier serves them; all exact."""
    prompt = _prompts(1, seed=23)[0]
    others = random_prompts(3, 120, 150, seed=29)
    _write(model_dir, tmp_path, [prompt])
    b = _engine(model_dir, tmp_path, num_kv_blocks=24, kv_offloading_size=0.01)
    first = b.generate([prompt], PARAMS)[0]
    hit = (len(prompt) - 1) // BS * BS
    assert _shared_tokens(first) == hit
    outs = [b.generate([p], PARAMS)[0] for p in others]  # evict the prompt's blocks to the host
    again = b.generate([prompt], PARAMS)[0]
    assert again.num_cached_tokens_by_medium["CPU"] > 0 and again.num_cached_tokens == hit
    _assert_exact(model_dir, [prompt, *others, prompt], [first, *outs, again])
