"""The GPU execution path, proven on the CPU: backend choice, CUDA-graph bookkeeping (torch.cuda
stubbed at GraphAPI), KV sizing from memory (the memory query stubbed), a sampler without host
syncs, and the tiny models (and, slow, the built-in one) through the Triton backend under the
interpreter against transformers' greedy tokens."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported

import argparse  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kvmesh.engine import LLM, SamplingParams  # noqa: E402
from kvmesh.engine import attention_backends as ab  # noqa: E402
from kvmesh.engine.config import EngineArgs  # noqa: E402
from kvmesh.engine.cuda_graphs import CUDAGraphRunner, capture_sizes  # noqa: E402
from kvmesh.engine.kv_memory import (  # noqa: E402
    KVSizing,
    MemoryQuery,
    blocks_from_memory,
    log_capacity,
    size_kv_cache,
)
from tests.engine.conftest import hf_greedy, random_prompts  # noqa: E402

needs_triton = pytest.mark.skipif(not ab.triton_available(), reason="triton is not installed")
CPU = torch.device("cpu")


# -- backend choice ----------------------------------------------------------------------
def test_auto_picks_by_device_and_env_overrides(monkeypatch):
    monkeypatch.delenv(ab.ENV_VAR, raising=False)
    assert ab.choose("auto", CPU) == "cpu"
    assert ab.choose("torch", CPU) == "torch"
    monkeypatch.setattr(ab, "triton_available", lambda: True)
    assert ab.choose("auto", torch.device("cuda")) == "triton"
    monkeypatch.setattr(ab, "triton_available", lambda: False)
    assert ab.choose("auto", torch.device("cuda")) == "torch"  # degraded, with a warning
    with pytest.raises(ValueError, match="needs the triton package"):
        ab.choose("triton", CPU)
    with pytest.raises(ValueError, match="runs on device cpu only"):
        ab.choose("cpu", torch.device("cuda"))
    monkeypatch.setenv(ab.ENV_VAR, "torch")
    assert ab.choose("auto", CPU) == "torch"
    assert ab.choose("cpu", CPU) == "cpu"  # an explicit argument wins over the environment
    monkeypatch.setenv(ab.ENV_VAR, "flash")
    with pytest.raises(ValueError, match=ab.ENV_VAR):
        ab.choose("auto", CPU)


def test_engine_args_and_flags():
    from kvmesh.engine.cli_args import add_engine_arguments, engine_args_from

    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(attention_backend="flash").validate()
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineArgs(gpu_memory_utilization=bad).validate()
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = engine_args_from(
        parser.parse_args(
            ["--attention-backend", "triton", "--enforce-eager", "--gpu-memory-utilization", "0.5"]
        )
    )
    assert (args.attention_backend, args.enforce_eager, args.gpu_memory_utilization) == (
        "triton",
        True,
        0.5,
    )
    default = engine_args_from(parser.parse_args([]))
    assert (
        default.attention_backend,
        default.enforce_eager,
        default.gpu_memory_utilization,
        default.kv_cache_memory,
    ) == ("auto", False, 0.9, None)


def test_torch_backend_forced_on_cpu(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", attention_backend="torch", num_kv_blocks=64)
    runner = llm.engine.core.runner
    assert (
        runner.backend.name == "torch" and runner.cpu_ops is None and runner.model.fused_ops is None
    )
    prompt = random_prompts(1, 20, 20, seed=3)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 4, True)


@needs_triton
def test_split_kv_ranges_fill_the_device_in_powers_of_two():
    from types import SimpleNamespace

    backend = ab.TritonBackend(
        SimpleNamespace(num_attention_heads=8, num_key_value_heads=2), 16, CPU
    )
    backend.target_programs = 264  # 2 x the SMs of an H100/H200
    tile = backend.kernels.TILE_N
    assert backend.num_splits(1, 4096) == 16  # one row: as many ranges as allowed
    assert backend.num_splits(64, 4096) == 2  # 128 programs: 3 ranges would fill it, rounded down
    assert backend.num_splits(200, 4096) == 1  # the batch fills the device alone
    assert (
        backend.num_splits(1, tile) == 1 and backend.num_splits(1, 3 * tile) == 2
    )  # >= one tile each
    assert backend.num_splits(0, 0) == 1


# -- CUDA graphs ---------------------------------------------------------------------------
class FakeGraphAPI:
    """Stands in for torch.cuda at the GraphAPI boundary: capture records the function and runs
    it once; replay runs it again into the captured output (as a graph writes its static output)."""

    def __init__(self):
        self.captured: list[int] = []
        self.replayed: list[object] = []

    def new_graph(self):
        return argparse.Namespace(fn=None, out=None)

    def capture(self, graph, fn):
        graph.fn = fn
        graph.out = fn()
        self.captured.append(graph.out.shape[0])
        return graph.out

    def replay(self, graph):
        self.replayed.append(graph)
        with torch.inference_mode():  # as the runner's execute(), where replays happen
            graph.out.copy_(graph.fn())

    def synchronize(self):
        pass


class RecordingModel:
    """A model stub: logits[i] = (input id, position, slot, context length) of row i, and the
    inputs of each call recorded."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, positions, kv_caches, meta, logits_indices):
        self.calls.append((input_ids, meta))
        return torch.stack(
            [input_ids.float(), positions.float(), meta.slots.float(), meta.seq_lens.float()], 1
        )[logits_indices]


