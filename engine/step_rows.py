"""One step's rows, built on the host from the scheduler's output and the runner's persistent
batch (input_batch.py): the flattened token ids, positions and cache slots, each scheduled
sequence's place in the batch, and the rows that give logits.

Per request, only what cannot be vectorised runs in Python (its token count, first position,
input ids); positions, slots and the logits rows' block tables are numpy over the batch.
Backend-neutral: each attention backend turns a ``StepRows`` into its own metadata
(attention_backends.py ``step_metadata``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvmesh.engine.input_batch import InputBatch
from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.request import Request
from kvmesh.engine.scheduler import SchedulerOutput


@dataclass
class LogitsRows:
    """Rows that give logits: their index in the flattened batch, their request's row in the
    persistent batch, and the context each row sees (for the last layer's decode view)."""

    indices: np.ndarray
    batch_rows: np.ndarray
    ctx: np.ndarray

    @staticmethod
    def of(indices: list[int], batch_rows: list[int], ctx: list[int]) -> LogitsRows:
        return LogitsRows(
            np.asarray(indices, dtype=np.int64),
            np.asarray(batch_rows, dtype=np.int64),
            np.asarray(ctx, dtype=np.int64),
        )


@dataclass
class StepRows:
    requests: list[Request]  # in row order
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    batch: InputBatch  # the block tables
    # Per scheduled sequence: its row in the persistent batch, rows this step, tokens already in
    # the cache, and whether it verifies drafts from the last verified token on (every row is a
    # decode over the context up to itself: the rows' K/V are stored before attention).
    seq_rows: np.ndarray
    q_lens: np.ndarray
    starts: np.ndarray
    verifies_drafts: np.ndarray
    query_start_loc: np.ndarray  # [S + 1] each sequence's first row
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
        if not self.spec.indices.size and not self.prompt.indices.size:
            return self.sample
        return LogitsRows(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("indices", "batch_rows", "ctx")
            )
        )

    def seq_tables(self, ctx_lens: np.ndarray) -> np.ndarray:
        """The scheduled sequences' block tables, covering ``ctx_lens`` tokens each."""
        return self.batch.table_view(self.seq_rows, ctx_lens)

    def logits_tables(self, logits: LogitsRows) -> np.ndarray:
        return self.batch.table_view(logits.batch_rows, logits.ctx)


class StepBuffers:
    """The per-step input buffer of token ids, reused from step to step."""

    def __init__(self) -> None:
        self._ids: np.ndarray | None = None

    def get(self, num_tokens: int) -> np.ndarray:
        if self._ids is None or len(self._ids) < num_tokens:
            self._ids = np.empty(max(num_tokens, 2048), dtype=np.int64)
        return self._ids


