"""One step's rows, built on the host from the scheduler's output: the flattened token ids,
positions and cache slots, one entry per scheduled sequence, and the rows that give logits.

Backend-neutral: each attention backend turns a ``StepRows`` into its own metadata
(attention_backends.py ``step_metadata``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.request import Request
from kvmesh.engine.scheduler import SchedulerOutput


class SeqRows(NamedTuple):
    """One scheduled sequence's rows in the flattened batch."""

    offset: int  # its first row
    num_new: int  # rows this step
    start: int  # tokens already in the cache before this step
    table: list[int]  # its block table
    # Drafts under verification from the last verified token on: every row is a decode over
    # the context up to itself (the rows' K/V are stored before attention).
    verifies_drafts: bool


@dataclass
class LogitsRows:
    """Rows that give logits, with the context each row sees (for the last layer's decode view)."""

    indices: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    ctx: list[int] = field(default_factory=list)


@dataclass
class StepRows:
    requests: list[Request]  # in row order
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seqs: list[SeqRows]
    # Logits rows in the order the model returns them: sampling rows, then draft
    # verification rows, then prompt-logprob rows.
    sample: LogitsRows
    spec: LogitsRows
    prompt: LogitsRows
    sampling_requests: list[Request]
    spec_rows: list[tuple[Request, list[int]]]  # requests verifying drafts, and the drafts
    prompt_rows: list[tuple[Request, int]]  # (request, position) rows that give prompt logprobs
    fill_dst: list[int]  # placeholder rows of ids (async scheduling) ...
    fill_src: list[int]  # ... and their rows in the previous step's sampled ids
    # Per sampling request: the output position of the token it samples (its seeded draw's
    # counter; known here even when the previous step's token is not, with async scheduling)
    sample_positions: list[int] = field(default_factory=list)

    def logits(self) -> LogitsRows:
        """All logits rows, in model output order."""
        parts = (self.sample, self.spec, self.prompt)
        return LogitsRows([i for p in parts for i in p.indices], [t for p in parts for t in p.tables],
                          [c for p in parts for c in p.ctx])


class StepBuffers:
    """The per-step input buffers (token ids, positions, slots), reused from step to step."""

    def __init__(self) -> None:
        self._bufs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def get(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._bufs is None or len(self._bufs[0]) < num_tokens:
            size = max(num_tokens, 2048)
            self._bufs = tuple(np.empty(size, dtype=np.int64) for _ in range(3))
        return self._bufs


def build_step_rows(out: SchedulerOutput, kv: KVCacheManager, block_size: int, buffers: StepBuffers,
                    prev_rows: dict[str, int] | None = None) -> StepRows:
    """The step's rows. Async scheduling: a position past the request's known tokens is a
    placeholder for the token the previous step samples; its input id is left 0 here and
    filled on the device from that step's sampled ids (``fill_dst`` <- row ``fill_src`` of
    them, ``prev_rows`` giving each request's row there)."""
    bs = block_size
    ids_buf, pos_buf, slot_buf = buffers.get(out.total_tokens)
    sample, spec, prompt = LogitsRows(), LogitsRows(), LogitsRows()
    rows = StepRows(list(out.requests), ids_buf, pos_buf, slot_buf, [], sample, spec, prompt, [], [], [], [], [])
    offset = 0
    starts = out.starts
    for req in out.requests:
        n = out.num_scheduled_tokens[req.request_id]
        start = starts[req.request_id] if starts else req.num_computed_tokens
        table = kv.block_table(req.request_id)
        known = req.num_tokens
        past = start + n - known  # > 0: drafts follow (speculative), or a placeholder (async)
        num_drafts = past if past > 0 and req.spec_token_ids else 0
        if past > 0 and not num_drafts:  # the last position is the previous step's token
            if past != 1 or prev_rows is None or req.request_id not in prev_rows:
                raise RuntimeError(f"request {req.request_id}: {past} unknown input token(s) and no "
                                   "previous step that samples them")
            rows.fill_dst.append(offset + n - 1)
            rows.fill_src.append(prev_rows[req.request_id])
        if n == 1:  # a decode row: scalars, no per-row numpy work
            ids_buf[offset] = req.all_token_ids[start] if start < known else 0
            pos_buf[offset] = start
            slot_buf[offset] = table[start // bs] * bs + start % bs
        else:
            if num_drafts > 0:
                drafts = req.spec_token_ids[:num_drafts]
                ids_buf[offset:offset + n] = req.all_token_ids[start:] + drafts
            elif past > 0:
                ids_buf[offset:offset + n] = req.all_token_ids[start:] + [0] * past
            else:
                ids_buf[offset:offset + n] = req.all_token_ids[start:start + n]
            pos = np.arange(start, start + n)
            pos_buf[offset:offset + n] = pos
            slot_buf[offset:offset + n] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
        if num_drafts > 0:  # every position from the last verified token on gives logits
            rows.spec_rows.append((req, drafts))
            for p in range(known - 1, start + n):
                spec.indices.append(offset + p - start)
                spec.tables.append(table[:cdiv(p + 1, bs)])
                spec.ctx.append(p + 1)
        elif start + n >= known:
            sample.indices.append(offset + n - 1)
            rows.sampling_requests.append(req)
            rows.sample_positions.append(start + n - req.num_prompt_tokens)
            sample.tables.append(table[:cdiv(start + n, bs)])
            sample.ctx.append(start + n)
        if req.prompt_logprobs is not None:  # position p's logits score prompt token p + 1
            for p in range(start, min(start + n, req.num_prompt_tokens - 1)):
                rows.prompt_rows.append((req, p))
                prompt.indices.append(offset + p - start)
                prompt.tables.append(table[:cdiv(p + 1, bs)])
                prompt.ctx.append(p + 1)
        rows.seqs.append(SeqRows(offset, n, start, table, num_drafts > 0 and start == known - 1))
        offset += n
    # copies of the buffers' first `offset` entries: a step's tensors never alias the next step's
    rows.ids, rows.positions, rows.slots = ids_buf[:offset].copy(), pos_buf[:offset].copy(), slot_buf[:offset].copy()
    return rows