class StubBackend:
    def num_splits(self, rows, max_len):
        return 4 if rows < 8 else 1


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(128)[-3:] == [32, 64, 128]


def _decode_meta(n, ctx, width=3):
    lens = torch.tensor(ctx, dtype=torch.int32)
    return ab.TritonMetadata(
        slots=torch.arange(100, 100 + n),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=lens,
        block_tables=torch.arange(n * width, dtype=torch.int32).view(n, width),
        decode_seqs=torch.arange(n, dtype=torch.int32),
        num_decodes=n,
        num_splits=1,
        decode_only=True,
    )


def test_graph_runner_pads_replays_and_reuses_buffers():
    api, model = FakeGraphAPI(), RecordingModel()
    runner = CUDAGraphRunner(
        model,
        StubBackend(),
        [],
        max_num_seqs=6,
        max_model_len=64,
        block_size=16,
        device=CPU,
        api=api,
    )
    runner.capture()
    assert api.captured == [6, 4, 2, 1]  # largest first
    assert runner.metas[1].num_splits == 4 and runner.metas[6].num_splits == 4
    assert all(m.sample_meta is m for m in runner.metas.values())
    buffers = [
        t.data_ptr()
        for t in (
            runner.input_ids,
            runner.positions,
            runner.slots,
            runner.seq_lens,
            runner.block_tables,
        )
    ]
    assert (
        runner.padded_size(3) == 4 and runner.padded_size(5) == 6 and runner.padded_size(7) is None
    )

    # Four rows, then three: the fourth row of the size-4 graph becomes padding again.
    for n in (4, 3):
        meta = _decode_meta(n, [5 + i for i in range(n)])
        logits = runner.replay(torch.arange(10, 10 + n), torch.arange(20, 20 + n), meta)
        assert logits.shape == (n, 4)
        assert logits[:, 0].tolist() == list(range(10, 10 + n))
        assert logits[:, 2].tolist() == list(range(100, 100 + n))
        assert logits[:, 3].tolist() == [5 + i for i in range(n)]
        assert api.replayed[-1] is runner.graphs[4]
        assert torch.equal(runner.block_tables[:n, :3], meta.block_tables)
    assert runner.slots[3].item() == ab.PAD_SLOT and runner.seq_lens[3].item() == 0
    assert runner.input_ids[3].item() == 0
    seen_ids, seen_meta = model.calls[-1]
    assert (
        seen_ids.shape[0] == 4 and seen_meta is runner.metas[4]
    )  # the graph ran at its padded size
    assert [
        t.data_ptr()
        for t in (
            runner.input_ids,
            runner.positions,
            runner.slots,
            runner.seq_lens,
            runner.block_tables,
        )
    ] == buffers
    assert runner.num_replays == 2


