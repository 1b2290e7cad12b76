"""One block's payload: layer by layer, its K then its V, each [kv_heads, block_size, head_dim].

The host tier keeps one payload per slot and the shared tier one per file, so a block moves
between the KV cache and either tier through the same layout."""

from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def block_elements(kv_caches: KVCaches) -> int:
    """Elements of one block's payload (all layers' K and V)."""
    k = kv_caches[0][0]
    return 2 * len(kv_caches) * k.shape[0] * k.shape[2] * k.shape[3]


def block_bytes(kv_caches: KVCaches) -> int:
    return block_elements(kv_caches) * kv_caches[0][0].element_size()


def gather_blocks(kv_caches: KVCaches, block_ids: torch.Tensor) -> torch.Tensor:
    """The payloads of these blocks, one row each ([n, block_elements]), on the cache's device."""
    parts = []
    for k, v in kv_caches:
        # [kv_heads, n, bs, hd] -> [n, kv_heads, bs, hd]: each block's K contiguous
        parts.append(k.index_select(1, block_ids).transpose(0, 1))
        parts.append(v.index_select(1, block_ids).transpose(0, 1))
    return torch.stack(parts, dim=1).reshape(block_ids.numel(), -1)


def scatter_blocks(kv_caches: KVCaches, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Write payload rows ([n, block_elements]) into these blocks of the KV cache."""
    k0 = kv_caches[0][0]
    shape = (rows.shape[0], len(kv_caches), 2, k0.shape[0], k0.shape[2], k0.shape[3])
    blocks = rows.view(shape)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(1, block_ids, blocks[:, layer, 0].transpose(0, 1).contiguous())
        v.index_copy_(1, block_ids, blocks[:, layer, 1].transpose(0, 1).contiguous())


def payload_row(payload: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A payload's bytes as one row of the cache dtype (on the host)."""
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)


def pack_block(kv_caches: KVCaches, block_id: int) -> bytes:
    """The payload of one block of the KV cache, as bytes (what the shared tier stores)."""
    ids = torch.tensor([block_id], device=kv_caches[0][0].device)
    row = gather_blocks(kv_caches, ids)[0].contiguous()
    return row.view(torch.uint8).cpu().numpy().tobytes()


def unpack_block(kv_caches: KVCaches, block_id: int, payload: bytes) -> None:
    """Write a payload (``pack_block``'s bytes) into one block of the KV cache."""
    k = kv_caches[0][0]
    if len(payload) != block_bytes(kv_caches):
        raise ValueError(f"payload of {len(payload)} bytes, a block holds {block_bytes(kv_caches)}")
    row = payload_row(payload, k.dtype).to(k.device)
    scatter_blocks(kv_caches, torch.tensor([block_id], device=k.device), row.view(1, -1))
