"""`kvmesh generate`: run the offline engine on prompts from the command line."""

from __future__ import annotations

import argparse
import sys
import time


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by `generate` and `serve` (names as in docs/cli.md)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m-instruct", help="built-in model name or HF directory")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--block-size", type=int, default=16)
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


def engine_args_from(args: argparse.Namespace, **overrides):
    from kvmesh.engine.config import EngineArgs

    return EngineArgs(
        model=args.model, served_model_name=args.served_model_name, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, dtype=args.dtype, device=args.device,
        seed=args.seed, **overrides)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (chat messages unless --raw); default: a demo prompt")
    parser.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvmesh.engine import InvalidParameter, SamplingParams
    from kvmesh.engine.llm import LLM

    prompts = args.prompts or ["What is a KV cache, in two sentences?"]
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k)
        llm = LLM.from_engine_args(engine_args_from(args))
        start = time.perf_counter()
        if args.raw:
            outs = llm.generate(prompts, params)
        else:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    except (InvalidParameter, ValueError, FileNotFoundError) as exc:
        print(f"kvmesh generate: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs):
        print(f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]\n")
    total = sum(len(o.token_ids) for o in outs)
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0
