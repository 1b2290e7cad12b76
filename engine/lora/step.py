"""A step's adapter rows (rows grouped by adapter) and the LoRA term they add to each projection."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAGroup:
    """One adapter's rows in a step: a slice when they are contiguous, else an index tensor."""

    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # packed per layer
    rows: slice | torch.Tensor


# Up to this many rows, a step with several adapters runs them all at once (StackedLoRA): each
# adapter's rows gathered into one padded batch, one batched shrink and one batched expand, one
# scatter back. Five ops per projection whatever the number of adapters, where grouping costs two
# to four per adapter; the padding it computes is cheap while the rows are few (decode).
STACKED_MAX_ROWS = 64


@dataclass
class LoRARows:
    """The distinct adapters of a set of rows (the step's, or its logits rows'), base rows left out.

    ``gather``: with several adapters and few rows, each adapter's rows as one row of a
    [adapters, most rows] index (padding points at row 0 and is masked by ``valid``), and the
    rows run stacked; None: per group."""

    groups: list[LoRAGroup]
    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    stacked: StackedLoRA | None = None
    counts: torch.Tensor | None = None  # each adapter's rows in ``gather`` (the rest is padding)


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


def build_lora_step(requests, query_start_loc, logits_indices, packed, to_device, stack=True):
    """The step's LoRAStep, or None when no request runs with an adapter (no LoRA work at all).

    ``packed(adapter)`` gives an adapter's packed weights on the model's device (lora/packed.py);
    ``to_device`` moves an index array there; ``stack``: short steps may run stacked (the torch
    kernel's context does; the Triton kernels take the groups, so nothing stacked is built)."""
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
    stacked = stacked_lora(weights) if stack and len(weights) > 1 else None
    return LoRAStep(
        _group(row_owner, weights, to_device, stacked),
        _group(logits_owner, weights, to_device, stacked),
    )


def _group(owner: np.ndarray, weights, to_device, stacked) -> LoRARows:
    groups, members = [], []
    for g, w in enumerate(weights):
        indices = np.flatnonzero(owner == g)
        members.append(indices)
        if len(indices):
            groups.append(LoRAGroup(w, _rows(indices, to_device)))
    if stacked is None or len(groups) < 2 or len(owner) > STACKED_MAX_ROWS:
        return LoRARows(groups)
    most = max(len(m) for m in members)
    gather = np.zeros((len(members), most), dtype=np.int64)
    valid = np.zeros((len(members), most, 1), dtype=np.int64)
    for g, indices in enumerate(members):
        gather[g, : len(indices)] = indices
        valid[g, : len(indices)] = 1
    counts = np.array([len(m) for m in members], dtype=np.int64)
    return LoRARows(groups, to_device(gather), to_device(valid).float(), stacked, to_device(counts))


class StackedLoRA:
    """Several adapters' packed weights as batches, per layer and projection: A as [adapters,
    rank, in] and B transposed as [adapters, rank, out], zero-padded to the largest rank (an
    adapter without the projection is zeros). Built lazily, kept for the same adapters' next
    steps (a steady load runs the same few adapters step after step)."""

    def __init__(self, weights: list) -> None:
        self.weights = weights  # held: the cache key is their ids
        self.parts: dict[tuple[int, str], tuple | None] = {}

    def get(self, layer: int, proj: str):
        """(A, B^T, ranks) batches of projection ``proj`` in ``layer``; None if no adapter has it."""
        key = (layer, proj)
        if key not in self.parts:
            found = [w[layer].get(proj) for w in self.weights]
            present = [ab for ab in found if ab is not None]
            if not present:
                self.parts[key] = None
                return None
            a0, b0 = present[0]
            rank = max(a.shape[0] for a, _ in present)
            a = a0.new_zeros(len(found), rank, a0.shape[1])
            bt = b0.new_zeros(len(found), rank, b0.shape[0])
            ranks = torch.zeros(len(found), dtype=torch.long)
            for g, ab in enumerate(found):
                if ab is not None:
                    a[g, : ab[0].shape[0]] = ab[0]
                    bt[g, : ab[1].shape[1]] = ab[1].T
                    ranks[g] = ab[0].shape[0]
            self.parts[key] = (a, bt, ranks)
        return self.parts[key]


_STACKED: OrderedDict[tuple[int, ...], StackedLoRA] = OrderedDict()
_STACKED_KEPT = 4


def stacked_lora(weights: list) -> StackedLoRA:
    """The StackedLoRA of these adapters' packed weights, in this order (a small LRU cache)."""
    key = tuple(id(w) for w in weights)
    found = _STACKED.get(key)
    if found is None:
        found = _STACKED[key] = StackedLoRA(weights)
        while len(_STACKED) > _STACKED_KEPT:
            _STACKED.popitem(last=False)
    _STACKED.move_to_end(key)
    return found


def _add_stacked(
    out: torch.Tensor, x: torch.Tensor, rows: LoRARows, layer: int, proj: str, ops=None
):
    part = rows.stacked.get(layer, proj)
    if part is None:
        return
    a, bt, ranks = part
    if ops is not None and x.dtype == torch.float32 and x.stride(1) == 1 and out.stride(1) == 1:
        # the compiled kernel (kernels/lora_cpu.cpp): each row's terms, no GEMM dispatch
        ops.lora_add_rows(out, x, rows.gather, rows.counts, a, bt, ranks)
        return
    n, most = rows.gather.shape
    flat = rows.gather.view(-1)
    shrunk = torch.bmm(x.index_select(0, flat).view(n, most, -1), a.transpose(1, 2))
    expanded = torch.bmm(shrunk, bt).mul_(rows.valid)
    out.index_add_(0, flat, expanded.view(n * most, -1))


def add_lora_torch(out: torch.Tensor, x: torch.Tensor, rows, a: torch.Tensor, b: torch.Tensor):
    """out[rows] += (x[rows] @ a.T) @ b.T (b holds the scaling): two small GEMMs per adapter."""
    if isinstance(rows, slice):
        out[rows].addmm_(x[rows] @ a.T, b.T)
    else:
        out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)


class LoRAContext:
    """The rows of the running step's adapters, shared by every layer: ``rows`` is None for a
    step without adapter rows, and then the projections do nothing more than before."""

    def __init__(self, kernel=add_lora_torch, cpu_ops=None):
        self.step: LoRAStep | None = None
        self.rows: LoRARows | None = None
        self.kernel = kernel  # the torch GEMMs, or the Triton kernels on CUDA (kernels/triton_lora)
        # the compiled CPU ops, when built: short steps' adapter rows run lora_add_rows
        self.cpu_ops = cpu_ops if hasattr(cpu_ops, "lora_add_rows") else None

    @property
    def stacks(self) -> bool:
        """Whether short steps run stacked (the torch kernel; the Triton kernels take groups)."""
        return self.kernel is add_lora_torch

    def begin(self, step: LoRAStep | None) -> None:
        self.step = step
        self.rows = None if step is None else step.full

    def to_logits_rows(self) -> None:
        """From here on the layers see the logits rows only (the last layer after attention)."""
        if self.step is not None:
            self.rows = self.step.logits

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """Add each adapter's term to its rows of projection ``proj``'s output ``out`` ([T, out])."""
        if self.rows.gather is not None and self.stacks:
            _add_stacked(out, x, self.rows, layer, proj, self.cpu_ops)
            return
        for group in self.rows.groups:
            ab = group.weights[layer].get(proj)
            if ab is not None:
                self.kernel(out, x, group.rows, *ab)
