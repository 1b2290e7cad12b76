"""Greedy decoding's token: each row's first maximum, as ``argmax`` picks it, fast on a CPU.

On a CPU, torch's ``max(dim=-1)`` (and ``argmax``) over several rows tracks an index per element
in a scalar loop: at a 49k vocabulary it cost 0.8 ms for 16 rows on one thread, 2.5% of a decode
step. ``amax`` alone is vectorised (0.07 ms). So the row is cut into chunks: the chunks' maxima
(vectorised), the first chunk holding the row's maximum, and the first maximum inside that chunk
(a short indexed search): 0.1 ms for the same 16 rows.

The index is exactly ``max(dim=-1).indices``: no chunk before the first maximum's holds a value
that large, so the first chunk whose maximum equals the row's maximum is the one holding its first
occurrence. NaN counts as the largest value (``amax`` and ``max`` both propagate it), so a row with
a NaN gives its first NaN, as ``max`` does. Vocabulary entries past the last whole chunk are
searched apart and win only when strictly larger (or NaN where the chunks have none).
"""

from __future__ import annotations

import torch

CHUNK = 256  # 128-512 measured within 10% of each other at 1-64 rows


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.max(dim=-1).indices`` for 2-D logits (the chunked search on a CPU)."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.shape[-1] < 4 * CHUNK:
        return logits.max(dim=-1).indices
    rows, vocab = logits.shape
    chunks = vocab // CHUNK
    body = logits[:, : chunks * CHUNK].reshape(rows, chunks, CHUNK)
    chunk_max = body.amax(dim=-1)
    best_chunk = chunk_max.max(dim=-1).indices
    row = torch.arange(rows)
    index = best_chunk * CHUNK + body[row, best_chunk].max(dim=-1).indices
    if chunks * CHUNK < vocab:
        tail_max, tail_index = logits[:, chunks * CHUNK :].max(dim=-1)
        body_max = chunk_max[row, best_chunk]
        later = (tail_max > body_max) | (tail_max.isnan() & ~body_max.isnan())
        index = torch.where(later, tail_index + chunks * CHUNK, index)
    return index
