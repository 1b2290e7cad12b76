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


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_norms_match_torch(kernel, dtype, tol):
    from kvmesh.engine.models.llama import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x, residual = torch.randn(37, 96).to(dtype), torch.randn(37, 96).to(dtype)
    ref_out, ref_res = norm._norm(x + residual), x + residual
    out = torch.empty_like(x)
    kernel.rms_norm(out, x, norm.weight.data, norm.eps)
    assert torch.allclose(out.float(), norm._norm(x).float(), atol=tol, rtol=tol)
    xi, ri = x.clone(), residual.clone()
    kernel.fused_add_rms_norm(xi, ri, norm.weight.data, norm.eps)  # in place
    assert torch.allclose(ri.float(), ref_res.float(), atol=tol, rtol=tol)
    assert torch.allclose(xi.float(), ref_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_rotary_and_silu_match_torch(kernel, dtype, tol):
    import torch.nn.functional as F

    from kvmesh.engine.config import ModelConfig
    from kvmesh.engine.models.llama import RotaryEmbedding, _rotate

    torch.manual_seed(0)
    heads, kv_heads, dim = 6, 2, 16
    config = ModelConfig(model_type="llama", vocab_size=32, hidden_size=heads * dim, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=dim, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=128, tie_word_embeddings=True, attention_bias=False,
                         mlp_bias=False, hidden_act="silu", torch_dtype=None)
    rope = RotaryEmbedding(config, 128)
    positions = torch.tensor([0, 1, 5, 17, 100, 127])
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    cos, sin = rope(positions, dtype)
    ref_q = _rotate(q.reshape(-1, heads, dim), cos, sin).reshape(len(positions), -1)
    ref_k = _rotate(k.reshape(-1, kv_heads, dim), cos, sin).reshape(len(positions), -1)
    ref_v = v.clone()
    got = qkv.clone()
    kernel.rotary_qk_(got, positions, rope.cos, rope.sin, heads, kv_heads, dim)
    gq, gk, gv = got.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert torch.allclose(gq.float(), ref_q.float(), atol=tol, rtol=tol)
    assert torch.allclose(gk.float(), ref_k.float(), atol=tol, rtol=tol)
    assert torch.equal(gv, ref_v)  # v is left alone

    gate_up = torch.randn(9, 2 * 40).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    assert torch.allclose(kernel.silu_and_mul(gate_up).float(), (F.silu(gate) * up).float(), atol=tol, rtol=tol)