def build_step_rows(
    out: SchedulerOutput,
    kv: KVCacheManager,
    block_size: int,
    buffers: StepBuffers,
    batch: InputBatch,
    prev_rows: dict[str, int] | None = None,
) -> StepRows:
    """The step's rows. Async scheduling: a position past the request's known tokens is a
    placeholder for the token the previous step samples; its input id is left 0 here and
    filled on the device from that step's sampled ids (``fill_dst`` <- row ``fill_src`` of
    them, ``prev_rows`` giving each request's row there)."""
    bs = block_size
    batch.begin_step()
    reqs = out.requests
    ids_buf = buffers.get(out.total_tokens)
    num_seqs = len(reqs)
    seq_rows, q_lens, starts = [0] * num_seqs, [0] * num_seqs, [0] * num_seqs
    verifies = [False] * num_seqs
    sample_seqs: list[int] = []
    sampling_requests: list[Request] = []
    sample_positions: list[int] = []
    spec_idx, spec_brows, spec_ctx = [], [], []
    prompt_idx, prompt_brows, prompt_ctx = [], [], []
    spec_rows: list[tuple[Request, list[int]]] = []
    prompt_rows: list[tuple[Request, int]] = []
    fill_dst: list[int] = []
    fill_src: list[int] = []
    nsched, start_of, req_blocks = out.num_scheduled_tokens, out.starts, kv.req_blocks
    offset = 0
    for i, req in enumerate(reqs):
        rid = req.request_id
        n = nsched[rid]
        start = start_of[rid] if start_of else req.num_computed_tokens
        r = batch.row(req, req_blocks[rid])
        seq_rows[i], q_lens[i], starts[i] = r, n, start
        known = req.num_tokens
        past = start + n - known  # > 0: drafts follow (speculative), or a placeholder (async)
        num_drafts = past if past > 0 and req.spec_token_ids else 0
        if past > 0 and not num_drafts:  # the last position is the previous step's token
            if past != 1 or prev_rows is None or rid not in prev_rows:
                raise RuntimeError(
                    f"request {rid}: {past} unknown input token(s) and no "
                    "previous step that samples them"
                )
            fill_dst.append(offset + n - 1)
            fill_src.append(prev_rows[rid])
        if n == 1:  # a decode row: one scalar
            ids_buf[offset] = req.all_token_ids[start] if start < known else 0
        elif num_drafts > 0:
            drafts = req.spec_token_ids[:num_drafts]
            ids_buf[offset : offset + n] = req.all_token_ids[start:] + drafts
        elif past > 0:
            ids_buf[offset : offset + n] = req.all_token_ids[start:] + [0] * past
        else:
            ids_buf[offset : offset + n] = req.all_token_ids[start : start + n]
        if num_drafts > 0:  # every position from the last verified token on gives logits
            spec_rows.append((req, drafts))
            verifies[i] = start == known - 1
            batch.trust_only(r, cdiv(known, bs))  # the rejected drafts' blocks go after the step
            for p in range(known - 1, start + n):
                spec_idx.append(offset + p - start)
                spec_brows.append(r)
                spec_ctx.append(p + 1)
        elif start + n >= known:
            sample_seqs.append(i)
            sampling_requests.append(req)
            sample_positions.append(start + n - req.num_prompt_tokens)
        if req.prompt_logprobs is not None:  # position p's logits score prompt token p + 1
            for p in range(start, min(start + n, req.num_prompt_tokens - 1)):
                prompt_rows.append((req, p))
                prompt_idx.append(offset + p - start)
                prompt_brows.append(r)
                prompt_ctx.append(p + 1)
        offset += n
    seq_rows_a = np.asarray(seq_rows, dtype=np.int64)
    q_lens_a = np.asarray(q_lens, dtype=np.int64)
    starts_a = np.asarray(starts, dtype=np.int64)
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens_a, out=qsl[1:])
    if offset == num_seqs:  # every sequence one row
        positions = starts_a
        token_rows = seq_rows_a
    else:
        positions = np.arange(offset, dtype=np.int64) - np.repeat(qsl[:-1] - starts_a, q_lens_a)
        token_rows = np.repeat(seq_rows_a, q_lens_a)
    slots = batch.tables[token_rows, positions // bs] * bs + positions % bs
    ss = np.asarray(sample_seqs, dtype=np.int64)
    sample = LogitsRows(qsl[1:][ss] - 1, seq_rows_a[ss], (starts_a + q_lens_a)[ss])
    # a copy of the buffer's first `offset` entries: a step's tensors never alias the next step's
    return StepRows(
        list(reqs),
        ids_buf[:offset].copy(),
        positions.copy(),
        slots,
        batch,
        seq_rows_a,
        q_lens_a,
        starts_a,
        np.asarray(verifies, dtype=bool),
        qsl,
        sample,
        LogitsRows.of(spec_idx, spec_brows, spec_ctx),
        LogitsRows.of(prompt_idx, prompt_brows, prompt_ctx),
        sampling_requests,
        spec_rows,
        prompt_rows,
        fill_dst,
        fill_src,
        sample_positions,
    )
