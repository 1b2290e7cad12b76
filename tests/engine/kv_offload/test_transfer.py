"""A step's copies on the CPU: stores run before loads, host slots and payloads land exactly."""

from __future__ import annotations

import torch

from kvmesh.engine.kv_offload.block_io import pack_block
from kvmesh.engine.kv_offload.costs import BlockCostMeter
from kvmesh.engine.kv_offload.transfer import KVLoad, KVStore, TransferEngine, Transfers
from tests.engine.kv_offload.test_block_io import caches


def test_a_block_evicted_and_refilled_in_one_step_is_stored_first():
    kv = caches(blocks=4)
    engine = TransferEngine(kv, 2, torch.device("cpu"), BlockCostMeter())
    old = [(k[:, 1].clone(), v[:, 1].clone()) for k, v in kv]
    engine.run(kv, Transfers([KVStore(1, 0)]))  # block 1's content now in slot 0
    b2 = pack_block(kv, 2)
    # one step: block 2 is evicted into slot 1 and refilled from slot 0 (block 1's old content)
    engine.run(kv, Transfers([KVStore(2, 1)], [KVLoad(2, 0)]))
    for (k, v), (ok, ov) in zip(kv, old):
        assert torch.equal(k[:, 2], ok) and torch.equal(v[:, 2], ov)
    engine.run(kv, Transfers([], [KVLoad(3, 1)]))
    assert pack_block(kv, 3) == b2


def test_payload_loads_and_their_cost():
    src, dst = caches(seed=1), caches(seed=2)
    meter = BlockCostMeter()
    engine = TransferEngine(dst, 0, torch.device("cpu"), meter)
    payload = pack_block(src, 4)
    engine.run(dst, Transfers([], [KVLoad(0, payload=payload)]))
    assert pack_block(dst, 0) == payload
    assert meter.seconds["SHARED"] >= 0 and "CPU" not in meter.seconds


def test_costs_default_to_the_contract_ratios_until_measured():
    meter = BlockCostMeter()
    assert meter.by_source() == {"prefill": 1.0, "CPU": 0.05, "SHARED": 0.10}
    meter.observe_step(2.0, prefill_tokens=64, total_tokens=128, block_size=16)
    assert meter.costs().prefill == 2.0 * 0.5 / 4  # its prefill share, per block
    assert meter.costs().cpu == 0.05 * meter.costs().prefill
    meter.observe_load("CPU", 0.01, 2)
    assert meter.costs().cpu == 0.005
    meter.observe_step(1.0, prefill_tokens=8, total_tokens=8, block_size=16)  # under a block
    assert meter.costs().prefill == 0.25
