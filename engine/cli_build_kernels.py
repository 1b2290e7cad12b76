"""`kvmesh build-kernels`: compile the engine's CPU kernels now, where a build is expected
(``make setup``, an image build), instead of on the first engine start."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=None,
        help="seconds to wait while another process builds them "
        "(default: KVMESH_CPU_KERNELS_WAIT_S or 900)",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if os.environ.get("KVMESH_CPU_KERNELS", "1") == "0":
        print("KVMESH_CPU_KERNELS=0: the CPU kernels are turned off; nothing to build")
        return 0
    from kvmesh.engine.kernels import cpu

    name = cpu.build_name()
    start = time.monotonic()
    try:
        cpu.build(args.wait_timeout)
    except Exception as exc:  # noqa: BLE001 - reported; the engine falls back to plain torch ops
        print(
            f"kvmesh build-kernels: the CPU kernels did not build: {exc}\n"
            "The engine still runs, with plain torch ops (slower).",
            file=sys.stderr,
        )
        return 1
    print(
        f"CPU kernels {name} ready in {cpu.build_directory(name)} ({time.monotonic() - start:.1f}s)"
    )
    return 0
