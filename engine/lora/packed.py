"""An adapter's weights packed per fused projection of the model, on its device and dtype."""

from __future__ import annotations

import torch

from kvmesh.engine.lora.adapter import LoRAAdapter, LoRAWeights

# The model's fused projections and the adapter modules each holds, in output order.
GROUPS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _out_sizes(config) -> dict[str, int]:
    c = config
    q = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    i = c.intermediate_size
    h = c.hidden_size
    return dict(q_proj=q, k_proj=kv, v_proj=kv, o_proj=h, gate_proj=i, up_proj=i, down_proj=h)


def _pack_group(parts: list[LoRAWeights | None], sizes: list[int]):
    """(A [sum of ranks, in], B [sum of outs, sum of ranks]) with each part's scaling in B:
    one shrink and one expand for the whole fused projection (B is block diagonal; a part the
    adapter does not target is zero rows)."""
    present = [w for w in parts if w is not None]
    if not present:
        return None
    a = torch.cat([w.a for w in present], dim=0)
    b = torch.zeros(sum(sizes), a.shape[0])
    row, col = 0, 0
    for w, size in zip(parts, sizes):
        if w is not None:
            b[row : row + size, col : col + w.rank] = w.b * w.scaling
            col += w.rank
        row += size
    return a, b


def packed_weights(adapter: LoRAAdapter, config, device: torch.device, dtype: torch.dtype):
    """Per layer, fused projection name -> (A, B) on ``device`` in ``dtype`` (absent: untouched).
    Built once per device and dtype, then kept on the adapter."""
    key = (str(device), dtype)
    found = adapter.packed.get(key)
    if found is None:
        sizes = _out_sizes(config)
        found = []
        for layer in adapter.layers:
            groups = {}
            for name, modules in GROUPS.items():
                ab = _pack_group([layer.get(m) for m in modules], [sizes[m] for m in modules])
                if ab is not None:
                    groups[name] = tuple(t.to(device=device, dtype=dtype).contiguous() for t in ab)
            found.append(groups)
        adapter.packed[key] = found
    return found
