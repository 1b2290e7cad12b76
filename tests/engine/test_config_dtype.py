"""`dtype auto` (ModelConfig.dtype_choice) chooses as vLLM's auto: bf16 for an fp32 or fp16
checkpoint on a GPU and on a CPU that multiplies bf16 natively, fp32 on an AVX2-only CPU."""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh.engine import native_bf16
from kvmesh.engine.config import ModelConfig

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # no GPU needed: dtype_choice only reads the device's type


def _config(tmp_path, dtype: str | None) -> ModelConfig:
    raw = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    if dtype is not None:
        raw["torch_dtype"] = dtype
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(tmp_path)


@pytest.fixture
def native_cpu(monkeypatch):
    monkeypatch.setattr(native_bf16, "native_bf16_flag", lambda: "avx512_bf16")
    monkeypatch.delenv("KVMESH_CPU_KERNELS_PORTABLE", raising=False)


@pytest.fixture
def avx2_cpu(monkeypatch):
    monkeypatch.setattr(native_bf16, "native_bf16_flag", lambda: None)


@pytest.mark.parametrize("declared", ["float32", "float16", None])
def test_fp32_and_fp16_checkpoints_run_bf16_on_a_native_bf16_cpu(tmp_path, native_cpu, declared):
    dtype, why = _config(tmp_path, declared).dtype_choice("auto", CPU)
    assert dtype == torch.bfloat16
    assert "avx512_bf16" in why


def test_portable_cpu_kernels_keep_fp32_on_a_native_bf16_cpu(tmp_path, native_cpu, monkeypatch):
    """Kernels built without -march=native have no bf16 dot products: bf16 would only widen."""
    monkeypatch.setenv("KVMESH_CPU_KERNELS_PORTABLE", "1")
    dtype, why = _config(tmp_path, "float32").dtype_choice("auto", CPU)
    assert dtype == torch.float32 and "portable" in why
    assert _config(tmp_path, "float32").dtype_choice("bfloat16", CPU)[0] == torch.bfloat16


@pytest.mark.parametrize("declared", ["float32", "float16", None])
def test_fp32_and_fp16_checkpoints_run_fp32_on_an_avx2_only_cpu(tmp_path, avx2_cpu, declared):
    dtype, why = _config(tmp_path, declared).dtype_choice("auto", CPU)
    assert dtype == torch.float32
    assert "without" in why


@pytest.mark.parametrize("probe", ["native_cpu", "avx2_cpu"])
def test_a_bf16_checkpoint_stays_bf16(tmp_path, request, probe):
    request.getfixturevalue(probe)
    config = _config(tmp_path, "bfloat16")
    assert config.resolve_dtype("auto", CPU) == torch.bfloat16
    assert config.resolve_dtype("auto", CUDA) == torch.bfloat16


@pytest.mark.parametrize("probe", ["native_cpu", "avx2_cpu"])
@pytest.mark.parametrize("declared", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("asked", ["float32", "bfloat16", "float16"])
def test_explicit_dtypes_are_kept(tmp_path, request, probe, declared, asked):
    request.getfixturevalue(probe)
    config = _config(tmp_path, declared)
    for device in (CPU, CUDA):
        dtype, why = config.dtype_choice(asked, device)
        assert dtype == getattr(torch, asked) and why == "asked for"


def test_cuda_is_unchanged_by_the_cpu_probe(tmp_path, avx2_cpu):
    config = _config(tmp_path, "float32")
    assert config.resolve_dtype("auto", CUDA) == torch.bfloat16  # no GPU here: bf16
    config.torch_dtype = "float16"
    assert config.resolve_dtype("auto", CUDA) == torch.float16


def test_the_probe_reads_the_cpuinfo_flags(monkeypatch):
    native_bf16.native_bf16_flag.cache_clear()
    try:
        monkeypatch.setattr(native_bf16, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
        assert native_bf16.native_bf16_flag() is None
        native_bf16.native_bf16_flag.cache_clear()
        monkeypatch.setattr(native_bf16, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
        assert native_bf16.native_bf16_flag() == "avx512_bf16"
        native_bf16.native_bf16_flag.cache_clear()
        monkeypatch.setattr(native_bf16, "cpu_flags", lambda: {"amx_tile", "amx_bf16"})
        assert native_bf16.native_bf16_flag() == "amx_bf16"
    finally:
        native_bf16.native_bf16_flag.cache_clear()


@pytest.mark.parametrize(
    "probe, dtype",
    [("native_cpu", torch.bfloat16), ("avx2_cpu", torch.float32)],
)
def test_an_engine_on_auto_runs_and_logs_the_choice(tiny_llama_dir, request, caplog, probe, dtype):
    from kvmesh.engine import LLM, SamplingParams

    request.getfixturevalue(probe)
    with caplog.at_level("INFO", logger="kvmesh.engine.engine_core"):
        llm = LLM(tiny_llama_dir, num_kv_blocks=16, device="cpu")
    assert llm.engine.core.dtype == dtype
    assert llm.engine.core.runner.kv_caches[0][0].dtype == dtype  # the KV cache too
    (line,) = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert f"dtype={dtype} (auto, a float32 checkpoint on a CPU with" in line
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
