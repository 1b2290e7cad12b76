"""N-gram prompt lookup, vectorised over the batch.

For each request, the last n tokens of its history (prompt + output) are looked up in the
history itself; the tokens that followed their most recent earlier occurrence are the draft.
n goes from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the longest suffix that
occurs earlier wins, and among its occurrences the most recent.

One pass for the whole batch, no per-token Python loop: the histories sit in a padded
``[B, W]`` array; for each offset ``o < max_n``, ``hist[:, j - o] == suffix[:, o]`` says whether
the suffix's o-th-from-last token matches at candidate end position ``j``; the running AND over
o gives the match length at every ``j`` (capped at ``max_n``). Per row, the best length and
the last ``j`` reaching it come from two reductions; the draft is a gather after ``j``.

Histories are kept per request in growing int32 buffers (appended to, never rebuilt), so a
step costs O(B * W * max_n) vectorised work plus one row copy per request.
"""

from __future__ import annotations

import numpy as np

_PAD = -1  # never equals a token id


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min
        self._hist: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, length)

    def forget(self, request_id: str) -> None:
        self._hist.pop(request_id, None)

    def _history(self, request_id: str, token_ids: list[int]) -> np.ndarray:
        buf, n = self._hist.get(request_id, (None, 0))
        total = len(token_ids)
        if buf is None or total > len(buf) or total < n:
            cap = max(64, 1 << (total - 1).bit_length())
            new = np.empty(cap, dtype=np.int32)
            keep = min(n, total) if buf is not None else 0
            if keep:
                new[:keep] = buf[:keep]
            buf, n = new, keep
        if total > n:
            buf[n:total] = token_ids[n:total]
        self._hist[request_id] = (buf, total)
        return buf[:total]

    def propose(
        self, request_ids: list[str], token_ids: list[list[int]], max_drafts: list[int]
    ) -> list[list[int]]:
        """Drafts per request (possibly empty); at most ``min(k, max_drafts[i])`` tokens each.

        ``token_ids[i]`` is the request's whole history (its lists are only read)."""
        if not request_ids:
            return []
        hists = [self._history(rid, toks) for rid, toks in zip(request_ids, token_ids)]
        return propose_batch(hists, self.k, self.max_n, self.min_n, max_drafts)


def propose_batch(
    hists: list[np.ndarray], k: int, max_n: int, min_n: int, max_drafts: list[int] | None = None
) -> list[list[int]]:
    """The lookup itself, over histories given as int arrays (see the module docstring)."""
    b = len(hists)
    lens = np.fromiter((len(h) for h in hists), dtype=np.int64, count=b)
    width = int(lens.max())
    limit = (
        np.full(b, k, dtype=np.int64)
        if max_drafts is None
        else np.minimum(np.asarray(max_drafts), k)
    )
    if width <= min_n:
        return [[] for _ in range(b)]
    grid = np.full((b, width + max_n), _PAD, dtype=np.int64)  # max_n pads on the left: j - o >= 0
    for i, h in enumerate(hists):
        grid[i, max_n : max_n + len(h)] = h
    rows = np.arange(b)
    # suffix[:, o] = the o-th token from the end (PAD where the history is shorter).
    back = lens[:, None] - 1 - np.arange(max_n)[None, :]
    suffix = np.where(back >= 0, grid[rows[:, None], max_n + back], _PAD - 1)  # no match on padding
    # Candidate ends j in [0, width - 2]; an occurrence must end before the last token.
    ends = np.arange(width - 1)
    match_len = np.zeros((b, width - 1), dtype=np.int64)
    alive = np.ones((b, width - 1), dtype=bool)
    for o in range(max_n):
        alive &= grid[:, max_n + ends - o] == suffix[:, o : o + 1]
        match_len += alive
    match_len[ends[None, :] > (lens - 2)[:, None]] = 0  # past this row's own history
    best = match_len.max(axis=1)
    # The most recent end reaching the best length: the last True, found from the right.
    reach = match_len >= np.maximum(best, 1)[:, None]
    last_end = (width - 2) - np.argmax(reach[:, ::-1], axis=1)
    start = last_end + 1  # first drafted position
    # The continuation runs up to the end of the history; past it, the match repeats with
    # period (len - start) (the suffix recurs that far back), so the draft continues the cycle:
    # a generation stuck in a short loop still gets full-length drafts.
    period = np.maximum(lens - start, 1)
    ok = (best >= min_n) & (limit > 0)
    count = np.where(ok, limit, 0)
    take = start[:, None] + np.arange(max(k, 1))[None, :] % period[:, None]
    drafts = grid[rows[:, None], max_n + np.minimum(take, width - 1)]
    out: list[list[int]] = []
    for row, c in zip(drafts.tolist(), count.tolist()):
        out.append(row[:c])
    return out
