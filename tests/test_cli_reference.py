"""docs/cli.md is generated from the subcommands' argparse parsers (kvmesh/cli_reference.py)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from kvmesh import cli_reference
from kvmesh.cli import SUBCOMMANDS
from tests.test_layout import _NO_TORCH

ROOT = Path(__file__).resolve().parents[1]


def test_docs_cli_md_is_current(monkeypatch):
    # Generated in a shell whose environment would change env-read defaults: the file must not
    # depend on it (nor on the machine's name, the sidecar's --pod-name default).
    monkeypatch.setenv("KVMESH_REDIS_URL", "redis://somewhere-else:6379/3")
    monkeypatch.setenv("POD_NAME", "this-shell")
    text = cli_reference.reference_markdown()
    on_disk = (ROOT / cli_reference.DOC).read_text()
    assert text == on_disk, f"docs/cli.md is stale: run `{cli_reference.COMMAND}` and commit it"
    assert "somewhere-else" not in text and "this-shell" not in text
    assert "| `--pod-name POD_NAME` (env `POD_NAME`) | `<hostname>` |" in text


def _section(text: str, name: str) -> str:
    return text.split(f"## `kvmesh {name}`\n", 1)[1].split("\n## ", 1)[0]


def test_every_flag_of_every_subcommand_is_documented_with_its_default():
    text = (ROOT / cli_reference.DOC).read_text()
    for name in SUBCOMMANDS:
        parser, _ = cli_reference.build_parser(name)
        section = _section(text, name)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            first = action.option_strings[0] if action.option_strings else action.dest.upper()
            row = next(
                (
                    line
                    for line in section.splitlines()
                    if re.match(rf"\| `{re.escape(first)}[ `]", line)
                ),
                None,
            )
            assert row is not None, (name, action.option_strings or action.dest)
            assert all(f"`{o}" in row.split(" | ")[0] for o in action.option_strings), (
                row
            )  # --no-... too
            default = row.split(" | ")[1]
            assert default == cli_reference._default(action), (name, row)
            if action.help:
                assert " ".join(action.help.split()) in row.replace("\\|", "|"), (name, row)
        documented = set(re.findall(r"^\| `(--[a-z0-9-]+)", section, re.M))
        assert documented == {
            a.option_strings[0]
            for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)
        }, name


def test_env_defaults_name_their_variable():
    text = (ROOT / cli_reference.DOC).read_text()
    assert (
        "| `--redis-url URL` (env `KVMESH_REDIS_URL`) | `redis://127.0.0.1:6379/0` |"
        in _section(text, "router")
    )
    assert "(env `KVMESH_POD_URL`)" in _section(text, "sidecar")
    assert "(env `COLUMNS`" not in text  # argparse's own reads are not the flag's


def test_stale_file_is_reported_with_the_command(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / cli_reference.DOC).write_text("old\n")
    assert cli_reference.main(["--check", "--root", str(tmp_path)]) == 1
    assert cli_reference.COMMAND in capsys.readouterr().err
    assert cli_reference.main(["--root", str(tmp_path)]) == 0
    assert cli_reference.main(["--check", "--root", str(tmp_path)]) == 0
    assert (tmp_path / cli_reference.DOC).read_text() == (ROOT / cli_reference.DOC).read_text()


def test_the_cli_still_imports_one_subcommand_only():
    # The generator imports every subcommand; `kvmesh router` must still start without torch.
    code = (
        _NO_TORCH
        + """
import kvmesh.cli as c
c._load("router")
assert "kvmesh.cli_reference" not in sys.modules and "kvmesh.engine.server.cli" not in sys.modules
print("ok")
"""
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
