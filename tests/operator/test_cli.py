"""`kvmesh operator` wiring: flags, configuration, import without torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kvmesh.operator import cli, render

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_and_config():
    args = parse()
    assert args.liveness_port == 8080 and args.namespace == []
    config = cli.config_from_args(args)
    assert config.images == render.Images()
    assert config.connection is None and config.managed_redis_url is None


def test_flags_reach_the_config():
    args = parse(
        "--namespace",
        "a",
        "--namespace",
        "b",
        "--engine-image",
        "e:1",
        "--router-image",
        "r:1",
        "--redis-image",
        "redis:8",
        "--server",
        "http://127.0.0.1:1",
        "--managed-redis-url",
        "redis://x",
    )
    config = cli.config_from_args(args)
    assert args.namespace == ["a", "b"]
    assert config.images == render.Images(engine="e:1", router="r:1", redis="redis:8")
    assert (
        config.connection.server == "http://127.0.0.1:1" and config.managed_redis_url == "redis://x"
    )


def test_kvmesh_operator_subcommand_imports_without_torch():
    code = (
        "import sys, kvmesh.cli as c; m = c._load('operator'); import kvmesh.operator.handlers; "
        "assert hasattr(m, 'add_arguments') and hasattr(m, 'run'); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "operator", "--help"],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert "--liveness-port" in out and "--namespace" in out


def test_dockerfiles_run_kvmesh_as_non_root():
    for name, base, cmd in (
        ("engine", "nvidia/cuda", "serve"),
        ("router", "python:3.11", "router"),
        ("operator", "python:3.11", "operator"),
    ):
        text = (ROOT / "docker" / f"{name}.Dockerfile").read_text()
        assert base in text
        assert "USER 10001" in text and 'ENTRYPOINT ["kvmesh"]' in text and f'CMD ["{cmd}"' in text
    assert ".[operator]" in (ROOT / "docker/operator.Dockerfile").read_text()
    assert "torch" not in (ROOT / "docker/router.Dockerfile").read_text()
