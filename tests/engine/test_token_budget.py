"""The token budget's defaults: `serve` on the CPU gets CPU_SERVER_TOKEN_BUDGET, everything else
(GPUs, `generate`, LLM) vLLM's 2048; the flag always wins."""

from __future__ import annotations

import argparse

from kvmesh.engine.cli_args import add_engine_arguments, engine_args_from
from kvmesh.engine.config import (
    CPU_SERVER_TOKEN_BUDGET,
    DEFAULT_TOKEN_BUDGET,
    EngineArgs,
    default_token_budget,
)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_serve_on_the_cpu_gets_the_smaller_budget():
    assert (
        CPU_SERVER_TOKEN_BUDGET
        < DEFAULT_TOKEN_BUDGET
        == EngineArgs().max_num_batched_tokens
        == 2048
    )
    assert (
        engine_args_from(_parse(["--device", "cpu"]), server=True).max_num_batched_tokens
        == CPU_SERVER_TOKEN_BUDGET
    )
    assert (
        engine_args_from(_parse(["--device", "cpu"])).max_num_batched_tokens == DEFAULT_TOKEN_BUDGET
    )  # generate
    assert (
        engine_args_from(_parse(["--device", "cuda"]), server=True).max_num_batched_tokens
        == DEFAULT_TOKEN_BUDGET
    )
    assert default_token_budget("cuda:1", server=True) == DEFAULT_TOKEN_BUDGET
    for server in (True, False):
        for device in ("cpu", "cuda"):
            args = _parse(["--device", device, "--max-num-batched-tokens", "3000"])
            assert engine_args_from(args, server=server).max_num_batched_tokens == 3000


def test_auto_device_follows_the_machine(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_token_budget("auto", server=True) == CPU_SERVER_TOKEN_BUDGET
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_token_budget("auto", server=True) == DEFAULT_TOKEN_BUDGET
    assert default_token_budget("auto", server=False) == DEFAULT_TOKEN_BUDGET


def test_the_server_builds_its_engine_with_the_serve_default(tiny_llama_dir):
    from kvmesh.engine.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    state = cli.build_state(parser.parse_args(["--model", tiny_llama_dir, "--device", "cpu"]))
    assert state.engine.engine_args.max_num_batched_tokens == CPU_SERVER_TOKEN_BUDGET
    state = cli.build_state(
        parser.parse_args(
            ["--model", tiny_llama_dir, "--device", "cpu", "--max-num-batched-tokens", "1024"]
        )
    )
    assert state.engine.engine_args.max_num_batched_tokens == 1024
