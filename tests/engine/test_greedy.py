"""The chunked greedy search (engine/greedy.py) picks exactly what ``max(dim=-1)`` picks."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.greedy import CHUNK, greedy_tokens


def _reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


@pytest.mark.parametrize("vocab", [49152, 49152 + 77, 32000, 4 * CHUNK, 4 * CHUNK + 1, 100])
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 64])
def test_random_rows(vocab, rows):
    g = torch.Generator().manual_seed(vocab * 131 + rows)
    logits = torch.randn(rows, vocab, generator=g)
    assert torch.equal(greedy_tokens(logits), _reference(logits))


@pytest.mark.parametrize("vocab", [49152, 49152 + 77])
def test_ties_nan_and_infinities(vocab):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(12, vocab, generator=g)
    top = float(logits.max()) + 1.0
    logits[0, [5, CHUNK + 3, vocab - 1]] = top  # a tie across chunks: the first wins
    logits[1, [CHUNK - 1, CHUNK]] = top  # a tie across a chunk border
    logits[2, vocab - 1] = top  # the maximum in the last entry (the tail when there is one)
    logits[3, [vocab - 2, 10]] = top  # a tie between the tail and the body
    logits[4, [300, 9]] = float("nan")  # the first NaN, as max reports it
    logits[5, vocab - 1] = float("nan")  # a NaN in the tail only
    logits[6, [vocab - 1, 2 * CHUNK]] = float("nan")  # NaN in the body and the tail
    logits[7] = float("-inf")  # nothing but -inf: the first entry
    logits[8, [40, 4000]] = float("inf")
    logits[9] = 0.0  # all equal
    logits[10, vocab - 1] = float("inf")
    logits[10, 17] = float("inf")
    assert torch.equal(greedy_tokens(logits), _reference(logits))


def test_bf16_ties():
    # bf16 logits tie often: a coarse grid makes every row full of ties.
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 8, (16, 49152 + 5), generator=g).to(torch.bfloat16)
    assert torch.equal(greedy_tokens(logits), _reference(logits))


def test_a_strided_row_selection():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 49152 + 11, generator=g)
    view = logits[::2]
    assert torch.equal(greedy_tokens(view), _reference(view))
