"""Paged attention in Triton, for the GPU (and, under ``TRITON_INTERPRET=1``, the CPU).

Three kernels over the paged cache, whose layout per layer is
``[num_kv_heads, num_blocks, block_size, head_dim]`` (the CPU backend's, kept: one head's
page is a contiguous ``[block_size, head_dim]`` tile, so a key tile is a gather of whole
``head_dim`` rows, each one coalesced load):

- ``store_kv``: the step's K/V rows into their cache slots from the slot mapping, one launch
  for a layer's K and V; a negative slot (a CUDA-graph padding row) is skipped.
- ``decode``: one query token per sequence (a decode, or the last layer's sampling rows), all
  the query heads of one KV head together (grouped-query attention: each K/V tile is loaded
  once for the group), the context split into ``num_splits`` ranges (split-KV, as
  flash-decoding) that run as separate programs, then a reduction kernel that merges their
  partial outputs by log-sum-exp. With one split the kernel writes the output itself.
- ``prefill``: a tile of ``BLOCK_Q`` query tokens x the group's heads of one sequence over its
  cached context and the chunk's own causal part; the key loop stops at the tile's last
  position, so fully masked tiles are never read. Fresh prefills, chunks after cached context
  and prefix-cache hits are the same case (context length 0 or not).

A step's decode rows go to ``decode`` and its other rows to ``prefill``: two launches per
layer for a mixed batch, one for a decode-only one. Neither copies a context out of the cache.

Scores, softmax and the output accumulate in fp32 whatever the cache dtype (bf16/fp16 on
GPU). Under the interpreter, ``tl.dot`` of bf16 operands is wrong in triton 3.9, so there
the operands are upcast to fp32 first (``UPCAST``); the GPU path feeds them to the tensor
cores as they are, and fp32 dots run in full precision (``input_precision="ieee"``, not TF32). The reductions avoid triton's standard-library helpers (see _add).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Reductions through tl.reduce with triton's own combine functions (those tl.sum and tl.max
# use) rather than tl.sum / tl.max themselves: those are @triton.jit helpers compiled or
# interpreted as decided when triton was first imported (torch imports it early), so on the
# CPU they would refuse to run under the interpreter switched on later (attention_backends.py
# sets it). The interpreter recognises these combine functions and reduces with numpy; on the
# GPU the code is what tl.sum / tl.max compile to.
_add = tl.standard._sum_combine
_maximum = tl.standard._elementwise_max


# ----------------------------------------------------------------------------------------
# KV write
@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache,
    v_cache,
    slots_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cs,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    j = tl.arange(0, HEADS_PAD * DIM_PAD)  # (kv head, dim) flattened
    h = j // DIM_PAD
    d = j % DIM_PAD
    slot = tl.load(slots_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    mask = ((t < num_tokens) & (slot >= 0))[:, None] & ((h < NUM_KV_HEADS) & (d < HEAD_DIM))[
        None, :
    ]
    k = tl.load(k_ptr + t[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + t[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    dst = (h.to(tl.int64) * stride_ch + d)[None, :] + slot[:, None] * stride_cs
    tl.store(k_cache + dst, k, mask=mask)
    tl.store(v_cache + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v: [T, kv_heads, dim] (unit stride along dim); slots: [T] cache row of each token
    (block * block_size + offset), negative to skip."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    rows = 16 if INTERPRET else 1
    _store_kv_kernel[(triton.cdiv(num_tokens, rows),)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim,
        DIM_PAD=next_pow2(head_dim),
        ROWS=rows,
    )


# ----------------------------------------------------------------------------------------
# Decode: one query token per sequence, split-KV
@triton.jit
def _load_kv_tile(
    k_cache,
    v_cache,
    table,
    head_base,
    n,
    nmask,
    d,
    dmask,
    stride_cb,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """K and V rows of context positions ``n`` of one KV head, read in place through the block table."""
    block = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    rows = head_base + block * stride_cb + (n % BLOCK_SIZE) * stride_cs
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(k_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(scores, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of (masked) scores and its V rows into the running max, sum and output."""
    m_new = tl.maximum(m_i, tl.reduce(scores, 1, _maximum))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, _add)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    part_out,
    part_lse,
    seqs_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_bt,
    scale,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seqs_ptr + row)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # This split's key range: equal shares of the context, rounded up to whole tiles.
    per_split = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + TILE_N - 1) // TILE_N * TILE_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([GROUP_PAD, DIM_PAD], 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_base = kvh.to(tl.int64) * stride_ch
    for s in range(start, end, TILE_N):
        n = s + tl.arange(0, TILE_N)
        nmask = n < end
        k, v = _load_kv_tile(
            k_cache,
            v_cache,
            table,
            head_base,
            n,
            nmask,
            d,
            dmask,
            stride_cb,
            stride_cs,
            BLOCK_SIZE,
            UPCAST,
        )
        scores = (
            tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        )  # [GROUP_PAD, TILE_N], fp32
        scores = tl.where(nmask[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)

    out_mask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty context (a padding row) gives zeros
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partial result of this split: normalised output and its log-sum-exp (-inf: empty).
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
        idx = (row.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(
            part_out + idx[:, None] * DIM_PAD + d[None, :], acc / l_safe[:, None], mask=out_mask
        )
        tl.store(part_lse + idx, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_out,
    part_lse,
    seqs_ptr,
    query_start_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seqs_ptr + row)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    smask = s < NUM_SPLITS
    base = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse + base + s, mask=smask, other=float("-inf"))
    m = tl.reduce(lse, 0, _maximum)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # 0 for empty splits
    parts = tl.load(
        part_out + (base + s)[:, None] * DIM_PAD + d[None, :],
        mask=smask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.reduce(w, 0, _add)
    total = tl.where(total > 0, total, 1.0)
    out = tl.reduce(parts * w[:, None], 0, _add) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


# ----------------------------------------------------------------------------------------
# Prefill / chunks: a tile of query tokens over cached context + its causal part
@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    tile_seq_ptr,
    tile_q_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_bt,
    scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_first = tl.load(
        tile_q_ptr + tile
    )  # first query of the tile, within the sequence's new tokens
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    m_idx = tl.arange(0, BLOCK_M)
    qi = q_first + m_idx // GROUP_PAD  # query token within the sequence's new tokens
    g = m_idx % GROUP_PAD
    heads = kvh * GROUP + g
    d = tl.arange(0, DIM_PAD)
    dmask = d < HEAD_DIM
    row_mask = (qi < q_len) & (g < GROUP)
    tokens = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context + qi  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, DIM_PAD], 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_base = kvh.to(tl.int64) * stride_ch
    # Keys up to the tile's last query position (causal): later tiles are never read.
    kv_end = tl.minimum(context + q_first + BLOCK_Q, seq_len)
    for s in range(0, kv_end, TILE_N):
        n = s + tl.arange(0, TILE_N)
        nmask = n < kv_end
        k, v = _load_kv_tile(
            k_cache,
            v_cache,
            table,
            head_base,
            n,
            nmask,
            d,
            dmask,
            stride_cb,
            stride_cs,
            BLOCK_SIZE,
            UPCAST,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, TILE_N]
        # Key 0 is visible to every row, so no row's first tile is fully masked.
        visible = nmask[None, :] & (n[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dmask[None, :],
    )


# ----------------------------------------------------------------------------------------
# Launchers
TILE_N = 32 if INTERPRET else 64


def group_pad(num_heads: int, num_kv_heads: int, minimum: int = 1) -> int:
    return max(minimum, next_pow2(num_heads // num_kv_heads))


def prefill_block_q(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per prefill tile: BLOCK_Q x padded group = 64 rows (at least 16)."""
    return max(1, 64 // group_pad(num_heads, num_kv_heads))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 runs (the parity tests) multiply in full fp32, not TF32; bf16/fp16 use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: torch.Tensor,
    num_rows: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int,
) -> None:
    """out[t] = attention of q[t] (t = query_start_loc[seq] for seq in seqs) over the first
    seq_lens[seq] cache rows of its block table. q, out: [T, heads, dim]."""
    if num_rows == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    dim_pad = next_pow2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(
            (num_rows * num_heads * num_splits, dim_pad), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_rows * num_heads * num_splits,), dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_rows, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        seqs,
        query_start_loc,
        seq_lens,
        block_tables,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale,
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=group_pad(num_heads, num_kv_heads, 16),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        NUM_SPLITS=num_splits,
        UPCAST=INTERPRET,
        PRECISION=dot_precision(q.dtype),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_rows, num_heads)](
            out,
            part_out,
            part_lse,
            seqs,
            query_start_loc,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits),
        )


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_q: torch.Tensor,
    num_tiles: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    block_q: int,
) -> None:
    """Causal attention of each sequence's new tokens (rows query_start_loc[s]..[s+1]) over
    its whole context (seq_lens[s] rows, the new ones last), in tiles of block_q tokens:
    tile i covers tokens tile_q[i].. of sequence tile_seq[i]."""
    if num_tiles == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, _, block_size, _ = k_cache.shape
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        tile_seq,
        tile_q,
        query_start_loc,
        seq_lens,
        block_tables,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale,
        GROUP=num_heads // num_kv_heads,
        GROUP_PAD=group_pad(num_heads, num_kv_heads),
        HEAD_DIM=head_dim,
        DIM_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        TILE_N=TILE_N,
        UPCAST=INTERPRET,
        PRECISION=dot_precision(q.dtype),
    )
