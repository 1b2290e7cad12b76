"""Attention over the paged KV cache, in plain torch (the CPU backend).

One step mixes three kinds of work, and each gets its vectorised path:
- decodes (one new token each): batched together; on CPU a compiled kernel
  (kernels/paged_attention_cpu.cpp) reads K/V rows in place from their blocks;
  the torch fallback gathers the contexts block-by-block into one padded
  tensor and masks by length;
- prefills, prefill chunks and cache hits: on CPU (fp32 or bf16) one compiled kernel
  call (kernels/prefill_attention_cpu.cpp) covers all of them, reading every
  key from the cache; the torch fallback runs per sequence: causal attention on
  the step's own K/V for a fresh prefill, or the context gathered from the
  cache with a causal mask offset by its length.

Cache layout per layer: [num_kv_heads, num_blocks, block_size, head_dim], so a
gather along the block axis yields a contiguous [heads, tokens, dim] view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    start: int  # offset of its tokens in the flattened batch
    num_new: int
    num_context: int  # tokens already in the cache before this step
    block_table: torch.Tensor | None  # only needed when num_context > 0


@dataclass
class AttentionMetadata:
    slots: torch.Tensor | None  # [T] cache row of each new token: block * block_size + offset
    # Decodes: token indices in the flattened batch, their block tables (padded) and context lengths.
    decode_indices: torch.Tensor | None
    decode_block_tables: torch.Tensor | None  # [R, max_blocks]
    decode_mask: torch.Tensor | None  # [R, max_blocks * block_size] additive (0 / -inf)
    prefills: list[PrefillSeq]  # for the torch path
    decode_ctx_lens: torch.Tensor | None = None  # [R] context length incl. the new token
    cpu_ops: object | None = None  # the compiled CPU kernels module, when available
    # For the compiled prefill kernel (then `prefills` is empty): per prefill sequence
    # (first row in the batch, new tokens, cached tokens), and their padded block tables.
    prefill_seqs: torch.Tensor | None = None  # [S, 3]
    prefill_block_tables: torch.Tensor | None = None  # [S, max_blocks]
    # The sampling rows as decodes over their whole context, for the last layer (which carries
    # on only for them); None when no row samples this step.
    sample_meta: AttentionMetadata | None = None
    # Every row is a decode that samples, in order (logits rows 0..R-1): the steps the compiled
    # decode stack runs (models/llama.py).
    all_decode: bool = False


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store the step's new keys/values ([T, kv_heads, dim]) in their slots (the torch path;
    the compiled RoPE op stores them itself)."""
    num_kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, -1, head_dim)[:, meta.slots] = k.transpose(0, 1)
    v_cache.view(num_kv_heads, -1, head_dim)[:, meta.slots] = v.transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, dim]; k, v: [T, kv_heads, dim] (already written to the cache)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)

    if meta.decode_indices is not None and meta.cpu_ops is not None:
        # Only decodes: the batch is the decode rows, in order, so no gather/scatter.
        only_decodes = not meta.prefills and meta.prefill_seqs is None
        qd = q if only_decodes else q[meta.decode_indices]
        attn = meta.cpu_ops.paged_decode_attention(
            qd, k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_lens, scale
        )
        if only_decodes:
            return attn
        out[meta.decode_indices] = attn
    elif meta.decode_indices is not None:
        tables = meta.decode_block_tables
        num_seqs = tables.shape[0]
        # [kv_heads, R, max_blocks, B, D] -> [kv_heads, R, ctx, D], one contiguous gather.
        keys = k_cache[:, tables].flatten(2, 3)
        values = v_cache[:, tables].flatten(2, 3)
        qd = q[meta.decode_indices].view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
        mask = meta.decode_mask[None, :, None, :].to(q.dtype)
        attn = F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, scale=scale)
        out[meta.decode_indices] = attn.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)

    if meta.prefill_seqs is not None:
        meta.cpu_ops.paged_prefill_attention(
            out, q, k_cache, v_cache, meta.prefill_seqs, meta.prefill_block_tables, scale
        )
    for seq in meta.prefills:
        sl = slice(seq.start, seq.start + seq.num_new)
        qs = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seq.num_context == 0:
            ks = k[sl].transpose(0, 1).unsqueeze(0)
            vs = v[sl].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            total = seq.num_context + seq.num_new
            ks = k_cache[:, seq.block_table].flatten(1, 2)[:, :total].unsqueeze(0)
            vs = v_cache[:, seq.block_table].flatten(1, 2)[:, :total].unsqueeze(0)
            q_pos = torch.arange(seq.num_context, total, device=q.device)
            k_pos = torch.arange(total, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            attn = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=group > 1
            )
        out[sl] = attn.squeeze(0).transpose(0, 1)
    return out
