"""Where the real vLLM (the CPU build `make vllm` installs) is, for the tests and the local cluster.

One lookup (kvmesh.common.vllm_args.vllm_program, as `kvmesh up --engine vllm`): ``KVMESH_VLLM``
(the `vllm` program, or a virtual environment that has it), else ``.venv-vllm/`` in the checkout.
Tests that need it call ``require_vllm()``: it skips when vLLM is absent, except under CI
(``CI=true``), where an absent vLLM fails the test.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvmesh.common.vllm_args import vllm_program as find_vllm

CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = CHECKOUT / ".venv-vllm"
# vLLM's CPU build: a small KV cache (GiB), so two servers fit beside the test suite.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def vllm_program() -> str | None:
    """The `vllm` program, or None when vLLM is not installed."""
    return find_vllm(DEFAULT_VENV)


def vllm_bin_dir() -> str | None:
    """The directory of the `vllm` program (first on a vLLM container's PATH)."""
    program = vllm_program()
    return str(Path(program).parent) if program else None


def require_vllm() -> str:
    """The `vllm` program; skips the test without it (fails it under CI)."""
    import pytest

    program = vllm_program()
    if program is None:
        why = "the real vLLM is not installed (`make vllm`, or KVMESH_VLLM=path to its venv or program)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why + " and CI=true")
        pytest.skip(why)
    return program
