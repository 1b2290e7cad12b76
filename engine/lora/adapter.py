"""Loading a PEFT LoRA adapter directory into per-layer A/B weights checked against the base model."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from kvmesh.common.lora import ADAPTER_CONFIG, adapter_digest
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.lora.request import LoRAError, LoRARequest

# The projections an adapter may target, with the block that holds each.
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# A saved tensor's name: base_model.model.model.layers.{i}.{block}.{module}.lora_{A|B}.weight
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_(A|B)(?:\.\w+)?\.weight$"
)


@dataclass
class LoRAWeights:
    """One projection's adapter: ``out += scaling * (x @ a.T) @ b.T``; a [rank, in], b [out, rank]."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """A loaded adapter: its identity and, per decoder layer, its projections' weights (fp32, CPU)."""

    name: str
    int_id: int
    path: str
    digest: str
    rank: int  # the largest rank of its projections
    scaling: float  # lora_alpha / r (or / sqrt(r) with rsLoRA) of its config's default rank
    base_model_name: str | None
    layers: list[dict[str, LoRAWeights]]
    # Device copies packed for the model (lora/packed.py), by (device, dtype).
    packed: dict = field(default_factory=dict, repr=False, compare=False)


def _shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _read_config(req: LoRARequest) -> dict:
    path = os.path.join(req.lora_path, ADAPTER_CONFIG)
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"adapter {req.lora_name!r}: no {ADAPTER_CONFIG} in {req.lora_path}")
    except (OSError, ValueError) as e:
        raise LoRAError(f"adapter {req.lora_name!r}: unreadable {ADAPTER_CONFIG}: {e}")
    if not isinstance(cfg, dict):
        raise LoRAError(f"adapter {req.lora_name!r}: {ADAPTER_CONFIG} is not a JSON object")
    return cfg


def _check_features(name: str, cfg: dict) -> None:
    """Refuse what the engine does not compute (it would serve wrong outputs silently)."""
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {kind!r} is not LORA")
    if cfg.get("use_dora"):
        raise LoRAError(f"adapter {name!r}: DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoRAError(f"adapter {name!r}: bias {cfg.get('bias')!r} is not supported (only none)")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"adapter {name!r}: modules_to_save is not supported")
    for key in ("trainable_token_indices", "target_parameters"):
        if cfg.get(key):
            raise LoRAError(f"adapter {name!r}: {key} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        if {"embed_tokens", "lm_head"} & set(targets):
            raise LoRAError(f"adapter {name!r}: embedding / LM head targets are not supported")
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise LoRAError(
                f"adapter {name!r}: target module(s) {', '.join(unknown)} not in the model "
                f"(supported: {', '.join(TARGETS)})"
            )


def _read_tensors(req: LoRARequest) -> dict[str, torch.Tensor]:
    root = req.lora_path
    st = os.path.join(root, "adapter_model.safetensors")
    binary = os.path.join(root, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(binary):
            return torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader error means a corrupt file
        raise LoRAError(f"adapter {req.lora_name!r}: corrupt weights file: {e}") from None
    raise LoRAError(f"adapter {req.lora_name!r}: no adapter_model.safetensors or .bin in {root}")


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key)."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _scaling(cfg: dict, key: str, rank: int) -> float:
    alpha = _pattern_value(cfg.get("alpha_pattern"), key, cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _collect(name: str, tensors: dict, config: ModelConfig) -> dict[tuple[int, str], dict]:
    """(layer, module) -> {"A": tensor, "B": tensor}, every tensor accounted for."""
    found: dict[tuple[int, str], dict] = {}
    for key, tensor in tensors.items():
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise LoRAError(f"adapter {name!r}: embedding / LM head targets are not supported")
        if "lora_magnitude_vector" in key:
            raise LoRAError(f"adapter {name!r}: DoRA (use_dora) is not supported")
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: unexpected tensor {key}")
        layer, block, module, part = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if TARGETS.get(module) != block:
            raise LoRAError(f"adapter {name!r}: target module {block}.{module} not in the model")
        if layer >= config.num_hidden_layers:
            raise LoRAError(
                f"adapter {name!r}: layer {layer} beyond the model's {config.num_hidden_layers}"
            )
        found.setdefault((layer, module), {})[part] = tensor
    return found


def _weights(name: str, key: str, parts: dict, cfg: dict, in_out, max_rank: int) -> LoRAWeights:
    if set(parts) != {"A", "B"}:
        raise LoRAError(f"adapter {name!r}: {key} has lora_A or lora_B missing")
    a, b = parts["A"].float(), parts["B"].float()
    rank = a.shape[0] if a.dim() == 2 else -1
    expected = _pattern_value(cfg.get("rank_pattern"), key, cfg.get("r", rank))
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r}: rank {rank} of {key} exceeds max_lora_rank {max_rank}")
    fan_in, fan_out = in_out
    if (
        tuple(a.shape) != (expected, fan_in)
        or tuple(b.shape) != (fan_out, expected)
        or expected <= 0
    ):
        raise LoRAError(
            f"adapter {name!r}: shape mismatch at {key}: A {tuple(a.shape)}, B {tuple(b.shape)}, "
            f"expected A ({expected}, {fan_in}), B ({fan_out}, {expected})"
        )
    # fan_in_fan_out concerns the base layer's weight layout; lora_A/B are always Linear-shaped.
    return LoRAWeights(a.contiguous(), b.contiguous(), _scaling(cfg, key, rank))


def load_adapter(req: LoRARequest, model_config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter directory ``req.lora_path`` against the base model.

    Raises LoRAError (naming the adapter and the reason) for missing or corrupt files, ranks
    above ``max_rank``, targets the model lacks, shapes that do not fit, unsupported features.
    """
    name = req.lora_name
    if not os.path.isdir(req.lora_path):
        raise LoRAError(f"adapter {name!r}: no directory {req.lora_path}")
    cfg = _read_config(req)
    _check_features(name, cfg)
    tensors = _read_tensors(req)
    shapes = _shapes(model_config)
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(model_config.num_hidden_layers)]
    for (layer, module), parts in sorted(_collect(name, tensors, model_config).items()):
        key = f"model.layers.{layer}.{TARGETS[module]}.{module}"
        layers[layer][module] = _weights(name, key, parts, cfg, shapes[module], max_rank)
    ranks = [w.rank for layer in layers for w in layer.values()]
    if not ranks:
        raise LoRAError(f"adapter {name!r}: no LoRA weights in {req.lora_path}")
    r = int(cfg.get("r", max(ranks)))
    alpha = cfg.get("lora_alpha", 8)
    try:
        digest = adapter_digest(req.lora_path)
    except OSError as e:
        raise LoRAError(f"adapter {name!r}: {e}") from None
    return LoRAAdapter(
        name=name,
        int_id=req.lora_int_id,
        path=req.lora_path,
        digest=digest,
        rank=max(ranks),
        scaling=alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r,
        base_model_name=req.base_model_name,
        layers=layers,
    )
