"""The benchmark scripts are not run by the suite (they take minutes, or a GPU), so a moved
function breaks them silently until someone runs one on a rare GPU lease. This checks what
can be checked cheaply: every kvmesh name a script imports exists, and every script or test
a shell driver calls is there."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def kvmesh_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for `from kvmesh... import name` and (module, None) for `import kvmesh...`,
    wherever they sit in the script (most import inside functions)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvmesh":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "kvmesh"]
    return found


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 5 and all(kvmesh_imports(p) is not None for p in SCRIPTS)
    assert any(kvmesh_imports(p) for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_kvmesh_import_of_a_bench_script_resolves(script):
    missing = []
    for module, name in kvmesh_imports(script):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{script.name} imports names that do not exist: {missing}"


@pytest.mark.parametrize("driver", sorted(BENCH.glob("*.sh")), ids=lambda p: p.name)
def test_every_file_a_shell_driver_runs_exists(driver):
    root = BENCH.parent
    referenced = set(re.findall(r"\b((?:bench|tests)/[\w/]+\.py)\b", driver.read_text()))
    assert all((root / r).is_file() for r in referenced), \
        f"{driver.name} runs files that are not there: {[r for r in referenced if not (root / r).is_file()]}"
