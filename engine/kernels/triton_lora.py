"""LoRA's shrink and expand in Triton for one adapter's rows of a projection (GPU models).

``add_lora_triton(out, x, rows, a, b)`` computes ``out[rows] += (x[rows] @ a.T) @ b.T`` (b holds
the scaling), the signature of the torch path (lora/step.py ``add_lora_torch``):

- shrink: ``t = x[rows] @ a.T`` into an fp32 [n, rank] buffer, the rows gathered in the kernel;
- expand: ``out[rows] += t @ b.T``, read-modify-write of the output rows in the kernel.

``rows`` is a slice (contiguous rows: no index tensor) or an int64 index tensor. The rank is
padded to the dot's minimum tile (16) by masking. fp32 operands, and every operand under the
interpreter (whose bf16 ``tl.dot`` is wrong in triton 3.9), are dotted in fp32 at full
precision (``ieee``, not TF32); bf16/fp16 on the GPU go to the tensor cores as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.engine.kernels.triton_attention import INTERPRET, next_pow2

BLOCK_M = 16  # rows per program
BLOCK_K = 32  # the shrink's reduction tile (input features)
BLOCK_N = 32  # the expand's output features per program


@triton.jit
def _row_offsets(rows_ptr, row_start, m, n, GATHER: tl.constexpr):
    """The flattened-batch rows of tile positions ``m`` (masked past ``n``)."""
    if GATHER:
        rows = tl.load(rows_ptr + m, mask=m < n, other=0).to(tl.int64)
    else:
        rows = (row_start + m).to(tl.int64)
    return rows


@triton.jit
def _shrink_kernel(
    t_ptr,
    x_ptr,
    a_ptr,
    rows_ptr,
    row_start,
    n,
    k_dim,
    rank,
    stride_x,
    stride_a,
    GATHER: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = _row_offsets(rows_ptr, row_start, m, n, GATHER)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xm = (m[:, None] < n) & (k[None, :] < k_dim)
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=xm, other=0.0)
        am = (r[:, None] < rank) & (k[None, :] < k_dim)
        a = tl.load(a_ptr + r[:, None] * stride_a + k[None, :], mask=am, other=0.0)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a))
    # Every BLOCK_R column (zeros past the rank): the expand reads them all.
    tl.store(t_ptr + m[:, None] * BLOCK_R + r[None, :], acc, mask=m[:, None] < n)


@triton.jit
def _expand_kernel(
    out_ptr,
    t_ptr,
    b_ptr,
    rows_ptr,
    row_start,
    n,
    n_dim,
    rank,
    stride_o,
    stride_b,
    GATHER: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _row_offsets(rows_ptr, row_start, m, n, GATHER)
    r = tl.arange(0, BLOCK_R)
    t = tl.load(t_ptr + m[:, None] * BLOCK_R + r[None, :], mask=m[:, None] < n, other=0.0)
    bm = (cols[:, None] < n_dim) & (r[None, :] < rank)
    b = tl.load(b_ptr + cols[:, None] * stride_b + r[None, :], mask=bm, other=0.0)
    if UPCAST:
        delta = tl.dot(t, tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        delta = tl.dot(t.to(b.dtype), tl.trans(b))
    om = (m[:, None] < n) & (cols[None, :] < n_dim)
    at = out_ptr + rows[:, None] * stride_o + cols[None, :]
    base = tl.load(at, mask=om, other=0.0).to(tl.float32)
    tl.store(at, (base + delta).to(out_ptr.dtype.element_ty), mask=om)


def add_lora_triton(
    out: torch.Tensor, x: torch.Tensor, rows, a: torch.Tensor, b: torch.Tensor
) -> None:
    """out[rows] += (x[rows] @ a.T) @ b.T, in two launches (lora/step.py add_lora_torch's math)."""
    if isinstance(rows, slice):
        gather, start, n, index = False, rows.start, rows.stop - rows.start, out
    else:
        gather, start, n, index = True, 0, rows.shape[0], rows
    rank = a.shape[0]
    if n == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    assert out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    block_r = max(16, next_pow2(rank))
    upcast = INTERPRET or out.dtype == torch.float32
    t = torch.empty((n, block_r), dtype=torch.float32, device=out.device)
    grid_m = triton.cdiv(n, BLOCK_M)
    k_dim, n_dim = x.shape[1], out.shape[1]
    _shrink_kernel[(grid_m,)](
        t,
        x,
        a,
        index,
        start,
        n,
        k_dim,
        rank,
        x.stride(0),
        a.stride(0),
        GATHER=gather,
        UPCAST=upcast,
        BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK_K,
        BLOCK_R=block_r,
    )
    _expand_kernel[(grid_m, triton.cdiv(n_dim, BLOCK_N))](
        out,
        t,
        b,
        index,
        start,
        n,
        n_dim,
        rank,
        out.stride(0),
        b.stride(0),
        GATHER=gather,
        UPCAST=upcast,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_R=block_r,
    )