def test_graph_runner_replays_only_decode_only_steps():
    runner = CUDAGraphRunner(
        RecordingModel(),
        StubBackend(),
        [],
        max_num_seqs=4,
        max_model_len=64,
        block_size=16,
        device=CPU,
        api=FakeGraphAPI(),
    )
    meta = _decode_meta(3, [4, 4, 4])
    assert runner.can_replay(meta, 3)
    assert not runner.can_replay(meta, 5)  # larger than every graph
    meta.decode_only = False  # a prefill or chunk in the step, or prompt-logprob rows
    assert not runner.can_replay(meta, 3)
    assert not runner.can_replay(object(), 1)  # another backend's metadata


@needs_triton
def test_engine_replays_decode_steps_with_the_same_tokens(tiny_llama_dir):
    """The tiny model through the Triton backend (interpreted) with graphs captured through the
    stub: decode steps replay, prefill steps run eagerly, and greedy tokens equal transformers'."""
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        attention_backend="triton",
        num_kv_blocks=64,
        max_num_seqs=4,
    )
    runner = llm.engine.core.runner
    api = FakeGraphAPI()
    runner.capture_cuda_graphs(4, llm.engine.core.max_model_len, api=api)
    assert api.captured == [4, 2, 1]
    prompts = random_prompts(3, 4, 12, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_llama_dir, p, 3, True)
    assert (
        runner.graphs.num_replays == 2
    )  # tokens 2 and 3 of the 3 requests: decode steps of 3 rows


# -- KV sizing from memory -----------------------------------------------------------------
def test_blocks_from_memory_arithmetic():
    gib = 2**30
    blocks, kv = blocks_from_memory(
        total=80 * gib,
        in_use=10 * gib,
        peak_activation=2 * gib,
        utilization=0.9,
        bytes_per_block=gib // 64,
    )
    assert kv == int(80 * gib * 0.9) - 12 * gib and blocks == kv // (gib // 64)
    assert blocks_from_memory(10 * gib, 9 * gib, gib, 0.9, 1024) == (0, 0)


