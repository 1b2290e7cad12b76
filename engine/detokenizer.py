"""Incremental detokenisation and stop strings.

Decoding only a small window of recent tokens per step keeps the cost
constant per token; text is released only once it no longer ends in an
incomplete UTF-8 sequence. Stop strings are searched in the new text plus
just enough of the old to catch a match that straddles the boundary; while
a request runs, its last (longest stop string - 1) characters are held back
(as vLLM does), so a client never gets the beginning of a stop string that
then ends the output (``flush`` releases them when it ends otherwise).

A continuation (mid-stream resume) starts as if its resumed ids had been fed
already: their decoded text is the old text (so a stop string may start in it),
of which the client has all but the held-back end; ids whose text was not
decoded yet (half a UTF-8 character) are still pending.
"""

from __future__ import annotations

from kvmesh.common.tokenizer import KVMeshTokenizer


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: KVMeshTokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        emitted_token_ids: list[int] = (),
    ):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        # Start the window inside the prompt so the first output token decodes with context
        # (leading-space handling of sentencepiece/BPE tokenizers).
        self.context = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self.text = ""
        self._max_stop = max((len(s) for s in stop), default=0)
        # characters held back while running: a stop string's possible beginning
        self._hold = self._max_stop - 1 if stop and not include_stop_str_in_output else 0
        self.num_sent = 0  # characters of text handed out as deltas (or sent before a continuation)
        self.num_emitted_chars = 0  # a continuation's text sent before it (not part of new_text)
        if emitted_token_ids:
            self._start_after(list(emitted_token_ids))

    def _start_after(self, emitted: list[int]) -> None:
        """The state after ``emitted`` were fed: their text up to the last id whose character is
        complete is released (the old text); the ids after it are pending, in the window."""
        head = self.context
        ids = head + emitted
        released = len(emitted)
        # update() holds text back while it ends in an incomplete character: so was the end of
        # ``emitted`` (its last few ids decide it)
        while released > 0 and self._decode(
            ids[max(0, len(head) + released - 8) : len(head) + released]
        ).endswith("\ufffd"):
            released -= 1
        self.text = (
            self._decode(ids[: len(head) + released])[len(self._decode(head)) :] if released else ""
        )
        self.num_sent = self.num_emitted_chars = max(0, len(self.text) - self._hold)
        window = (head + emitted[:released])[-4:]  # context for the pending and the next ids
        self.context = window + emitted[released:]
        self.prefix_offset = 0
        self.read_offset = len(window)

    @property
    def new_text(self) -> str:
        """The output text (a continuation's: after what its client had)."""
        return self.text[self.num_emitted_chars :]

    def _release(self, stopped: bool) -> str:
        """The text not handed out yet, but the held-back end while the request runs."""
        upto = len(self.text) if stopped else len(self.text) - self._hold
        if upto <= self.num_sent:
            return ""
        delta = self.text[self.num_sent : upto]
        self.num_sent = upto
        return delta

    def flush(self) -> str:
        """The held-back end, once the request ended other than by a stop string."""
        return self._release(True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def update(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Feed new tokens; returns (text delta, matched stop string or None)."""
        self.token_ids.extend(new_token_ids)
        self.context.extend(new_token_ids)
        prefix_text = self._decode(self.context[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.context[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return "", None  # wait for the rest of a multi-byte character (or of a stop string)
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.context)
        if len(self.context) > 64:  # keep the window short
            drop = self.prefix_offset
            self.context = self.context[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        if self.stop:
            old_len = len(self.text)
            candidate = self.text + delta
            search_from = max(0, old_len - self._max_stop + 1)
            best = None
            for s in self.stop:
                idx = candidate.find(s, search_from)
                if idx != -1 and (best is None or idx < best[0]):
                    best = (idx, s)
            if best is not None:
                idx, s = best
                end = idx + len(s) if self.include_stop else idx
                self.text = candidate[
                    :end
                ]  # never shorter than what was handed out: that was held back
                return self._release(True), s
        self.text += delta
        return self._release(False), None
