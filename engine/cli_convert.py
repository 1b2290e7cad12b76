"""`kvmesh convert`: build a built-in model's cached Hugging Face directory now."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.common.model_lookup import BUILTIN_MODELS, DEFAULT_MODEL

    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, choices=sorted(BUILTIN_MODELS))


def run(args: argparse.Namespace) -> int:
    from kvmesh.engine.builtin import resolve_model_dir

    print(resolve_model_dir(args.model))
    return 0
