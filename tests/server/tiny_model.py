"""A tiny random-weight Llama with the SmolLM2 tokenizer: fast server tests."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvmesh.common.models import resolve_model_dir


def build_tiny_model(target: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = Path(target)
    if (target / "config.json").exists():
        return target
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=49152, initializer_range=0.2,
                         max_position_embeddings=2048, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(target, safe_serialization=True)
    source = resolve_model_dir("smollm2-135m-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target
