"""The repository layout (design card): one folder per component at the root, imported
under the kvmesh namespace through setuptools' package-dir mapping."""

from __future__ import annotations

import operator
import subprocess
import sys
import tomllib
from pathlib import Path

import kvmesh.engine
import kvmesh.operator
import kvmesh.router
import kvmesh.sidecar

ROOT = Path(__file__).resolve().parents[1]


def test_stdlib_operator_is_not_shadowed():
    # The repository root is on sys.path under pytest; `operator/` must still not be `operator`.
    assert Path(operator.__file__).name == "operator.py"
    assert hasattr(operator, "itemgetter")


def test_child_processes_see_the_stdlib_operator():
    # A child started from the repository root (cwd on sys.path) imports the stdlib's module
    # and the component under its kvmesh name.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import operator, kvmesh.operator as k; print(operator.__file__, k.__file__)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    stdlib, component = out.stdout.split()
    assert Path(stdlib).name == "operator.py"
    assert Path(component) == ROOT / "operator" / "__init__.py"


def test_components_live_at_the_repository_root():
    for module, folder in (
        (kvmesh.engine, "engine"),
        (kvmesh.router, "router"),
        (kvmesh.sidecar, "sidecar"),
        (kvmesh.operator, "operator"),
    ):
        assert Path(module.__file__).resolve().parent == ROOT / folder


def _packages_under(mapping: dict[str, str], base: Path) -> set[str]:
    """Every package (a folder with __init__.py) under the mapped folders, at its import name."""
    found = set()
    for name, folder in mapping.items():
        for init in (base / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(base / folder).parts
            found.add(".".join((name, *rel)))
    return found


def test_pyproject_lists_every_package():
    # setuptools installs only the listed packages: a new sub-package left out of the list
    # would work in an editable install and be missing from the wheel (and the images).
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = _packages_under({"kvmesh": "kvmesh", **tool["package-dir"]}, ROOT)
    # a mapped folder under kvmesh/ would be found twice; the mapped name wins
    assert found == listed, (sorted(found - listed), sorted(listed - found))


def test_dev_distribution_lists_every_package():
    # the test support (tests/support/, imported as kvmesh_testing): the same rule for its list
    support = ROOT / "tests" / "support"
    tool = tomllib.loads((support / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    assert tool["package-dir"] == {"kvmesh_testing": "."}
    assert _packages_under(tool["package-dir"], support) == listed, sorted(listed)


def test_the_shipped_package_holds_no_test_support():
    # kvmesh/ is the CLI and what the components share; test support lives in tests/support/
    assert sorted(p.name for p in (ROOT / "kvmesh").iterdir() if p.name != "__pycache__") == [
        "__init__.py",
        "cli.py",
        "cli_reference.py",
        "common",
        "mesh",
    ]


# torch (and transformers) are the engine's: the router, the sidecar, the operator, the local
# mesh's supervisor and the shared contracts must import, and the router must start, without them.
_NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked: this module must import without torch")

sys.meta_path.insert(0, NoTorch())
"""
WITHOUT_TORCH = [
    "kvmesh.common.block_keys",
    "kvmesh.common.kv_events",
    "kvmesh.common.logging_setup",
    "kvmesh.common.model_lookup",
    "kvmesh.common.openapi",
    "kvmesh.common.protocol",
    "kvmesh.common.redis_layout",
    "kvmesh.common.worker_pool",
    "kvmesh.common.tokenizer",
    "kvmesh.router.app",
    "kvmesh.router.cli",
    "kvmesh.router.policies",
    "kvmesh.sidecar.service",
    "kvmesh.sidecar.cli",
    "kvmesh.operator.handlers",
    "kvmesh.operator.scaling",
    "kvmesh.operator.cli",
    "kvmesh.operator.generate",
    "kvmesh.mesh.up",
    "kvmesh.mesh.status",
    "kvmesh.mesh.stub_engine",
]


def test_components_import_without_torch():
    code = (
        _NO_TORCH
        + f"""
import importlib
for name in {WITHOUT_TORCH!r}:
    importlib.import_module(name)
from kvmesh.router.app import Router, RouterConfig
router = Router(RouterConfig(redis_url=None, static_backends=["http://127.0.0.1:9"]))  # loads its tokenizer
assert router.encoder.encode("hello world")
assert not {{"torch", "transformers"}} & {{m.split(".")[0] for m in sys.modules}}
print("ok")
"""
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_torch_blocker_blocks():
    # the check above proves something only if importing torch under the blocker fails
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH + "import kvmesh.engine.config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "torch is blocked" in out.stderr


def test_a_bare_python_in_the_root_is_safe_only_with_dash_P():
    # What broke a fresh clone's `make setup`: a venv with no .pth files has not imported the
    # stdlib's operator at start-up, so `python -m ...` from the root imported ./operator.
    # The Makefile runs every Python with -P (no working directory on sys.path).
    bare = [sys.executable, "-S", "-m", "json.tool", "--help"]
    assert subprocess.run(bare, cwd=ROOT, capture_output=True, timeout=60).returncode != 0
    safe = [sys.executable, "-S", "-P", "-m", "json.tool", "--help"]
    out = subprocess.run(safe, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    makefile = (ROOT / "Makefile").read_text()
    assert "PY := $(VENV)/bin/python -P" in makefile and "$(PYTHON) -P -m venv" in makefile


# Test support (tests/support/, the kvmesh_testing distribution) never runs inside production
# code: no component and no shared module imports it, or names one of its modules for a run-time
# import. The stub engine behind `kvmesh up --engine-command stub` is production (kvmesh.mesh).
PRODUCTION = ["engine", "router", "sidecar", "operator", "kvmesh"]
TESTING = "kvmesh_testing"


def _is_testing(module: str) -> bool:
    return module.split(".")[0] == TESTING


def _testing_references(path: Path) -> tuple[list[str], list[str]]:
    """(imports of kvmesh_testing, non-docstring string constants naming it) in one source file."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    imports, strings = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports += [f"line {node.lineno}: {a.name}" for a in node.names if _is_testing(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level:  # relative imports stay in kvmesh
            if _is_testing(node.module or ""):
                imports.append(f"line {node.lineno}: {node.module}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and TESTING in node.value
        ):
            strings.append(f"line {node.lineno}: {node.value[:60]!r}")
    return imports, strings


def test_no_production_module_imports_test_support():
    imports, strings = {}, {}
    for folder in PRODUCTION:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found_imports, found_strings = _testing_references(path)
            if found_imports:
                imports[rel] = found_imports
            if found_strings:
                strings[rel] = found_strings
    assert not imports, f"production modules import kvmesh_testing: {imports}"
    assert not strings, (
        f"production code names kvmesh_testing modules (a run-time import?): {strings}"
    )


def test_the_test_support_check_finds_what_it_looks_for(tmp_path):
    # the check above proves something only if it sees each form of the reference
    src = tmp_path / "m.py"
    src.write_text(
        '"""Docs may mention kvmesh_testing."""\nimport os, kvmesh_testing.chaos\n'
        "from kvmesh_testing.core_hooks import restore\nfrom kvmesh_testing import cluster, node\n"
        "from . import testing as here\nimport kvmesh_testing as t\nPREFIX = 'kvmesh_testing.'\n"
    )
    imports, strings = _testing_references(src)
    assert imports == [
        "line 2: kvmesh_testing.chaos",
        "line 3: kvmesh_testing.core_hooks",
        "line 4: kvmesh_testing",
        "line 6: kvmesh_testing",
    ]
    assert strings == ["line 7: 'kvmesh_testing.'"]
