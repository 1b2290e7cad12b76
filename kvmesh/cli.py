"""The `kvmesh` command. Each component owns its subcommands in its own `cli` module;
this file only wires them together and imports them lazily (the router must start
without torch, the operator without the engine)."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvmesh.engine.cli_generate", "generate text offline with the engine"),
    "serve": ("kvmesh.engine.server.cli", "run one engine replica (OpenAI-compatible HTTP server)"),
    "sidecar": ("kvmesh.sidecar.cli", "publish an engine's KV-cache events to Redis"),
    "router": ("kvmesh.router.cli", "run the prefix-aware router"),
    "up": ("kvmesh.mesh.up", "run a local mesh: Redis, engines with sidecars, router"),
    "status": ("kvmesh.mesh.status", "show the replicas of a running mesh"),
    "operator": ("kvmesh.operator.cli", "run the Kubernetes operator"),
    "convert": (
        "kvmesh.engine.cli_convert",
        "convert the built-in model (GGUF) to a Hugging Face directory",
    ),
    "build-kernels": (
        "kvmesh.engine.cli_build_kernels",
        "compile the engine's CPU kernels ahead of the first start",
    ),
}


def _load(name: str):
    module, _ = SUBCOMMANDS[name]
    return importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    try:
        module = _load(name)
    except ModuleNotFoundError as exc:
        print(f"kvmesh {name}: not available ({exc})", file=sys.stderr)
        return 2
    sub_parser = argparse.ArgumentParser(prog=f"kvmesh {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
