"""Tiny random-weight Llama-family checkpoints for fast tests.

They borrow the built-in model's tokenizer (tokenizer.json + chat template) so
text prompts and chat work; weights are random with a large init scale, which
keeps greedy logits well separated (no near-ties to flip under fp reordering).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kvmesh.engine.builtin import resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

VARIANTS = {
    # Llama 3 style: GQA, untied lm_head, llama3 RoPE scaling.
    "tiny-llama": dict(
        arch="llama",
        tie_word_embeddings=False,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    # Plain Llama 2 style: default RoPE, a longer context (server tests).
    "tiny-llama-plain": dict(
        arch="llama", tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=2048
    ),
    # Qwen2 style: q/k/v bias, tied embeddings.
    "tiny-qwen2": dict(arch="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    # Speculative decoding tests, with a 256-token vocabulary (a larger init keeps logits apart).
    # Llama: attention outputs scaled down (o_proj x 0.02; attention still decides many tokens), so
    # greedy output often continues its own history and n-gram drafts are accepted as well as
    # rejected. Qwen2: full-strength attention, where nearly every draft is rejected.
    "tiny-llama-v256": dict(
        arch="llama",
        tie_word_embeddings=False,
        rope_theta=10000.0,
        vocab_size=256,
        initializer_range=0.5,
        o_proj_scale=0.02,
    ),
    "tiny-qwen2-v256": dict(
        arch="qwen2",
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        vocab_size=256,
        initializer_range=0.5,
    ),
    # Attention switched off (o_proj zeroed): the next token's distribution depends on the current
    # token alone, so a draft (what followed that token before) is often accepted under sampling too.
    # For distribution tests, not for parity (the KV cache cannot matter to it).
    "tiny-llama-v256-noattn": dict(
        arch="llama",
        tie_word_embeddings=False,
        rope_theta=10000.0,
        vocab_size=256,
        initializer_range=0.5,
        o_proj_scale=0.0,
    ),
}


def build_tiny_model(
    path: Path, variant: str = "tiny-llama", seed: int = 0, tokenizer_source: Path | None = None
) -> Path:
    """A tiny checkpoint in `path`; its tokenizer files come from `tokenizer_source` (default: the
    built-in model's, converted on first use)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").exists():
        return path  # already built
    spec = dict(VARIANTS[variant])
    arch = spec.pop("arch")
    o_proj_scale = spec.pop("o_proj_scale", None)
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    common.update({k: spec.pop(k) for k in list(spec) if k in common})
    torch.manual_seed(seed)
    if arch == "llama":
        rope_scaling = spec.pop("rope_scaling", None)
        config = LlamaConfig(**common, **spec)
        if rope_scaling:  # transformers 5 keeps rope settings in rope_parameters
            params = dict(rope_scaling, rope_theta=spec["rope_theta"])
            config.rope_parameters = params
            config.rope_scaling = params
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(**common, **spec)
        model = Qwen2ForCausalLM(config)
    if o_proj_scale is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(o_proj_scale)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    source = (
        Path(tokenizer_source) if tokenizer_source else resolve_model_dir("smollm2-135m-instruct")
    )
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path
