"""The KV tier flags of `kvmesh up` and the engine arguments they become (kvmesh/common/kv_tiers.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def gib(text: str) -> float:
    """A positive size in GiB (a decimal: 0.5 is 512 MiB)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a size in GiB above 0, not {text!r}")
    return value


def add_kv_tier_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-offloading-size",
        type=gib,
        default=None,
        metavar="GIB",
        help="host tier of every engine: KV blocks it evicts kept in this much host memory",
    )
    p.add_argument(
        "--kv-shared-dir",
        default=None,
        metavar="DIR",
        help="shared tier: a KV block store all engines read and write (created if missing; "
        "kvmesh engines only)",
    )
    p.add_argument(
        "--kv-shared-size",
        type=gib,
        default=None,
        metavar="GIB",
        help="most the shared tier keeps (default: the engine's, 10)",
    )


def check_kv_tier_args(args: argparse.Namespace, vllm: bool) -> None:
    """Refuse what no engine could run; make the shared directory (absolute: engines may run
    elsewhere)."""
    if args.kv_shared_size is not None and args.kv_shared_dir is None:
        raise SystemExit("kvmesh up: --kv-shared-size needs --kv-shared-dir")
    if args.kv_shared_dir is None:
        return
    if vllm:
        raise SystemExit("kvmesh up: --kv-shared-dir is kvmesh's engine's (not --engine vllm)")
    args.kv_shared_dir = os.path.abspath(args.kv_shared_dir)
    try:
        Path(args.kv_shared_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"kvmesh up: --kv-shared-dir {args.kv_shared_dir}: {exc}") from exc


def engine_kv_tier_args(args: argparse.Namespace, vllm: bool = False) -> list[str]:
    """The flags that give every engine (`kvmesh serve`, `vllm serve`, the stub) these tiers."""
    out = []
    if args.kv_offloading_size is not None:
        out += ["--kv-offloading-size", f"{args.kv_offloading_size:g}"]
        out += ["--kv-offloading-backend", "native"] if vllm else []
    if args.kv_shared_dir is not None:
        out += ["--kv-shared-dir", os.path.abspath(args.kv_shared_dir)]
    if args.kv_shared_size is not None:
        out += ["--kv-shared-size", f"{args.kv_shared_size:g}"]
    return out
