"""Piecewise CUDA graphs (engine/piecewise_graphs.py) proven on the CPU: the Triton kernels under
the interpreter, graph capture stubbed at GraphAPI (each "replay" reruns the captured piece into
its static output). Prefill, chunked, mixed, draft-verification and prompt-logprob steps replay
the pieces of their padded token count with attention between them, and give transformers'
greedy tokens and the eager path's logprobs; padding rows write nothing to the KV cache."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kvmesh.engine import LLM, SamplingParams  # noqa: E402
from kvmesh.engine import attention_backends as ab  # noqa: E402
from kvmesh.engine.compilation_config import CompilationConfig, piecewise_sizes  # noqa: E402
from kvmesh.engine.config import EngineArgs  # noqa: E402
from tests.engine.conftest import hf_greedy, random_prompts  # noqa: E402
from tests.engine.test_gpu_execution import FakeGraphAPI  # noqa: E402
from tests.engine.test_prompt_logprobs import assert_matches_hf  # noqa: E402
from tests.engine.test_spec_decode import SPEC_TINY, tiny_prompts  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

needs_triton = pytest.mark.skipif(not ab.triton_available(), reason="triton is not installed")
SIZES = [8, 16, 32, 64]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def piecewise_llm(model_dir: str, decode_graphs: bool = False, sizes=SIZES, **kw):
    """An engine on the Triton backend with piecewise graphs captured through the stub."""
    llm = LLM(
        model_dir,
        dtype="float32",
        attention_backend="triton",
        **{"num_kv_blocks": 64, "max_num_seqs": 4, **kw},
    )
    runner = llm.engine.core.runner
    api = FakeGraphAPI()
    runner.capture_cuda_graphs(
        4, llm.engine.core.max_model_len, api=api, decode=decode_graphs, piecewise_sizes=sizes
    )
    return llm, runner, api


# -- the ladder and the config -------------------------------------------------------------------
def test_piecewise_sizes_ladder():
    sizes = piecewise_sizes(2048)
    assert sizes[:5] == [8, 16, 32, 64, 128] and sizes[-1] == 2048
    assert 512 in sizes and 640 in sizes and 1280 in sizes
    assert sizes == sorted(set(sizes))
    # Above 512 tokens a step is padded by less than a fifth.
    for n in range(513, 2049):
        padded = next(s for s in sizes if s >= n)
        assert (padded - n) / padded < 0.2, n
    assert piecewise_sizes(8) == [8] and piecewise_sizes(20) == [8, 16, 20]
    assert piecewise_sizes(576)[-2:] == [512, 576]


def test_compilation_config_parses_vllm_spelling_and_names_bad_fields():
    assert CompilationConfig.parse(None).cudagraph_mode == "FULL_AND_PIECEWISE"
    c = CompilationConfig.parse(
        '{"cudagraph_mode": "piecewise", "max_cudagraph_capture_size": 256}'
    )
    assert c.cudagraph_mode == "PIECEWISE" and not c.full_decode
    assert c.piecewise_token_sizes(2048) == piecewise_sizes(256)
    assert (
        CompilationConfig.parse({"cudagraph_mode": "FULL_DECODE_ONLY"}).piecewise_token_sizes(2048)
        == []
    )
    assert CompilationConfig.parse({"cudagraph_mode": "NONE"}).full_decode is False
    default = CompilationConfig.parse({})
    assert default.full_decode and default.piecewise_token_sizes(512) == piecewise_sizes(512)
    assert default.piecewise_token_sizes(8192)[-1] == 2048  # the default top
    explicit = CompilationConfig.parse({"cudagraph_capture_sizes": [64, 16, 16, 512]})
    assert explicit.piecewise_token_sizes(256) == [16, 64]
    for bad, field in [
        ('{"cudagraph_mode": "FULL"}', "FULL_DECODE_ONLY"),
        ("[1]", "JSON object"),
        ('{"level": 3}', "unknown field"),
        ("{", "not JSON"),
        ('{"cudagraph_capture_sizes": [0]}', "cudagraph_capture_sizes"),
        ('{"max_cudagraph_capture_size": true}', "max_cudagraph_capture_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            CompilationConfig.parse(bad)
    args = EngineArgs(compilation_config='{"cudagraph_mode": "NONE"}')
    args.validate()
    assert args.compilation_config.cudagraph_mode == "NONE"


def test_cli_flag_parses_and_rejects():
    import argparse

    from kvmesh.engine.cli_args import add_engine_arguments, engine_args_from

    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    args = ap.parse_args(
        ["--model", "m", "--compilation-config", '{"cudagraph_mode": "PIECEWISE"}']
    )
    assert engine_args_from(args).compilation_config.cudagraph_mode == "PIECEWISE"
    with pytest.raises(SystemExit):
        ap.parse_args(["--model", "m", "--compilation-config", '{"cudagraph_mode": "FAST"}'])


# -- the engine through the pieces -----------------------------------------------------------------
@needs_triton
def test_captures_every_piece_of_every_size_without_touching_the_cache(tiny_llama_dir):
    llm, runner, api = piecewise_llm(tiny_llama_dir)
    layers = len(runner.model.layers)
    pw = runner.piecewise
    assert sorted(pw.graphs) == SIZES and all(len(p) == layers + 1 for p in pw.graphs.values())
    assert len(api.captured) == len(SIZES) * (layers + 1)
    assert runner.graphs is None  # decode=False: no full graphs
    # Capture ran every piece with padding slots: the KV cache is still all zeros.
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)


@needs_triton
@pytest.mark.parametrize("mode", ["batched", "chunked", "async", "prefix", "preempt"])
def test_greedy_tokens_match_transformers(tiny_llama_dir, mode):
    """Prefills (padded to the ladder), chunks beside decodes (mixed steps), prefix-cache hits
    (a chunk after cached context) and recompute after preemption, with the full decode graphs
    for decode-only steps: transformers' tokens throughout."""
    kw = {
        "batched": {},
        "chunked": dict(max_num_batched_tokens=24),
        "async": dict(async_scheduling=True),
        "prefix": dict(max_num_batched_tokens=32),
        "preempt": dict(num_kv_blocks=6),
    }[mode]
    n = 16 if mode == "preempt" else 6
    llm, runner, _ = piecewise_llm(tiny_llama_dir, decode_graphs=True, sizes=SIZES + [128], **kw)
    prompts = random_prompts(6, 5, 40, seed=11)  # 6 requests, 4 at a time: the last join decodes
    if mode == "prefix":
        head = random_prompts(1, 35, 35, seed=12)[0]
        prompts = [head + p[:9] for p in prompts[:4]]
        first = llm.generate(prompts[:1], greedy(6))
        outs = first + llm.generate(prompts[1:], greedy(6))
        assert all(o.num_cached_tokens >= 32 for o in outs[1:])
    else:
        outs = llm.generate(prompts, greedy(n))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_llama_dir, p, n, True)
    assert runner.piecewise.num_replays > 0 and runner.graphs.num_replays > 0
    if mode == "chunked":  # a 40-token prompt in 24-token chunks: steps beyond one size, padded
        assert llm.stats().num_steps > 7
    if mode == "preempt":  # 6 blocks of 16 tokens for requests growing to 49 tokens
        assert llm.stats().num_preemptions > 0


