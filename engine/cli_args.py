"""Engine flags shared by every command that runs an engine (`serve`, `generate`).

Names and defaults as in docs/cli.md; the operator renders pods with these flags.
"""

from __future__ import annotations

import argparse

from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE
from kvmesh.common.models import DEFAULT_MODEL


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by `generate` and `serve` (names as in docs/cli.md)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="built-in model name or HF directory")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", default="4GiB")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults for parameters a request leaves out: auto (the model's "
                        "generation_config.json), vllm (OpenAI's) or a folder holding a generation_config.json")


def engine_args_from(args: argparse.Namespace, **overrides):
    from kvmesh.engine.config import EngineArgs

    return EngineArgs(
        model=args.model, served_model_name=args.served_model_name, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, dtype=args.dtype, device=args.device,
        seed=args.seed, generation_config=args.generation_config, **overrides)