def test_size_kv_cache_profiles_one_step_with_the_query_stubbed(tiny_llama_dir, caplog):
    """The profiling step runs the model at the largest batch; the allocator counters and the
    driver's free/total come from the stub."""
    llm = LLM(tiny_llama_dir, dtype="float32", attention_backend="torch", num_kv_blocks=8)
    runner = llm.engine.core.runner
    calls = []
    real_execute = runner.execute

    def execute(sched, kv):
        calls.append(dict(sched.num_scheduled_tokens))
        return real_execute(sched, kv)

    runner.execute = execute
    gib = 2**30
    counters = {"allocated": 1 * gib, "peak": 1 * gib}

    def reset_peak():
        counters["peak"] = counters["allocated"] + gib // 2  # the step's activations: 0.5 GiB

    query = MemoryQuery(
        mem_get_info=lambda: (14 * gib, 16 * gib),
        reset_peak=reset_peak,
        max_allocated=lambda: counters["peak"],
        allocated=lambda: counters["allocated"],
        synchronize=lambda: None,
        empty_cache=lambda: None,
    )
    per_block = 2**20
    sizing = size_kv_cache(
        runner,
        max_num_batched_tokens=40,
        max_num_seqs=3,
        max_model_len=16,
        utilization=0.5,
        bytes_per_block=per_block,
        query=query,
    )
    # 40 tokens over 3 sequences would be 14 each; the model length caps a sequence at 15 tokens.
    assert sum(calls[0].values()) == 40 and len(calls[0]) == 3 and max(calls[0].values()) <= 15
    assert sizing.in_use == 2 * gib and sizing.peak_activation == gib // 2
    assert sizing.num_blocks == (8 * gib - 2 * gib - gib // 2) // per_block
    assert runner.kv_caches[0][0].shape[1] == 0  # the scratch cache is gone
    with caplog.at_level("INFO", logger="kvmesh.engine.kv_memory"):
        assert log_capacity(sizing, 16, 1024) == sizing.num_blocks * 16 / 1024
    assert "maximum concurrency" in caplog.text and str(sizing.num_blocks) in caplog.text
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        size_kv_cache(runner, 40, 3, 16, utilization=0.1, bytes_per_block=per_block, query=query)
    assert isinstance(sizing, KVSizing)


# -- sampling without host syncs -------------------------------------------------------------
def test_sampler_reads_device_values_once_per_step(monkeypatch):
    """Greedy, temperature with top-k/top-p/min-p, a seeded row and penalties in one batch: no
    tensor is turned into a Python bool or scalar, and one .tolist() brings the ids back."""
    from kvmesh.engine.request import Request
    from kvmesh.engine.sampler import Sampler

    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=7),
        SamplingParams(
            temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5, logit_bias={3: 2.0}
        ),
    ]
    requests = [Request(f"r{i}", [1, 2, 3], p, set(), "m", 16, 64) for i, p in enumerate(params)]
    logits = torch.randn(len(requests), 50)
    counts = {"tolist": 0}
    real_tolist = torch.Tensor.tolist

    def forbidden(*_):
        raise AssertionError("a host sync in the sampler")

    def tolist(self):
        counts["tolist"] += 1
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", forbidden)
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    tokens, _ = Sampler(0)(logits, requests)
    monkeypatch.undo()
    assert counts["tolist"] == 1
    assert tokens[0] == int(logits[0].argmax())
    assert all(0 <= t < 50 for t in tokens)


# -- end to end through the Triton backend (interpreted) ---------------------------------------
@needs_triton
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_triton_backend_greedy_matches_transformers(model, request):
    """Batched, chunked (a 24-token step budget) and with prefix-cache hits (a shared prefix)."""
    model_dir = request.getfixturevalue(model.replace("-", "_") + "_dir")
    prefix = random_prompts(1, 40, 40, seed=11)[0]
    prompts = random_prompts(3, 5, 50, seed=1) + [
        prefix + s for s in random_prompts(2, 3, 9, seed=12)
    ]
    llm = LLM(
        model_dir,
        dtype="float32",
        attention_backend="triton",
        num_kv_blocks=128,
        max_num_batched_tokens=24,
    )
    assert llm.engine.core.runner.backend.name == "triton"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, 6, True), f"prompt {i} diverged"
    assert llm.stats().prefix_cache_hits > 0


@needs_triton
def test_triton_backend_prompt_logprobs_match_transformers(tiny_llama_dir):
    """Prompt-logprob rows ride the last layer as decodes over their own contexts: through the
    Triton backend's metadata too (chunked, so some rows sit in a chunk after cached context)."""
    from tests.engine.test_prompt_logprobs import assert_matches_hf

    prompt = random_prompts(1, 30, 30, seed=21)[0]
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        attention_backend="triton",
        num_kv_blocks=64,
        max_num_batched_tokens=16,
    )
    out = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=1
        ),
    )[0]
    assert_matches_hf(tiny_llama_dir, prompt, out.prompt_logprobs, 2)
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 2, True)


@needs_triton
@pytest.mark.slow
def test_triton_backend_builtin_model_matches_transformers(smollm2_dir):
    """The built-in SmolLM2 (30 layers, GQA 9/3, head dim 64) through the interpreted kernels."""
    from kvmesh.common.tokenizer import KVMeshTokenizer

    tok = KVMeshTokenizer(smollm2_dir)
    prompts = [
        tok.encode_chat([{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "List three fruits.")
    ]
    llm = LLM(
        "smollm2-135m-instruct", attention_backend="triton", num_kv_blocks=64, dtype="float32"
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(smollm2_dir, p, 8, False)
