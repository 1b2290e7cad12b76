"""The runner's persistent batch: one row of state per request, kept from step to step.

A request's block table lives in a row of one [rows, width] int64 array; each step appends only
the blocks allocated since the last (the KV cache manager's block list grows at its end), so a
step's slots and attention block tables come from numpy indexing over the batch instead of a
Python list per request. The rows are a cache of the KV cache manager's tables, checked at
every step against it (same request object, same block list object, its length): a request that
was preempted, freed or replaced simply gets its row rewritten. Rows of requests that no step
uses any more are reclaimed when the rows run out.
"""

from __future__ import annotations

import numpy as np


class InputBatch:
    def __init__(self, block_size: int, max_rows: int = 64, max_blocks: int = 16):
        self.block_size = block_size
        self.tables = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._owner: list = [None] * max_rows  # the Request each row belongs to
        self._blocks: list = [None] * max_rows  # the KV cache manager's block list it mirrors
        self.num_blocks: list[int] = [0] * max_rows  # leading entries of the row known to match it
        self._last_step: list[int] = [0] * max_rows
        self._free = list(range(max_rows - 1, -1, -1))
        self._step = 0

    def begin_step(self) -> None:
        self._step += 1

    def row(self, request, blocks: list) -> int:
        """The request's row, its block table brought up to date with ``blocks`` (its KVBlocks)."""
        r = self.row_of.get(request.request_id)
        if r is None or self._owner[r] is not request:
            r = self._assign(request)
        if self._blocks[r] is not blocks:  # a new list: freed and allocated again
            self._blocks[r] = blocks
            self.num_blocks[r] = 0
        n, have = len(blocks), self.num_blocks[r]
        if n > have:
            if n > self.tables.shape[1]:
                self._widen(n)
            self.tables[r, have:n] = [b.block_id for b in blocks[have:n]]
        self.num_blocks[r] = n
        self._last_step[r] = self._step
        return r

    def trust_only(self, r: int, num_blocks: int) -> None:
        """Entries from ``num_blocks`` on may be replaced before the next step (a draft's lookahead
        blocks are freed and others allocated): read them again then."""
        self.num_blocks[r] = min(self.num_blocks[r], num_blocks)

    def table_view(self, rows: np.ndarray, ctx_lens: np.ndarray) -> np.ndarray:
        """Rows' block tables as a new [len(rows), max blocks] array, covering ``ctx_lens`` tokens
        each and zero past them."""
        used = -(-ctx_lens // self.block_size)
        width = max(1, int(used.max())) if used.size else 1
        view = self.tables[rows, :width]
        return np.where(np.arange(width)[None, :] < used[:, None], view, 0)

    def full_table(self, r: int) -> np.ndarray:
        return self.tables[r, : self.num_blocks[r]].copy()

    def _assign(self, request) -> int:
        old = self.row_of.pop(request.request_id, None)
        if old is not None:
            self._release(old)
        if not self._free:
            for rid, r in list(self.row_of.items()):
                if self._last_step[r] < self._step:  # not in this step: reclaim it
                    del self.row_of[rid]
                    self._release(r)
        if not self._free:
            self._grow()
        r = self._free.pop()
        self.row_of[request.request_id] = r
        self._owner[r] = request
        return r

    def _release(self, r: int) -> None:
        self._owner[r] = self._blocks[r] = None
        self.num_blocks[r] = 0
        self._free.append(r)

    def _grow(self) -> None:
        rows = len(self._owner)
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self._owner += [None] * rows
        self._blocks += [None] * rows
        self.num_blocks += [0] * rows
        self._last_step += [0] * rows
        self._free.extend(range(2 * rows - 1, rows - 1, -1))

    def _widen(self, n: int) -> None:
        width = self.tables.shape[1]
        while width < n:
            width *= 2
        wider = np.zeros((self.tables.shape[0], width), dtype=np.int64)
        wider[:, : self.tables.shape[1]] = self.tables
        self.tables = wider
