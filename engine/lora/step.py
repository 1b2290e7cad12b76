"""A step's adapter rows (rows grouped by adapter) and the LoRA term they add to each projection."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAGroup:
    """One adapter's rows in a step: a slice when they are contiguous, else an index tensor."""

    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # packed per layer
    rows: slice | torch.Tensor


@dataclass
class LoRARows:
    """The distinct adapters of a set of rows (the step's, or its logits rows'), base rows left out."""

    groups: list[LoRAGroup]


@dataclass
class LoRAStep:
    """A step's adapter rows: over all its rows, and over its logits rows (the last layer's
    rows after attention)."""

    full: LoRARows
    logits: LoRARows


def _rows(indices: np.ndarray, to_device) -> slice | torch.Tensor:
    start = int(indices[0])
    if int(indices[-1]) - start + 1 == len(indices):
        return slice(start, start + len(indices))
    return to_device(indices)


def build_lora_step(requests, query_start_loc, logits_indices, packed, to_device):
    """The step's LoRAStep, or None when no request runs with an adapter (no LoRA work at all).

    ``packed(adapter)`` gives an adapter's packed weights on the model's device (lora/packed.py);
    ``to_device`` moves an index array there."""
    if all(r.lora is None for r in requests):
        return None
    owner_of_seq = np.full(len(requests), -1, dtype=np.int64)
    adapters: dict[int, int] = {}  # id(adapter) -> group number, in first-row order
    loaded = []
    for i, req in enumerate(requests):
        if req.lora is not None:
            owner_of_seq[i] = adapters.setdefault(id(req.lora), len(adapters))
            if len(loaded) < len(adapters):
                loaded.append(req.lora)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    row_owner = np.repeat(owner_of_seq, np.diff(qsl))
    logits_owner = row_owner[np.asarray(logits_indices, dtype=np.int64)]
    weights = [packed(a) for a in loaded]
    return LoRAStep(_group(row_owner, weights, to_device), _group(logits_owner, weights, to_device))


def _group(owner: np.ndarray, weights, to_device) -> LoRARows:
    groups = []
    for g, w in enumerate(weights):
        indices = np.flatnonzero(owner == g)
        if len(indices):
            groups.append(LoRAGroup(w, _rows(indices, to_device)))
    return LoRARows(groups)


def add_lora_torch(out: torch.Tensor, x: torch.Tensor, rows, a: torch.Tensor, b: torch.Tensor):
    """out[rows] += (x[rows] @ a.T) @ b.T (b holds the scaling): two small GEMMs per adapter."""
    if isinstance(rows, slice):
        out[rows].addmm_(x[rows] @ a.T, b.T)
    else:
        out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)


class LoRAContext:
    """The rows of the running step's adapters, shared by every layer: ``rows`` is None for a
    step without adapter rows, and then the projections do nothing more than before."""

    def __init__(self, kernel=add_lora_torch):
        self.step: LoRAStep | None = None
        self.rows: LoRARows | None = None
        self.kernel = kernel  # the torch GEMMs, or the Triton kernels on CUDA (kernels/triton_lora)

    def begin(self, step: LoRAStep | None) -> None:
        self.step = step
        self.rows = None if step is None else step.full

    def to_logits_rows(self) -> None:
        """From here on the layers see the logits rows only (the last layer after attention)."""
        if self.step is not None:
            self.rows = self.step.logits

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """Add each adapter's term to its rows of projection ``proj``'s output ``out`` ([T, out])."""
        for group in self.rows.groups:
            ab = group.weights[layer].get(proj)
            if ab is not None:
                self.kernel(out, x, group.rows, *ab)
