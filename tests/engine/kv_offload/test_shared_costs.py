"""A block from the shared tier costs its file's read plus its copy into the KV cache."""

from __future__ import annotations

import pytest

from kvmesh.engine.kv_offload.costs import BlockCostMeter


def test_a_shared_block_costs_its_read_and_its_copy():
    meter = BlockCostMeter()
    meter.observe_step(1.0, 160, 160, 16)  # 0.1 s per prefilled block
    assert meter.costs().shared == pytest.approx(0.01)  # the contract's default ratio
    meter.observe_read("SHARED", 0.004, 2)
    assert meter.costs().shared == pytest.approx(0.002)  # the read alone, until a copy is timed
    meter.observe_load("SHARED", 0.001, 1)
    assert meter.costs().shared == pytest.approx(0.003)
    assert meter.costs().cpu == pytest.approx(0.005)  # the host tier has no file to read
