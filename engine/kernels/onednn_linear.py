"""Linear layers on prepacked oneDNN weights, for the CPU backend.

torch's fp32 `F.linear` on CPU goes to MKL's sgemm, which repacks the weight on
every call; oneDNN's matmul on a weight reordered once into its blocked layout
does not, and is faster at decode and prefill sizes (figures: docs/performance.md,
"What each CPU part buys"). So after the weights are loaded every projection and the
LM head are swapped for this module.

`KVMESH_ONEDNN=0` keeps plain `F.linear`.

Decode-size inputs (up to PANEL_MAX_ROWS rows) go to the compiled panel kernel instead
(kernels/panel_linear_cpu.cpp; bf16: panel_linear_bf16_cpu.cpp) when the CPU kernels are built:
it streams the weights faster than oneDNN there (fp32: 1.2-1.5x per layer; bf16, where oneDNN
is far slower on a few rows, further), while oneDNN's blocking wins on prefill chunks. The
weights are then held twice (oneDNN's blocked copy and the
panels); `KVMESH_PANEL_LINEAR=0` keeps oneDNN alone.

The result equals `F.linear` up to fp32 summation order (bf16: fp32 sums, rounded once).
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
    # oneDNN's bf16 weights need AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only CPU its
    # reorder raises, and bf16 stays on F.linear.
    if dtype == torch.bfloat16 and not _bf16_supported():
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def _bf16_supported() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


# Above this, oneDNN is faster. fp32: 32 rows break even, oneDNN 1.7x at 64. bf16 (1536x576, on
# a loaded machine): the bf16 panels 1.9x the fp32 ones at 1-16 rows (one thread); oneDNN's bf16
# matmul 5x slower than them at one row (two threads), even at 16, 1.1x faster at 32 and 64.
PANEL_MAX_ROWS = 16


def panels_enabled(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and (
        os.environ.get("KVMESH_PANEL_LINEAR", "1") != "0"
    )


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


class OneDNNLinear(nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int, panel_ops=None
    ):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = pack_weight(weight, batch_hint)
        self.bias = None if bias is None else bias.detach().clone()
        # The compiled CPU ops' panel kernel and this weight's panels (decode-size inputs).
        self.panel_ops = (
            panel_ops if panel_ops is not None and panels_enabled(weight.dtype) else None
        )
        self.panels = (
            self.panel_ops.pack_panels(weight.detach()) if self.panel_ops is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if (
            self.panels is not None
            and x2.shape[0] <= PANEL_MAX_ROWS
            and x2.dtype == self.panels.dtype
        ):
            out = self.panel_ops.panel_linear(
                x2 if x2.stride(1) == 1 else x2.contiguous(),
                self.panels,
                self.out_features,
                self.bias,
            )
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_model(model: nn.Module, batch_hint: int, panel_ops=None) -> int:
    """Replace every nn.Linear under `model` in place; returns how many were replaced. With
    `panel_ops` (the compiled CPU ops), each also keeps panels for decode-size inputs."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, OneDNNLinear(child.weight, child.bias, batch_hint, panel_ops))
                replaced += 1
    return replaced
