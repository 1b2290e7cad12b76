"""The adapter flags of `kvmesh serve` (vLLM's), the server's adapter registry and the
vllm:lora_requests_info gauge, without an engine."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.engine.lora.cli_args import LORA_NOT_ENABLED, lora_engine_args
from kvmesh.engine.lora.request import LoRAError, LoRARequest
from kvmesh.engine.server import cli, lora_metrics
from kvmesh.engine.server.adapters import ServedAdapters
from kvmesh.engine.server.errors import APIError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--model", "/m", *argv])


def test_lora_modules_name_path_and_json_forms_several_values():
    args = parse(
        "--enable-lora",
        "--lora-modules",
        "a=/ad/a",
        json.dumps({"name": "b", "path": "/ad/b", "base_model_name": "tiny"}),
        "--lora-modules",
        "c=/ad/c",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "3",
        "--max-lora-rank",
        "32",
    )
    got = lora_engine_args(args, "tiny")
    assert got == {
        "enable_lora": True,
        "max_loras": 2,
        "max_cpu_loras": 3,
        "max_lora_rank": 32,
        "lora_modules": [
            LoRARequest("a", 1, "/ad/a"),
            LoRARequest("b", 2, "/ad/b", "tiny"),
            LoRARequest("c", 3, "/ad/c"),
        ],
    }


def test_defaults_are_vllms():
    got = lora_engine_args(parse(), "tiny")
    assert got == {
        "enable_lora": False,
        "max_loras": 1,
        "max_cpu_loras": None,
        "max_lora_rank": 16,
        "lora_modules": [],
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-loras", "0"], "argument --max-loras: must be a positive integer, got '0'"),
        (["--max-cpu-loras", "x"], "argument --max-cpu-loras: must be a positive integer"),
        (["--max-lora-rank", "7"], "argument --max-lora-rank: invalid choice: 7"),
        (["--lora-modules", "{bad"], "argument --lora-modules: invalid JSON format: {bad"),
        (["--lora-modules", "=/p"], "argument --lora-modules: expected name=path, got '=/p'"),
        (["--lora-modules", "a="], "argument --lora-modules: expected name=path, got 'a='"),
        (["--lora-modules", '{"name": "a"}'], "invalid fields in"),
        (["--lora-modules", '{"name": "a", "path": "/p", "rank": 4}'], "(unknown: rank)"),
        (["--lora-modules", "[1, 2]"], "expected name=path or a JSON object"),
    ],
)
def test_bad_values_are_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-modules", "a=/p"], f"--lora-modules: {LORA_NOT_ENABLED}"),
        (
            ["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
            "--max-cpu-loras (2) must be >= --max-loras (4)",
        ),
        (
            ["--enable-lora", "--lora-modules", "a=/p", "a=/q"],
            "--lora-modules: adapter name 'a' is given twice",
        ),
        (
            ["--enable-lora", "--lora-modules", "tiny=/p"],
            "--lora-modules: adapter name 'tiny' is the base model's name",
        ),
        (
            [
                "--enable-lora",
                "--lora-modules",
                '{"name": "a", "path": "/p", "base_model_name": "x"}',
            ],
            "--lora-modules: adapter 'a' names base model 'x'; this server serves 'tiny'",
        ),
    ],
)
def test_refused_combinations_stop_the_server_with_exit_2(argv, message, capsys):
    args = parse("--served-model-name", "tiny", *argv)
    with pytest.raises(ValueError) as exc:
        lora_engine_args(args, "tiny")
    assert str(exc.value) == message
    assert cli.run(args) == 2  # "cannot start: ..." before any engine starts
    assert f"cannot start: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value, on", [(None, False), ("0", False), ("no", False), ("1", True), (" True ", True)]
)
def test_runtime_updating_switch_reads_vllms_variable(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    assert cli.runtime_lora_updating() is on


# -- the registry -------------------------------------------------------------------------------
def _entry(name: str, lora_id: int, path: str = "/p", digest: str = "d") -> dict:
    return {
        "name": name,
        "id": lora_id,
        "path": path,
        "digest": digest,
        "rank": 4,
        "base_model_name": None,
    }


class _Core:
    """The utility calls a ServedAdapters makes, on a dict (an LRU of `capacity` names)."""

    def __init__(self, capacity: int = 8, refuse: str | None = None):
        self.engine_args = argparse.Namespace(enable_lora=True)
        self.loras: dict[str, dict] = {}
        self.capacity, self.refuse = capacity, refuse
        self.calls: list[tuple] = []

    async def utility(self, name: str, *args):
        self.calls.append((name, *args))
        if name == "add_lora":
            req = args[0]
            if self.refuse:
                raise LoRAError(self.refuse)
            self.loras.pop(req.lora_name, None)
            self.loras[req.lora_name] = _entry(req.lora_name, req.lora_int_id, req.lora_path)
            while len(self.loras) > self.capacity:
                self.loras.pop(next(iter(self.loras)))
            return self.loras[req.lora_name]
        if name == "remove_lora":
            return self.loras.pop(args[0], None) is not None
        return list(self.loras.values())


def _run(coro):
    return asyncio.run(coro)


def _error(coro) -> APIError:
    with pytest.raises(APIError) as exc:
        _run(coro)
    return exc.value


def test_load_unload_and_inplace_keep_load_order_and_ids():
    reg, core = ServedAdapters(), _Core()
    assert _run(reg.load(core, "a", "/a", False, "tiny")) == (
        "Success: LoRA adapter 'a' added successfully."
    )
    _run(reg.load(core, "b", "/b", False, "tiny"))
    _run(reg.load(core, "a", "/a2", True, "tiny"))  # in place: its id, its place
    assert [(n, d["id"], d["path"]) for n, d in reg.loaded.items()] == [
        ("a", 1, "/a2"),
        ("b", 2, "/b"),
    ]
    assert _run(reg.unload(core, "a")) == "Success: LoRA adapter 'a' removed successfully."
    assert list(reg.loaded) == ["b"]
    _run(reg.load(core, "a", "/a3", False, "tiny"))
    assert reg.loaded["a"]["id"] == 3  # ids are never reused
    assert reg.resolve("a", "tiny") == "a" and reg.resolve("tiny", "tiny") is None
    assert reg.resolve(None, "tiny") is None


def test_an_adapter_the_core_unloaded_to_make_room_is_gone():
    reg, core = ServedAdapters(), _Core(capacity=2)
    for name in ("a", "b", "c"):
        _run(reg.load(core, name, f"/{name}", False, "tiny"))
    assert list(reg.loaded) == ["b", "c"]
    with pytest.raises(APIError) as exc:
        reg.resolve("a", "tiny")
    assert exc.value.status == 404


def test_registry_errors_are_vllms():
    reg, core = ServedAdapters(), _Core()
    _run(reg.load(core, "a", "/a", False, "tiny"))
    cases = [
        (
            reg.load(core, "", "/p", False, "tiny"),
            400,
            "Both 'lora_name' and 'lora_path' must be provided.",
        ),
        (
            reg.load(core, "x", "", False, "tiny"),
            400,
            "Both 'lora_name' and 'lora_path' must be provided.",
        ),
        (
            reg.load(core, "a", "/a", False, "tiny"),
            400,
            "The lora adapter 'a' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True.",
        ),
        (
            reg.load(core, "tiny", "/a", False, "tiny"),
            400,
            "The lora adapter name 'tiny' conflicts with a served base model.",
        ),
        (reg.unload(core, ""), 400, "'lora_name' needs to be provided to unload a LoRA adapter."),
        (reg.unload(core, "zz"), 404, "The lora adapter 'zz' cannot be found."),
    ]
    for coro, status, message in cases:
        err = _error(coro)
        assert (err.status, err.message) == (status, message)
    assert [c[0] for c in core.calls] == ["add_lora", "list_loras"]  # refused before the core
    core.engine_args.enable_lora = False
    err = _error(reg.load(core, "b", "/b", False, "tiny"))
    assert (err.status, err.message) == (400, LORA_NOT_ENABLED)


def test_the_cores_refusal_is_a_400_with_its_message_and_nothing_changes():
    reg, core = ServedAdapters(), _Core()
    _run(reg.load(core, "a", "/a", False, "tiny"))
    core.refuse = "adapter 'b': rank 32 of q_proj exceeds max_lora_rank 16"
    err = _error(reg.load(core, "b", "/b", False, "tiny"))
    assert (err.status, err.message) == (400, core.refuse)
    assert list(reg.loaded) == ["a"]


# -- vllm:lora_requests_info ------------------------------------------------------------------------
class _Stats:
    def __init__(self, running, waiting):
        self.running_lora_adapters, self.waiting_lora_adapters = running, waiting


def _text(info) -> str:
    reg = CollectorRegistry()

    class _C:
        def collect(self):
            yield info.family()

    reg.register(_C())
    return generate_latest(reg).decode()


def test_lora_requests_info_text_and_its_time(monkeypatch):
    now = [1000.5]
    monkeypatch.setattr(lora_metrics.time, "time", lambda: now[0])
    info = lora_metrics.LoraRequestsInfo(max_loras=2)
    head = (
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
    )
    assert _text(info) == head + (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1000.5\n'
    )
    now[0] = 1001.25
    info.observe(_Stats(["a", "b"], ["c"]))
    now[0] = 1002.0
    info.observe(_Stats(["a", "b"], ["c"]))  # unchanged: the time stays the change's
    assert _text(info) == head + (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1001.25\n'
    )
