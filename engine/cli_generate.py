"""`kvmesh generate`: run the offline engine on prompts from the command line."""

from __future__ import annotations

import argparse
import sys
import time

from kvmesh.engine.cli_args import add_engine_arguments, engine_args_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompts", nargs="*", help="prompts (chat messages unless --raw); default: a demo prompt"
    )
    parser.add_argument(
        "--raw", action="store_true", help="send prompts as plain text, without the chat template"
    )
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
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
        )
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
        print(
            f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]\n"
        )
    total = sum(len(o.token_ids) for o in outs)
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0
