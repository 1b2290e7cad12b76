"""The batched next-token mask: one int32 bitmask row per constrained request, filled on the host
by the matchers and applied to the logits in one call (xgrammar's kernels: torch on the CPU,
Triton/CUDA on the GPU). Unconstrained rows are left alone."""

from __future__ import annotations

import torch
import xgrammar as xgr

from kvmesh.engine.structured.matcher import StructuredState


def allocate(batch_size: int, vocab_size: int) -> torch.Tensor:
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def fill(bitmask: torch.Tensor, states: list[StructuredState | None]) -> list[int]:
    """Fill the rows of the constrained requests; their indices (empty: nothing to apply)."""
    rows = []
    for row, state in enumerate(states):
        if state is not None:
            state.fill_bitmask(bitmask, row)
            rows.append(row)
    return rows


def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Set the logits of disallowed tokens to -inf, in place, on ``rows`` only. Columns past the
    tokenizer's vocabulary (a model's padded embedding) are never allowed on those rows."""
    if not rows:
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab_size, logits.shape[-1]),
                                    indices=rows)
    if logits.shape[-1] > vocab_size:
        index = torch.tensor(rows, device=logits.device)
        logits[index, vocab_size:] = float("-inf")
