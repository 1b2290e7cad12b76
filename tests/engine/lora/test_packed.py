"""packed_weights: an adapter's parts stacked per fused projection, scaling folded in, cached."""

from __future__ import annotations

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.lora.adapter import load_adapter
from kvmesh.engine.lora.packed import packed_weights
from kvmesh.engine.lora.request import LoRARequest


def test_fused_parts_stack_along_the_rank_with_block_diagonal_b(lora_base_dir, lora_adapter_dirs):
    config = ModelConfig.from_dir(lora_base_dir)
    adapter = load_adapter(LoRARequest("m", 1, lora_adapter_dirs["mixed"]), config, 16)
    packed = packed_weights(adapter, config, torch.device("cpu"), torch.bfloat16)
    assert packed_weights(adapter, config, torch.device("cpu"), torch.bfloat16) is packed
    layer = adapter.layers[0]
    assert sorted(packed[0]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    a, b = packed[0]["qkv_proj"]  # mixed targets q and v, not k
    assert a.dtype == b.dtype == torch.bfloat16
    q, v = layer["q_proj"], layer["v_proj"]
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    assert a.shape == (q.rank + v.rank, config.hidden_size)
    assert b.shape == (q_out + 2 * kv_out, q.rank + v.rank)
    x = torch.randn(3, config.hidden_size)
    got = (x @ a.float().T) @ b.float().T
    want_q = q.scaling * (x @ q.a.T) @ q.b.T
    want_v = v.scaling * (x @ v.a.T) @ v.b.T
    torch.testing.assert_close(got[:, :q_out], want_q, atol=0.05, rtol=0.02)
    assert got[:, q_out : q_out + kv_out].abs().max() == 0  # k is not targeted
    torch.testing.assert_close(got[:, q_out + kv_out :], want_v, atol=0.05, rtol=0.02)
