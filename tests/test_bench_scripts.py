"""The benchmark scripts are not run by the suite (they take minutes, or a GPU), so a moved
function breaks them silently until someone runs one on a rare GPU lease. This checks what
can be checked cheaply: every kvmesh name a script imports exists, and every script or test
a shell driver calls is there."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
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


def test_a_paused_server_and_its_children_take_no_cpu_until_resumed(tmp_path):
    """bench/serve.py's comparison pauses the server it does not measure (an idle vLLM polls and
    stalls the measured engine's OpenMP threads): the whole process group stops, the engine core
    child too, and runs on when resumed; stop() works on a paused server."""
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = serve  # its dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(serve)
    finally:
        del sys.modules[spec.name]
    counter = tmp_path / "ticks"
    child = f"import time\nwhile True:\n    open({str(counter)!r}, 'a').write('.')\n    time.sleep(0.01)\n"
    parent = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(3600)\n"
    srv = object.__new__(serve.LocalServer)  # the process handling only, not a kvmesh server
    srv.proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    srv.log = open(tmp_path / "log", "w")
    try:
        deadline = time.monotonic() + 30
        while not counter.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.pause()
        time.sleep(0.2)  # a tick already under way lands
        paused_at = counter.stat().st_size
        time.sleep(0.5)
        assert counter.stat().st_size == paused_at, "the grandchild ran on while paused"
        srv.resume()
        time.sleep(0.5)
        assert counter.stat().st_size > paused_at + 5, "the grandchild did not run on when resumed"
        srv.pause()
    finally:
        srv.stop()  # resumes first: a stopped process would hold the SIGTERM
        with contextlib.suppress(ProcessLookupError):  # the grandchild, which SIGTERM to the parent leaves
            os.killpg(srv.proc.pid, signal.SIGKILL)
    assert srv.proc.returncode is not None
