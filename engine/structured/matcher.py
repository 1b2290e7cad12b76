"""One request's grammar state: which tokens may come next, advanced by the tokens the engine
accepts, rolled back when speculative tokens are rejected, rebuilt when outputs are recomputed."""

from __future__ import annotations

import torch
import xgrammar as xgr


class StructuredState:
    def __init__(self, compiled: xgr.CompiledGrammar, eos_token_ids: list[int] | None = None):
        self._compiled = compiled
        self._stop = list(eos_token_ids) if eos_token_ids else None
        self._matcher = self._new_matcher()
        self.num_accepted = 0  # output tokens the matcher has consumed

    def _new_matcher(self) -> xgr.GrammarMatcher:
        # xgrammar keeps every accepted token to roll back (its rollback depth is unbounded).
        return xgr.GrammarMatcher(self._compiled, override_stop_tokens=self._stop)

    @property
    def finished(self) -> bool:
        """The grammar has ended (a stop token was accepted): the request should finish."""
        return self._matcher.is_terminated()

    def accept(self, token_ids: list[int]) -> int:
        """Consume tokens in order; the count accepted before the first one the grammar refuses
        (speculation: the drafts past it are rejected)."""
        for n, token in enumerate(token_ids):
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                return n
            self.num_accepted += 1
        return len(token_ids)

    def validate(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, the grammar allows from here; the state is unchanged
        (draft verification before the target model's tokens are known)."""
        n = self.accept(token_ids)
        self.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def reset(self, output_token_ids: list[int] = ()) -> None:
        """Rebuild the state for these outputs (preemption that discards or recomputes outputs)."""
        self._matcher = self._new_matcher()
        self.num_accepted = 0
        if self.accept(list(output_token_ids)) != len(output_token_ids):
            raise ValueError("the request's outputs do not follow its grammar")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, one bit per token)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
