"""A finished kernel build, recorded in its build directory, is loaded as it is, never handed to ninja again.

torch's ``load`` runs ninja on every start, and ninja rebuilds whatever it did not build
itself: another checkout (other source paths in ``build.ninja``) or another venv's ninja (its
own ``.ninja_log``) sharing torch's extension directory made every start rebuild. The build
directory is keyed by everything the library depends on (kernels/cpu.py), so a library that
a finished build left there, whoever built it, is the one this process would build.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RECORD_NAME = "kvmesh-built.json"


def library(directory: Path, name: str) -> Path:
    from torch.utils.cpp_extension import LIB_EXT

    return directory / f"{name}{LIB_EXT}"


def finished(directory: Path, name: str) -> bool:
    """Whether a build of ``name`` finished in ``directory`` (its record and its library are there)."""
    try:
        recorded = json.loads((directory / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("name") == name and library(directory, name).exists()


def record(directory: Path, name: str, inputs: dict[str, Any]) -> None:
    """Mark the build of ``name`` finished (written whole: a reader never sees half a record)."""
    tmp = directory / f"{RECORD_NAME}.{os.getpid()}"
    tmp.write_text(json.dumps({"name": name, **inputs}, indent=1))
    os.replace(tmp, directory / RECORD_NAME)


def load_finished(directory: Path, name: str) -> Any | None:
    """The module of a finished build, or None (none recorded, or its library does not load)."""
    if not finished(directory, name):
        return None
    from torch.utils import cpp_extension

    try:
        return cpp_extension._import_module_from_library(name, str(directory), True)
    except (ImportError, OSError) as exc:  # damaged since: built again
        log.warning(
            "the CPU kernels recorded as built in %s do not load (%s): building them again",
            directory,
            exc,
        )
        (directory / RECORD_NAME).unlink(missing_ok=True)
        return None
