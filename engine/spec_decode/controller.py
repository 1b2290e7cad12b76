"""When to draft, and what drafting achieved: the engine core's side of speculative decoding.

``propose`` runs after each step's outputs are applied and gives every running request its
drafts for the next step (``request.spec_token_ids``, usually empty):

* per step: no drafts at all while ``disable_by_batch_size`` or more requests run. A large
  batch is compute-bound: each draft token costs nearly a full token of compute, and a
  rejected one buys nothing, while the step already amortises the weights over the batch;
* per request: only requests that are decoding (their whole prompt computed), with room left
  under ``max_tokens`` and ``max_model_len``, and whose acceptance has not stayed low (see
  ``SpeculativeConfig``: an EMA of accepted/drafted per verification; below the threshold
  after ``acceptance_min_drafts`` verifications the request pauses drafting for
  ``reprobe_interval`` steps, then drafts once to re-probe, and each failed probe doubles
  the pause up to 16x).

``record`` takes each verification's outcome; the counters feed the vLLM metrics
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.request import Request
from kvmesh.engine.spec_decode.config import SpeculativeConfig
from kvmesh.engine.spec_decode.ngram import NgramProposer

MAX_BACKOFF = 16


@dataclass
class _Acceptance:
    ema: float | None = None
    verifications: int = 0
    resume_step: int = 0  # drafting paused until this step
    backoff: int = 1
    probing: bool = False  # the next verification decides whether drafting resumes


@dataclass
class SpecDecodeStats:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    num_steps_disabled_by_batch: int  # steps whose batch was too large to draft for
    num_paused_requests: int  # requests now paused for low acceptance


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min
        )
        self._acceptance: dict[str, _Acceptance] = {}
        self.step = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.num_steps_disabled_by_batch = 0

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.forget(request_id)

    def enabled_for_batch(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def _paused(self, request_id: str) -> bool:
        state = self._acceptance.get(request_id)
        return state is not None and self.step < state.resume_step

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of every running request for the next step."""
        self.step += 1
        for r in running:
            if r.spec_token_ids:
                r.spec_token_ids = []
        if not running:
            return
        if not self.enabled_for_batch(len(running)):
            self.num_steps_disabled_by_batch += 1
            return
        candidates, limits = [], []
        for r in running:
            if r.num_computed_tokens != r.num_tokens - 1 or self._paused(r.request_id):
                continue  # still in its prompt (or preempted and recomputing), or paused
            # k drafts emit up to k + 1 tokens, and the last draft sits at position num_tokens - 1 + k.
            room = min(
                r.max_output_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens
            )
            if room > 0:
                candidates.append(r)
                limits.append(room)
        if not candidates:
            return
        drafts = self.proposer.propose(
            [r.request_id for r in candidates], [r.all_token_ids for r in candidates], limits
        )
        for r, d in zip(candidates, drafts):
            if d:
                r.spec_token_ids = d

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification of ``num_drafts`` drafts, ``num_accepted`` of them accepted."""
        if num_drafts <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        cfg = self.config
        rate = num_accepted / num_drafts
        st = self._acceptance.setdefault(request_id, _Acceptance())
        st.verifications += 1
        st.ema = (
            rate
            if st.ema is None
            else (1.0 - cfg.acceptance_ema) * st.ema + cfg.acceptance_ema * rate
        )
        if st.probing:
            st.probing = False
            if rate >= cfg.acceptance_threshold:
                st.backoff, st.ema = 1, rate  # it pays again: draft as usual
                return
            st.backoff = min(st.backoff * 2, MAX_BACKOFF)
            self._pause(st)
        elif st.verifications >= cfg.acceptance_min_drafts and st.ema < cfg.acceptance_threshold:
            self._pause(st)

    def _pause(self, st: _Acceptance) -> None:
        st.resume_step = (
            self.step + 1 + self.config.reprobe_interval * st.backoff
        )  # steps with no drafts
        st.probing = True

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
            self.num_steps_disabled_by_batch,
            sum(1 for st in self._acceptance.values() if self.step < st.resume_step),
        )
