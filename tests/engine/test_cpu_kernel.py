"""The compiled CPU decode-attention kernel against the torch reference path."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.attention import AttentionMetadata, paged_attention
from kvmesh.engine.kernels import cpu


@pytest.fixture(scope="module")
def kernel():
    module = cpu.load()
    if module is None:
        pytest.fail("the CPU kernel failed to build (a C++ compiler and ninja are part of the engine extra)")
    return module


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("dim, bs", [(32, 4), (64, 16), (128, 8)])  # 64: the AVX-512 path; 128: templated
def test_kernel_matches_torch_gather_path(kernel, dtype, tol, heads, kv_heads, dim, bs):
    torch.manual_seed(0)
    blocks = 40
    k_cache = torch.randn(kv_heads, blocks, bs, dim).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, bs, dim).to(dtype)
    lens = torch.tensor([1, 3, 4, 5, 17, 33])
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim).to(dtype)
    k_new = torch.randn(len(lens), kv_heads, dim).to(dtype)
    mask = torch.where(torch.arange(width * bs)[None, :] < lens[:, None], 0.0, float("-inf"))
    common = dict(slot_blocks=None, slot_offsets=None, decode_indices=torch.arange(len(lens)),
                  decode_block_tables=tables, prefills=[])
    ref = paged_attention(q, k_new, k_new, k_cache, v_cache,
                          AttentionMetadata(decode_mask=mask, **common), dim ** -0.5)
    got = paged_attention(q, k_new, k_new, k_cache, v_cache,
                          AttentionMetadata(decode_mask=None, decode_ctx_lens=lens, decode_kernel=kernel, **common),
                          dim ** -0.5)
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)
