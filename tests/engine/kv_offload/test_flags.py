"""The tier flags: parsed into EngineArgs, validated with errors that name the flag."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.engine.cli_args import add_engine_arguments, engine_args_from
from kvmesh.engine.config import EngineArgs
from kvmesh.engine.kv_offload.tiers import host_blocks_for


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_args_from(parser.parse_args(list(argv)))


def test_defaults_are_off():
    args = parse()
    assert args.kv_offloading_size is None and args.kv_offloading_backend == "native"
    assert args.kv_shared_dir is None and args.kv_shared_size == 10.0


def test_flags_reach_engine_args():
    args = parse(
        "--kv-offloading-size", "8", "--kv-shared-dir", "/mnt/kv", "--kv-shared-size", "20.5"
    )
    assert args.kv_offloading_size == 8.0
    assert args.kv_shared_dir == "/mnt/kv" and args.kv_shared_size == 20.5
    args.validate()


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("kv_offloading_size", 0.0, "--kv-offloading-size"),
        ("kv_offloading_size", -1.0, "--kv-offloading-size"),
        ("kv_shared_size", 0.0, "--kv-shared-size"),
    ],
)
def test_a_size_that_is_not_positive_names_its_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        EngineArgs(**{field: value}).validate()


@pytest.mark.parametrize("backend", ["lmcache", "LMCacheConnectorV1", ""])
def test_only_the_native_backend_is_accepted(backend):
    with pytest.raises(ValueError, match="--kv-offloading-backend.*'native'"):
        EngineArgs(kv_offloading_backend=backend).validate()


def test_llm_kwargs_take_the_tier_fields():
    args = EngineArgs.from_kwargs("m", kv_offloading_size=1.5, kv_shared_dir="/x")
    assert args.kv_offloading_size == 1.5 and args.kv_shared_dir == "/x"


def test_host_blocks_from_gib():
    assert host_blocks_for(None, 1024) == 0
    assert host_blocks_for(1.0, 2**20) == 1024
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        host_blocks_for(1e-9, 2**20)
