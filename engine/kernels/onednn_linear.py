"""Linear layers on prepacked oneDNN weights, for the CPU backend.

torch's fp32 `F.linear` on CPU goes to MKL's sgemm, which repacks the weight on
every call; oneDNN's matmul on a weight reordered once into its blocked layout
does not, and is faster at decode and prefill sizes (figures: docs/engine.md,
"The CPU fast path"). So after the weights are loaded every projection and the
LM head are swapped for this module.

`KVMESH_ONEDNN=0` keeps plain `F.linear`.

The result equals `F.linear` up to fp32 summation order.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    if os.environ.get("KVMESH_ONEDNN", "1") == "0" or device.type != "cpu":
        return False
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


class OneDNNLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = pack_weight(weight, batch_hint)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_model(model: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear under `model` in place; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, OneDNNLinear(child.weight, child.bias, batch_hint))
                replaced += 1
    return replaced
