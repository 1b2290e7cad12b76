"""The fused elementwise ops in Triton, with the CPU ops' signatures (kernels/cpu.py), so the
model calls either through the same ``ops`` object:

- ``rms_norm(out, x, w, eps)`` and ``fused_add_rms_norm(x, residual, w, eps)`` (residual +=
  x; x = norm(residual) * w, both in place): one read and one write of each row instead of
  torch's five kernels (add, pow, mean, rsqrt, two multiplies);
- ``rotary_qk_store_kv_(qkv, positions, cos, sin, H, Hkv, D, k_cache, v_cache, slots)``: RoPE
  on the q and k heads of the fused qkv projection in place (rotate-half, fp32 cos/sin tables
  carrying the model's theta and scaling), and the rotated k and the v heads stored in their
  cache slots in the same pass: the layer's KV write is this one launch;
- ``silu_and_mul(gate_up) -> out``: silu(gate) * up.

Each rounds where transformers' torch ops round (normalise in fp32, cast, then scale by the
weight; silu rounded to the storage type before the product), so fp32 results match the
torch path to summation order. On the GPU one row per program; under the interpreter a tile
of ROWS rows (fewer, larger programs run faster there), the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.engine.kernels.triton_attention import INTERPRET, _add, next_pow2

# Rows per program: one on the GPU; under the interpreter a tile of rows, since it pays per
# program and per op rather than per element.
ROWS = 16 if INTERPRET else 1


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    num_rows,
    n,
    stride_o,
    stride_x,
    stride_r,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (r[:, None] < num_rows) & (cols[None, :] < n)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + r[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        res_at = res_ptr + r[:, None] * stride_r + cols[None, :]
        res = tl.load(res_at, mask=mask, other=0.0).to(tl.float32)
        s = (x + res).to(res_ptr.dtype.element_ty)
        tl.store(res_at, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 1, _add) / n + eps)
    y = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(
        out_ptr + r[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    rows, n = x.shape
    if rows == 0:
        return
    _rms_norm_kernel[(triton.cdiv(rows, ROWS),)](
        out,
        x,
        x,
        weight,
        rows,
        n,
        out.stride(0),
        x.stride(0),
        x.stride(0),
        eps,
        ADD_RESIDUAL=False,
        BLOCK=next_pow2(n),
        ROWS=ROWS,
    )


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    rows, n = x.shape
    if rows == 0:
        return
    _rms_norm_kernel[(triton.cdiv(rows, ROWS),)](
        x,
        x,
        residual,
        weight,
        rows,
        n,
        x.stride(0),
        x.stride(0),
        residual.stride(0),
        eps,
        ADD_RESIDUAL=True,
        BLOCK=next_pow2(n),
        ROWS=ROWS,
    )


@triton.jit
def _rotary_store_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    k_cache,
    v_cache,
    slots_ptr,
    num_rows,
    stride_t,
    stride_tab,
    stride_ch,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    STORE: tl.constexpr,
    ROWS: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rmask = r < num_rows
    # Columns: (head, i) for the q heads then the k heads (v is not rotated), i < HALF.
    j = tl.arange(0, HEADS_PAD * HALF_PAD)
    h = j // HALF_PAD
    i = j % HALF_PAD
    mask = rmask[:, None] & ((h < NUM_HEADS + NUM_KV_HEADS) & (i < HALF))[None, :]
    pos = tl.load(pos_ptr + r, mask=rmask, other=0).to(tl.int64)
    tab = pos[:, None] * stride_tab + i[None, :]
    c1 = tl.load(cos_ptr + tab, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + tab, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + tab + HALF, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + tab + HALF, mask=mask, other=0.0)
    at = qkv_ptr + r[:, None] * stride_t + (h * HEAD_DIM + i)[None, :]
    x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    tl.store(at, y1.to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(at + HALF, y2.to(qkv_ptr.dtype.element_ty), mask=mask)
    if STORE:
        slot = tl.load(slots_ptr + r, mask=rmask, other=-1).to(tl.int64)
        keep = slot >= 0  # a negative slot (CUDA-graph padding) is not stored
        # The rotated k heads go to the cache from registers; v is copied as is.
        k_mask = mask & keep[:, None] & (h >= NUM_HEADS)[None, :]
        k_dst = (
            (h - NUM_HEADS).to(tl.int64)[None, :] * stride_ch
            + slot[:, None] * stride_cs
            + i[None, :]
        )
        tl.store(k_cache + k_dst, y1.to(k_cache.dtype.element_ty), mask=k_mask)
        tl.store(k_cache + k_dst + HALF, y2.to(k_cache.dtype.element_ty), mask=k_mask)
        jv = tl.arange(0, KV_PAD * DIM_PAD)
        kh = jv // DIM_PAD
        d = jv % DIM_PAD
        v_mask = (rmask & keep)[:, None] & ((kh < NUM_KV_HEADS) & (d < HEAD_DIM))[None, :]
        v = tl.load(
            qkv_ptr
            + r[:, None] * stride_t
            + ((NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kh * HEAD_DIM + d)[None, :],
            mask=v_mask,
        )
        tl.store(
            v_cache + (kh.to(tl.int64) * stride_ch + d)[None, :] + slot[:, None] * stride_cs,
            v,
            mask=v_mask,
        )


def rotary_qk_store_kv_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor | None,
) -> None:
    """In place on qkv [T, (H + 2 Hkv) * D]; stores k/v when caches are given (negative slot: skip)."""
    rows = qkv.shape[0]
    if rows == 0:
        return
    store = k_cache is not None
    if store and (
        k_cache.stride(3) != 1 or k_cache.stride(1) != k_cache.shape[2] * k_cache.stride(2)
    ):
        raise ValueError("rotary_qk_store_kv_: cache [Hkv, NB, B, D] with whole blocks contiguous")
    _rotary_store_kernel[(triton.cdiv(rows, ROWS),)](
        qkv,
        positions,
        cos,
        sin,
        k_cache if store else qkv,
        v_cache if store else qkv,
        slots if store else positions,
        rows,
        qkv.stride(0),
        cos.stride(0),
        k_cache.stride(0) if store else 0,
        k_cache.stride(2) if store else 0,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_pow2(num_heads + num_kv_heads),
        KV_PAD=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim,
        HALF_PAD=next_pow2(head_dim // 2),
        DIM_PAD=next_pow2(head_dim),
        STORE=store,
        ROWS=ROWS,
    )


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr, num_rows, n, stride_o, stride_x, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (r[:, None] < num_rows) & (cols[None, :] < n)
    at = x_ptr + r[:, None] * stride_x + cols[None, :]
    g = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(at + n, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + r[:, None] * stride_o + cols[None, :],
        (silu * u).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(1024, next_pow2(n))
    _silu_and_mul_kernel[(triton.cdiv(rows, ROWS), triton.cdiv(n, block))](
        out, gate_up, rows, n, out.stride(0), gate_up.stride(0), BLOCK=block, ROWS=ROWS
    )
    return out
