"""Engine arguments and the model's architecture config, validated up front."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE
from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.engine import native_bf16
from kvmesh.engine.kernels import cpu as cpu_kernels
from kvmesh.engine.prefill_order import DEFAULT_MAX_SKIPS, POLICIES

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
}


def parse_size(value: int | str) -> int:
    """'4GiB', '512MiB', '2g' or a plain integer -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {value!r} (use e.g. 4GiB, 512MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# The token budget per step. A server on the CPU gets a smaller one than vLLM's (2048 for its CPU
# server): there a step's time grows with its tokens (about 1 ms per prefill token for the built-in
# model on two cores), so a 2048-token step holds every running stream and every waiting first
# token for two seconds. Measured on the serving benchmark's workloads (docs/performance.md): 512
# cut TTFT p50 to half or less at the same throughput, within the run-to-run noise. GPUs, and
# `generate` / LLM (offline, where only throughput counts), keep 2048.
DEFAULT_TOKEN_BUDGET = 2048
CPU_SERVER_TOKEN_BUDGET = 512


def pick_device(requested: str) -> torch.device:
    """The device an engine runs on: `auto` is CUDA when there is one, else the CPU."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def default_token_budget(device: str, server: bool) -> int:
    """--max-num-batched-tokens when the flag is not given: see CPU_SERVER_TOKEN_BUDGET."""
    if server and pick_device(device).type == "cpu":
        return CPU_SERVER_TOKEN_BUDGET
    return DEFAULT_TOKEN_BUDGET


@dataclass
class EngineArgs:
    """Knobs of one engine, named as vLLM names them."""

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    # None: 4GiB on the CPU; on a GPU, sized from free memory (gpu_memory_utilization)
    kv_cache_memory: int | str | None = None
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET
    max_num_seqs: int = 128
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Which waiting request the token budget goes to first (engine/prefill_order.py), as vLLM's
    # --scheduling-policy plus sjf: fcfs | priority | sjf; and sjf's aging bound.
    scheduling_policy: str = "fcfs"
    max_prefill_skips: int = DEFAULT_MAX_SKIPS
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    enable_kv_events: bool = False
    generation_config: str = (
        "auto"  # sampling defaults: auto (the model's), vllm (OpenAI's) or a folder
    )
    # Speculative decoding, as vLLM's: {"method": "ngram", "num_speculative_tokens": K,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2, ...} (a dict or its JSON); None: off.
    speculative_config: Any = None
    attention_backend: str = "auto"  # auto | torch | cpu | triton (attention_backends.py)
    enforce_eager: bool = False  # no CUDA graphs
    # Which CUDA graphs (compilation_config.py), as vLLM's: {"cudagraph_mode": "FULL_AND_PIECEWISE",
    # "max_cudagraph_capture_size": 2048, "cudagraph_capture_sizes": [...]} (a dict or its JSON)
    compilation_config: Any = None
    gpu_memory_utilization: float = (
        0.9  # share of the GPU's memory the engine may use (KV sized from it)
    )
    # Schedule and prepare step N+1 while step N runs (vLLM's --async-scheduling). None: on for
    # CUDA devices, off on the CPU (where it measured no faster: docs/performance.md).
    async_scheduling: bool | None = None
    # Fewer torch threads while other processes take CPU time on ours, back when they leave
    # (cpu_contention.py). None: on unless the thread count was pinned (OMP_NUM_THREADS,
    # --omp-threads).
    adapt_threads: bool | None = None
    # LoRA, as vLLM's flags: adapters served beside the base model (requests name one as `model`).
    enable_lora: bool = False
    max_loras: int = 1  # adapters one step may hold (the rest wait)
    max_cpu_loras: int | None = None  # adapters kept loaded; None: max_loras
    max_lora_rank: int = 16
    lora_modules: list[Any] = field(default_factory=list)  # LoRARequest, loaded at start
    # KV tiers (engine/kv_offload/): the host tier as vLLM's flags name it (GiB; None: off; the
    # only backend is kvmesh's own), the shared tier as kvmesh's (a directory every replica
    # mounts; None: off; its size in GiB).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_shared_dir: str | None = None
    kv_shared_size: float = 10.0

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        from kvmesh.engine.attention_backends import BACKENDS

        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.scheduling_policy not in POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.max_prefill_skips < 0:
            raise ValueError(f"max_prefill_skips must be >= 0, got {self.max_prefill_skips}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        from kvmesh.engine.compilation_config import CompilationConfig

        self.compilation_config = CompilationConfig.parse(self.compilation_config)
        if self.speculative_config is not None:
            from kvmesh.engine.spec_decode.config import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        from kvmesh.engine.generation_defaults import check_source

        check_source(self.generation_config)
        self._validate_tiers()

    def _validate_tiers(self) -> None:
        for flag, value in (
            ("--kv-offloading-size", self.kv_offloading_size),
            ("--kv-shared-size", self.kv_shared_size),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be a positive size in GiB, got {value}")
        if self.kv_offloading_backend != "native":
            raise ValueError(
                "--kv-offloading-backend: only 'native' is accepted (the engine's own host "
                f"tier), got {self.kv_offloading_backend!r}"
            )


@dataclass
class ModelConfig:
    """The parts of a Hugging Face Llama-family config.json the model needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str | None
    eos_token_id: list[int] = field(default_factory=list)

    SUPPORTED = ("llama", "qwen2", "mistral")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        model_type = raw.get("model_type", "")
        if model_type not in cls.SUPPORTED:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(cls.SUPPORTED)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw.get('hidden_act')!r} (only silu)")
        heads = raw["num_attention_heads"]
        # transformers >= 5 nests rope settings under rope_parameters.
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
        if rope and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        eos = raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias; Llama declares it.
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            mlp_bias=raw.get("mlp_bias", False),
            hidden_act=raw.get("hidden_act", "silu"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_id=[
                e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)
            ],
        )

    def resolve_dtype(self, requested: str, device: torch.device) -> torch.dtype:
        """The serving dtype (``dtype_choice`` without its reason)."""
        return self.dtype_choice(requested, device)[0]

    def dtype_choice(self, requested: str, device: torch.device) -> tuple[torch.dtype, str]:
        """The serving dtype and why. ``auto`` chooses as vLLM's auto: a bf16 checkpoint stays bf16;
        an fp32 checkpoint is served in bf16 on a GPU (fp16 without bf16) and on a CPU that
        multiplies bf16 natively (AVX512-BF16 or AMX: native_bf16.py); an fp16 one in bf16 there
        too (the CPU kernels have no fp16 path). On a CPU without them (AVX2-only x86, AVX-512
        without AVX512-BF16) fp32 and fp16 checkpoints run in fp32, where vLLM picks bf16: the bf16
        linears widen to fp32 in software there, which costs prefill speed and buys only the
        halved weight reads. Kernels built portable (no -march=native) keep fp32 for the same reason."""
        if requested != "auto":
            return _DTYPES[requested], "asked for"
        name = str(self.torch_dtype).replace("torch.", "")
        declared = _DTYPES.get(name, torch.float32)
        checkpoint = f"auto, a {name if name in _DTYPES else 'float32'} checkpoint"
        if declared == torch.bfloat16:
            return declared, checkpoint
        if device.type == "cuda":
            if declared == torch.float16:
                return declared, checkpoint
            # A GPU serves an fp32 checkpoint in 16 bits (bf16 where supported).
            if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
                return torch.float16, f"{checkpoint} on a GPU without bf16"
            return torch.bfloat16, f"{checkpoint} on a GPU"
        if device.type != "cpu":
            return declared, checkpoint
        flag = native_bf16.native_bf16_flag()
        if flag is None:
            return torch.float32, f"{checkpoint} on a CPU without avx512_bf16 or amx_bf16"
        if cpu_kernels.portable():
            # built without -march=native: no bf16 dot products in the kernels, only widening
            return torch.float32, f"{checkpoint}, CPU kernels built portable"
        return torch.bfloat16, f"{checkpoint} on a CPU with {flag}"

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return (
            2
            * self.num_hidden_layers
            * block_size
            * self.num_key_value_heads
            * self.head_dim
            * element
        )
