"""The adapter flags of `kvmesh serve`, as vLLM's: --enable-lora, --lora-modules, --max-loras, ..."""

from __future__ import annotations

import argparse
import json

from kvmesh.engine.cli_args import _positive_int
from kvmesh.engine.lora.request import LoRARequest

# vLLM's message when adapters are asked for without --enable-lora.
LORA_NOT_ENABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."
# vLLM's accepted --max-lora-rank values.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_MODULE_FIELDS = {"name", "path", "base_model_name"}


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("lora")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the base model: a request names one as its `model`",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=lora_module,
        default=None,
        metavar="MODULE",
        help='adapters loaded at start, each name=path or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}; several values (needs --enable-lora)',
    )
    g.add_argument(
        "--max-loras",
        type=_positive_int,
        default=1,
        help="most distinct adapters in one engine step (requests of others wait)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=_positive_int,
        default=None,
        help="most adapters kept loaded (least recently used unloaded first; default: --max-loras)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        choices=MAX_LORA_RANKS,
        help="largest adapter rank accepted",
    )


def lora_module(text: str) -> dict[str, str | None]:
    """One --lora-modules value: name=path (vLLM's old form) or its JSON object."""
    if "=" in text and "," not in text and not text.lstrip().startswith("{"):
        name, _, path = text.partition("=")
        if not name or not path:
            raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
        return {"name": name, "path": path, "base_model_name": None}
    try:
        data = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid JSON format: {text}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    unknown = sorted(set(data) - _MODULE_FIELDS)
    if unknown or not all(isinstance(data.get(k), str) and data[k] for k in ("name", "path")):
        raise argparse.ArgumentTypeError(
            f"invalid fields in {text}: needs string name and path"
            + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    base = data.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"base_model_name must be a string in {text}")
    return {"name": data["name"], "path": data["path"], "base_model_name": base}


def lora_engine_args(args: argparse.Namespace, served_name: str) -> dict:
    """EngineArgs' adapter fields from the flags; ValueError for a combination vLLM refuses too."""
    modules = args.lora_modules or []
    if modules and not args.enable_lora:
        raise ValueError(f"--lora-modules: {LORA_NOT_ENABLED}")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError(
            f"--max-cpu-loras ({args.max_cpu_loras}) must be >= --max-loras ({args.max_loras})"
        )
    bases = {served_name, args.model}
    requests, seen = [], set()
    for i, m in enumerate(modules, start=1):
        if m["name"] in seen or m["name"] in bases:
            what = "given twice" if m["name"] in seen else "the base model's name"
            raise ValueError(f"--lora-modules: adapter name {m['name']!r} is {what}")
        if m["base_model_name"] not in (None, *bases):
            raise ValueError(
                f"--lora-modules: adapter {m['name']!r} names base model "
                f"{m['base_model_name']!r}; this server serves {served_name!r}"
            )
        seen.add(m["name"])
        requests.append(LoRARequest(m["name"], i, m["path"], m["base_model_name"]))
    return {
        "enable_lora": args.enable_lora,
        "max_loras": args.max_loras,
        "max_cpu_loras": args.max_cpu_loras,
        "max_lora_rank": args.max_lora_rank,
        "lora_modules": requests,
    }
