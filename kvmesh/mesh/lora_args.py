"""The LoRA flags of `kvmesh up` and the stub engine, and the engine arguments they become (vLLM's names)."""

from __future__ import annotations

import argparse
import os


def lora_module(text: str) -> tuple[str, str]:
    """``name=path`` (``--lora-modules``) -> (name, absolute path): engines may run elsewhere."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, not {text!r}")
    return name, os.path.abspath(path)


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters every engine loads at start (vLLM's --lora-modules; turns LoRA on)",
    )
    p.add_argument(
        "--max-loras", type=int, default=None, help="adapters one engine step may hold (LoRA on)"
    )
    p.add_argument(
        "--max-lora-rank", type=int, default=None, help="the largest adapter rank (LoRA on)"
    )


def lora_enabled(args: argparse.Namespace) -> bool:
    return bool(args.lora_modules) or args.max_loras is not None or args.max_lora_rank is not None


def engine_lora_args(args: argparse.Namespace) -> list[str]:
    """The flags that give every engine (`kvmesh serve`, `vllm serve`, the stub) these adapters."""
    if not lora_enabled(args):
        return []
    out = ["--enable-lora"]
    if args.lora_modules:
        out += ["--lora-modules", *(f"{n}={p}" for n, p in args.lora_modules)]
    if args.max_loras is not None:
        out += ["--max-loras", str(args.max_loras)]
    if args.max_lora_rank is not None:
        out += ["--max-lora-rank", str(args.max_lora_rank)]
    return out
