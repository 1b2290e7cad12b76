"""A block's payload: pack/unpack round trips, gathers and scatters agree with it."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kv_offload.block_io import (
    block_bytes,
    gather_blocks,
    pack_block,
    scatter_blocks,
    unpack_block,
)


def caches(dtype=torch.float32, layers=2, heads=2, blocks=5, bs=4, hd=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (heads, blocks, bs, hd)
    return [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(layers)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_is_layer_by_layer_k_then_v(dtype):
    kv = caches(dtype)
    payload = pack_block(kv, 3)
    assert len(payload) == block_bytes(kv)
    expected = torch.cat([t[:, 3].reshape(-1) for k, v in kv for t in (k, v)])
    got = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
    assert torch.equal(got, expected)


def test_unpack_writes_one_block_only():
    src, dst = caches(seed=1), caches(seed=2)
    before = [(k.clone(), v.clone()) for k, v in dst]
    unpack_block(dst, 0, pack_block(src, 4))
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before):
        assert torch.equal(dk[:, 0], sk[:, 4]) and torch.equal(dv[:, 0], sv[:, 4])
        assert torch.equal(dk[:, 1:], bk[:, 1:]) and torch.equal(dv[:, 1:], bv[:, 1:])


def test_unpack_refuses_a_payload_of_the_wrong_size():
    kv = caches()
    with pytest.raises(ValueError):
        unpack_block(kv, 0, b"\0" * 8)


def test_gather_then_scatter_moves_blocks():
    src, dst = caches(seed=1), caches(seed=2)
    rows = gather_blocks(src, torch.tensor([2, 0]))
    scatter_blocks(dst, torch.tensor([1, 3]), rows)
    for (sk, _), (dk, _) in zip(src, dst):
        assert torch.equal(dk[:, 1], sk[:, 2]) and torch.equal(dk[:, 3], sk[:, 0])