@needs_triton
def test_piecewise_only_runs_decodes_too(tiny_llama_dir):
    llm, runner, _ = piecewise_llm(tiny_llama_dir, decode_graphs=False)
    prompts = random_prompts(3, 4, 12, seed=5)
    outs = llm.generate(prompts, greedy(4))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_llama_dir, p, 4, True)
    assert runner.piecewise.num_replays == llm.stats().num_steps  # every step through the pieces


@needs_triton
def test_steps_beyond_the_ladder_run_eagerly(tiny_llama_dir):
    llm, runner, _ = piecewise_llm(tiny_llama_dir, sizes=[8, 16])
    prompt = random_prompts(1, 30, 30, seed=2)[0]
    out = llm.generate([prompt], greedy(3))[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 3, True)
    assert (
        runner.piecewise.num_replays == 2
    )  # the 30-token prefill ran eagerly; two decodes replayed


@needs_triton
def test_prompt_logprobs_and_cache_equal_the_eager_path(tiny_llama_dir):
    """Every prompt row gives logits (prompt_logprobs): the piecewise step's rows equal the eager
    step's, and both engines leave the same KV cache (padding rows stored nothing)."""
    prompts = random_prompts(2, 19, 27, seed=8)  # 19 + 27 rows: padded to 64
    params = greedy(2, prompt_logprobs=3, logprobs=2)
    eager = LLM(
        tiny_llama_dir,
        dtype="float32",
        attention_backend="triton",
        num_kv_blocks=64,
        max_num_seqs=4,
    )
    want = eager.generate(prompts, params)
    llm, runner, _ = piecewise_llm(tiny_llama_dir)
    got = llm.generate(prompts, params)
    assert runner.piecewise.num_replays >= 1
    for prompt, w, g in zip(prompts, want, got):
        assert_matches_hf(tiny_llama_dir, prompt, g.prompt_logprobs, 3)
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for wp, gp in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert gp.token_id == wp.token_id and abs(gp.logprob - wp.logprob) < 1e-4
    for (ke, ve), (kp, vp) in zip(eager.engine.core.runner.kv_caches, runner.kv_caches):
        assert torch.allclose(ke, kp, atol=1e-5) and torch.allclose(ve, vp, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_v256_dir(tmp_path_factory):
    """A 256-token vocabulary with weak attention: its output continues its history, so n-gram
    drafts get proposed and accepted."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama-v256"), "tiny-llama-v256"))


@needs_triton
def test_draft_verification_steps_replay_and_match_transformers(tiny_v256_dir):
    """Speculative decoding: verification rows (several query rows per sequence) are not decode-only,
    so they run through the pieces."""
    llm, runner, _ = piecewise_llm(tiny_v256_dir, decode_graphs=True, speculative_config=SPEC_TINY)
    logits_rows = []
    forward = runner.piecewise.forward

    def recording_forward(input_ids, positions, meta, logits_indices):
        logits_rows.append(len(logits_indices))
        return forward(input_ids, positions, meta, logits_indices)

    runner.piecewise.forward = recording_forward
    prompts = tiny_prompts(2, seed=3, lo=10, hi=30)
    outs = llm.generate(prompts, greedy(24))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_v256_dir, p, 24, True)
    assert llm.stats().spec_decode.num_draft_tokens > 0
    # Steps whose rows give more logits than there are requests: drafts verified through the pieces.
    assert any(n > len(prompts) for n in logits_rows)
