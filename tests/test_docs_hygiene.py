"""Docs and code describe the software, not the history of the work.

Fails when the documentation (docs/, README.md) or any Python source names a work session
("session 12"), a tracker reference ("issue 14", "#14") or an absolute path of one machine
(/work/..., /home/<user>/...). Measurements belong in docs/performance.md as dated tables
(date, machine, command, figures), which need none of these.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DOC_FILES = ["README.md"]
DOC_DIRS = ["docs"]
SOURCE_DIRS = ["engine", "router", "sidecar", "operator", "kvmesh", "bench", "tests"]
SKIP_DIRS = {"__pycache__", ".venv", "build", "node_modules"}

PATTERNS = {
    "work session": re.compile(r"\bsessions?\s+\d+", re.IGNORECASE),
    "tracker issue": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    # "#14", but not an HTML entity (&#14;), a URL fragment or a colour (#fff has letters).
    "tracker number": re.compile(r"(?<![\w&/#])#\d+\b"),
    "machine path": re.compile(r"(?<![\w.~-])/(?:work|home/[A-Za-z_][\w.-]*)/"),
}

# (file relative to the repository root, why it may hold a match). Keep this short: a line that
# describes the software never needs one.
ALLOWED = {
    "tests/test_docs_hygiene.py": "states the patterns it looks for",
}


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in DOC_FILES if (ROOT / name).exists()]
    for folder, suffix in [(d, ".md") for d in DOC_DIRS] + [(d, ".py") for d in SOURCE_DIRS]:
        for path in sorted((ROOT / folder).rglob(f"*{suffix}")):
            if not SKIP_DIRS.intersection(path.relative_to(ROOT).parts):
                files.append(path)
    return files


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for every match in text."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        for what, pattern in PATTERNS.items():
            if pattern.search(line):
                out.append((number, what, line.strip()))
    return out


@pytest.mark.parametrize(
    "line, what",
    [
        ("Measured in session 22 on the Zen 5.", "work session"),
        ("as sessions 14 and 15 found", "work session"),
        ("the workloads of issue 14", "tracker issue"),
        ("fixed in #123", "tracker number"),
        ("see /work/shared/bench/vllm_anchor.sh", "machine path"),
        ("cd /home/alice/kvmesh", "machine path"),
    ],
)
def test_each_pattern_catches_what_it_names(line, what):
    assert [w for _, w, _ in findings(line)] == [what]


@pytest.mark.parametrize(
    "line",
    [
        "an aiohttp session reuses connections",
        "the engine's HTTP session 'id'",
        "see [the table](#speculative-decoding)",
        "&#160; is a space",
        "https://example.com/page#12",
        "useradd --home-dir /home/ in a container is not scanned here",
        "relative/work/folder",
        "~/.cache/kvmesh/models/",
    ],
)
def test_patterns_leave_ordinary_text_alone(line):
    assert findings(line) == []


def test_the_scan_covers_docs_readme_and_sources():
    names = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert {
        "README.md",
        "docs/engine.md",
        "engine/scheduler.py",
        "router/app.py",
        "tests/test_docs_hygiene.py",
    } <= names
    assert not any("__pycache__" in n for n in names)


def offending_lines() -> list[str]:
    out = []
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for number, what, line in findings(path.read_text(encoding="utf-8", errors="replace")):
            out.append(f"{rel}:{number}: {what}: {line[:120]}")
    return out


def test_docs_and_sources_describe_the_software():
    offending = offending_lines()
    assert not offending, "history, tracker numbers or machine paths:\n" + "\n".join(offending)
