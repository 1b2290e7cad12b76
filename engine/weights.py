"""Load Hugging Face safetensors into the fused-projection model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from kvmesh.engine.models.llama import LlamaForCausalLM

# HF name -> (our parameter, shard index among the fused parts, number of parts)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def _safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_weights(model: LlamaForCausalLM, model_dir: str | Path, dtype: torch.dtype) -> None:
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()

    def assign(name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise KeyError(f"checkpoint tensor for unknown parameter {name}")
        target = params[name]
        if target.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor.to(dtype))
        loaded.add(name)

    for path in _safetensor_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                tensor = f.get_tensor(hf_name)
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue
                match = _LAYER.match(hf_name)
                if match and match.group(3) in _FUSED:
                    layer, block, proj, kind = match.groups()
                    fused, part = _FUSED[proj]
                    name = f"layers.{layer}.{block}.{fused}.{kind}"
                    pending.setdefault(name, {})[part] = tensor
                    parts = 3 if fused == "qkv_proj" else 2
                    if len(pending[name]) == parts:
                        assign(name, torch.cat([pending[name][i] for i in range(parts)], dim=0))
                        del pending[name]
                    continue
                name = hf_name.removeprefix("model.")
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied to the embedding
                assign(name, tensor)
    if pending:
        raise ValueError(f"incomplete fused weights: {sorted(pending)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks: {', '.join(missing[:8])}")
