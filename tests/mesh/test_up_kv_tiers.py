"""`kvmesh up`'s KV tier flags: the arguments every engine gets (`kvmesh serve`, the stub, `vllm
serve`), the shared directory made, and what no engine could run refused (no process started)."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.mesh import stub_engine, up
from kvmesh.mesh.kv_tier_args import check_kv_tier_args, engine_kv_tier_args
from tests.mesh.test_up_vllm import _args, fake_vllm  # noqa: F401 - the fixture


class FakeChild:
    """Records the argv a replica's process would have started with."""

    started: list[tuple[str, list[str]]] = []

    def __init__(self, name, argv, env, policy, **_kw):
        self.name, self.argv = name, argv

    def start(self):
        FakeChild.started.append((self.name, self.argv))
        return self


def _engine_argv(monkeypatch, args: argparse.Namespace, template: str | None = None) -> list[str]:
    monkeypatch.setattr(up, "Child", FakeChild)
    FakeChild.started = []
    mesh = up.Mesh(args)
    mesh.engine_template = template or mesh.engine_template
    try:
        mesh.add_replica()
    finally:
        up.shutil.rmtree(mesh.backends_dir, ignore_errors=True)
    return next(argv for name, argv in FakeChild.started if name == "engine-0")


def test_every_engine_gets_the_kv_tier_flags(monkeypatch, tmp_path):
    shared = tmp_path / "kv" / "shared"
    args = _args(
        *("--kv-offloading-size", "0.5", "--kv-shared-dir", str(shared)),
        *("--kv-shared-size", "20", "--engine-args", "--seed 1"),
    )
    check_kv_tier_args(args, vllm=False)
    assert shared.is_dir()  # created if missing
    argv = _engine_argv(monkeypatch, args)
    assert argv[-8:] == [
        *("--kv-offloading-size", "0.5", "--kv-shared-dir", str(shared)),
        *("--kv-shared-size", "20", "--seed", "1"),
    ]


def test_the_stub_engine_accepts_the_flags(monkeypatch, tmp_path):
    args = _args("--kv-offloading-size", "8", "--kv-shared-dir", str(tmp_path))
    argv = _engine_argv(monkeypatch, args, up.STUB_ENGINE_COMMAND)
    assert argv[1:3] == ["-m", "kvmesh.mesh.stub_engine"]
    parsed = stub_engine.build_parser().parse_args(argv[3:])  # it keeps no tier: accepted
    assert (parsed.kv_offloading_size, parsed.kv_shared_dir) == (8.0, str(tmp_path))


def test_without_the_flags_no_engine_gets_any():
    assert engine_kv_tier_args(_args()) == []
    assert engine_kv_tier_args(_args(), vllm=True) == []


def test_a_relative_shared_dir_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    args = _args("--kv-shared-dir", "kv")
    check_kv_tier_args(args, vllm=False)
    assert (tmp_path / "kv").is_dir()
    assert engine_kv_tier_args(args) == ["--kv-shared-dir", str(tmp_path / "kv")]


def test_vllm_engines_get_the_host_tier_by_vllm_flags(fake_vllm, tmp_path):  # noqa: F811
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = _args("--engine", "vllm", "--model", str(model), "--kv-offloading-size", "4")
    check_kv_tier_args(args, vllm=True)
    argv = up.Mesh(args)._vllm_argv(8100, 5600, 5601)
    assert argv[-4:] == ["--kv-offloading-size", "4", "--kv-offloading-backend", "native"]


@pytest.mark.parametrize(
    ("argv", "vllm", "message"),
    [
        (["--kv-shared-size", "5"], False, "--kv-shared-size needs --kv-shared-dir"),
        (["--kv-shared-dir", "/tmp/kv"], True, "not --engine vllm"),
    ],
)
def test_what_no_engine_could_run_is_refused(argv, vllm, message):
    with pytest.raises(SystemExit, match=message):
        check_kv_tier_args(_args(*argv), vllm=vllm)


@pytest.mark.parametrize("size", ["0", "-1", "lots", "inf"])
def test_a_size_must_be_gib_above_zero(size, capsys):
    for flag in ("--kv-offloading-size", "--kv-shared-size"):
        with pytest.raises(SystemExit):
            _args(flag, size)
        assert "a size in GiB above 0" in capsys.readouterr().err
