"""Verify drafts against the target model's logits, all draft positions in one batch.

A request with k drafts ``d_1..d_k`` comes with k + 1 logits rows: row j is the model's
distribution for the token after ``d_1..d_j`` (row 0: after the last verified token). Each
row is adjusted exactly as a plain decode of that prefix would be: penalties count the
drafts before it as output, min_tokens counts them too (``_RowView``).

* Greedy: target token ``t_j`` = argmax of row j. Accept the longest prefix with
  ``d_{j+1} == t_j``; emit the accepted drafts and then ``t_m`` (the correction, or the
  bonus when all k were accepted). Token for token what plain greedy decoding emits.
* Random: the proposer is deterministic (a point mass on its draft), so rejection sampling
  reduces to: accept ``d_{j+1}`` with probability ``p_j(d_{j+1})``; at the first rejection
  emit a sample of ``p_j`` with ``d_{j+1}`` zeroed and renormalised (the residual); when all
  are accepted, emit a sample of ``p_k`` (the bonus). Each emitted token is then distributed
  exactly as ``p_j``: P(d) = p(d), P(x != d) = (1 - p(d)) p(x) / (1 - p(d)).

Randomness as in the sampler: a seeded request's uniforms are functions of (seed, output position)
(k + 1 to accept or reject by, then one to sample the emitted token by inversion); unseeded
requests draw from the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.greedy import greedy_tokens
from kvmesh.engine.penalties import to_device
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import (
    Sampler,
    TokenLogprobs,
    sample_by_inversion,
    token_logprobs,
)


class _RowView:
    """A request as the sampler sees it at draft position j: its output extended by d_1..d_j."""

    __slots__ = (
        "_req",
        "_drafts",
        "request_id",
        "sampling_params",
        "eos_token_ids",
        "stop_token_ids",
        "num_output_tokens",
    )

    def __init__(self, req: Request, drafts: list[int]):
        self._req, self._drafts = req, drafts
        self.request_id = req.request_id
        self.sampling_params = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.stop_token_ids = req.stop_token_ids
        self.num_output_tokens = req.num_output_tokens + len(drafts)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._req.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._req.output_token_ids + self._drafts


@dataclass
class Verified:
    tokens: list[int]  # the accepted drafts, then one sampled token
    num_drafts: int
    logprobs: list[TokenLogprobs] | None  # per emitted token, when the request asks for logprobs

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


def verify(
    sampler: Sampler, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
) -> list[Verified]:
    """``logits``: ``len(drafts[i]) + 1`` rows per request, in order. One ``Verified`` each."""
    views: list[_RowView] = []
    offsets: list[int] = []
    for req, d in zip(requests, drafts):
        offsets.append(len(views))
        views.extend(_RowView(req, d[:j]) for j in range(len(d) + 1))
    raw = logits
    logits = Sampler.adjust(logits, views)  # type: ignore[arg-type]
    target = greedy_tokens(logits).tolist()

    random_reqs = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    sampled: dict[
        int, tuple[int, int]
    ] = {}  # request index -> (accepted drafts m, the token after them)
    if random_reqs:
        rows = [offsets[i] + j for i in random_reqs for j in range(len(drafts[i]) + 1)]
        probs = sampler.probs(logits[rows], [views[r] for r in rows])  # type: ignore[arg-type]
        draft_tok = torch.tensor(
            [
                drafts[i][j] if j < len(drafts[i]) else 0
                for i in random_reqs
                for j in range(len(drafts[i]) + 1)
            ],
            device=probs.device,
        )
        is_draft = torch.tensor(
            [j < len(drafts[i]) for i in random_reqs for j in range(len(drafts[i]) + 1)],
            device=probs.device,
        )
        p_draft = probs.gather(1, draft_tok[:, None])[:, 0]
        # k + 1 uniforms per request to accept or reject by: row j's at output position
        # num_output_tokens + j (spec decoding steps are synchronous: the output is all known)
        row_views = [views[r] for r in rows]
        uniform = sampler.uniforms(
            row_views,
            probs.device,  # type: ignore[arg-type]
            positions=[v.num_output_tokens for v in row_views],
            stream=1,
        )
        accept_list = ((uniform < p_draft) & is_draft).tolist()
        # Each request's first rejected row (or its bonus row), and that row's residual: the
        # draft's own probability zeroed (the bonus row keeps its distribution).
        at, first_rejected, accepted = 0, [], []
        for i in random_reqs:
            n = len(drafts[i]) + 1
            m = 0
            while m < n - 1 and accept_list[at + m]:
                m += 1
            accepted.append(m)
            first_rejected.append(at + m)
            at += n
        picked = to_device(first_rejected, torch.long, probs.device)
        residual = probs[picked].scatter_(
            1,
            draft_tok[picked][:, None],
            torch.where(is_draft[picked], 0.0, p_draft[picked])[:, None],
        )
        # Then one more uniform per request, for the token after the accepted drafts (at its position).
        chosen = sample_by_inversion(
            residual,
            sampler.uniforms(
                [requests[i] for i in random_reqs],
                probs.device,
                positions=[
                    requests[i].num_output_tokens + m for i, m in zip(random_reqs, accepted)
                ],
            ),
        ).tolist()
        for i, m, c in zip(random_reqs, accepted, chosen):
            sampled[i] = (m, c)

    results: list[Verified] = []
    wanted_rows: list[int] = []
    wanted_tokens: list[int] = []
    wanted_num: list[int] = []
    wanted_at: list[tuple[int, int]] = []  # (result index, number of tokens)
    for i, (req, d) in enumerate(zip(requests, drafts)):
        k, base = len(d), offsets[i]
        if i in sampled:
            m, after = sampled[i]
            tokens = d[:m] + [after]
        else:
            m = 0
            while m < k and target[base + m] == d[m]:
                m += 1
            tokens = d[:m] + [target[base + m]]
        results.append(Verified(tokens, k, None))
        if req.sampling_params.logprobs is not None:
            wanted_at.append((i, len(tokens)))
            wanted_rows.extend(range(base, base + len(tokens)))
            wanted_tokens.extend(tokens)
            wanted_num.extend([req.sampling_params.logprobs] * len(tokens))
    if wanted_rows:  # from the model's distribution, before penalties and bans (as the sampler)
        found = token_logprobs(raw[wanted_rows], wanted_tokens, wanted_num)
        at = 0
        for i, n in wanted_at:
            results[i].logprobs = found[at : at + n]
            at += n
    return results
