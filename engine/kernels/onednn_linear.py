"""Linear layers on prepacked oneDNN weights, for the CPU backend.

torch's fp32 `F.linear` on CPU goes to MKL's sgemm, which repacks the weight on
every call; oneDNN's matmul on a weight reordered once into its blocked layout
does not, and is faster at decode and prefill sizes (figures: docs/performance.md,
"What each CPU part buys"). So after the weights are loaded every projection and the
LM head are swapped for this module.

`KVMESH_ONEDNN=0` keeps plain `F.linear`.

Decode-size inputs (up to panel_max_rows(dtype) rows) go to the compiled panel kernel instead
(kernels/panel_linear_cpu.cpp; bf16: panel_linear_bf16_cpu.cpp) when the CPU kernels are built:
it streams the weights faster than oneDNN there (fp32: 1.2-1.5x per layer; bf16, where oneDNN
is far slower on a few rows, further), while oneDNN's blocking wins on prefill chunks. The
weights are then held twice (oneDNN's blocked copy and the
panels); `KVMESH_PANEL_LINEAR=0` keeps oneDNN alone.

The result equals `F.linear` up to fp32 summation order (bf16: fp32 sums, rounded once).
"""

from __future__ import annotations

import functools
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


# The most rows the panel kernel takes; more go to oneDNN. `bench/panel_bound.py` on SmolLM2's
# four shapes, 30 layers from memory, two threads (Zen 5, AVX-512, 2026-12-06): fp32 panels
# 1.24x oneDNN at 16 rows, 1.15-1.22x at 24-48, 1.10x at 64 (the LM head 1.10x at 32, 0.98x at
# 64); bf16 1.40x at 16, 1.16x at 24, 1.12x at 32, 0.99x at 64 (the LM head 0.90x at 32). Decode
# tokens/s of the built-in model against a bound of 16: fp32 1.18x at batch 24 and 32, 1.24x at
# 48, 1.12x at 64; bf16 1.28x at 24, 1.21x at 32. An AVX2 build keeps 16 (its panels 1.5x oneDNN
# at 16 rows on a Zen 3, not measured past it). Every row count up to the bound sums each output
# in one order, so a request's result does not depend on how many requests decode beside it up
# to there.
PANEL_MAX_ROWS = 16  # any build
PANEL_MAX_ROWS_AVX512 = {torch.float32: 64, torch.bfloat16: 32}


def panel_max_rows(dtype: torch.dtype) -> int:
    """The most rows of `dtype` the panel kernel takes here."""
    if _avx512_build():
        return PANEL_MAX_ROWS_AVX512.get(dtype, PANEL_MAX_ROWS)
    return PANEL_MAX_ROWS


@functools.cache
def _avx512_build() -> bool:
    """Whether the CPU kernels are built with their AVX-512 paths: -march=native on a CPU with
    AVX-512F (kernels/cpu.py)."""
    from kvmesh.engine.kernels.cpu import portable
    from kvmesh.engine.native_bf16 import cpu_flags

    return not portable() and "avx512f" in cpu_flags()


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
        self.panel_rows = panel_max_rows(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if (
            self.panels is not None
            and x2.shape[0] <= self.panel_rows
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
