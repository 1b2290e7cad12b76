"""Turn logits into tokens: penalties, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Filters are applied row-wise in one vectorised pass. Random rows sample by
inversion (one uniform per row against the row's cumulative distribution: the
first token whose cumulative probability exceeds it). Inversion draws one random
number per row where the exponential race (argmax of p / E) draws one per
vocabulary entry: on a CPU that race cost 1.5 ms a row at a 49k vocabulary, as
much as 7% of a small batch's decode step.

A seeded request's uniform is a function of (seed, output position) alone
(``seeded_uniform``, a counter-based hash): its token at position p is the same
whatever else shares its batch, whether a failed step is run again, and whether
the request runs in one go or is resumed at p from its first p tokens on another
replica. Nothing per request is kept between steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvmesh.engine.greedy import greedy_tokens
from kvmesh.engine.penalties import apply_penalties, to_device
from kvmesh.engine.request import Request


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # splitmix64's increment


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers whose every output bit depends on
    every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int) -> int:
    return _mix64((seed + _GOLDEN64) & _MASK64)


def seeded_uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform in [0, 1) (53 random bits) that depends on (seed, position, stream) alone: the
    draw of a seeded request for its output token ``position`` (``stream`` tells apart draws for
    the same position, e.g. speculative decoding's accept test from its sample)."""
    x = (_seed_key(seed) + (position * 2 + 1) * _GOLDEN64 + stream * 0xD1B54A32D192ED03) & _MASK64
    x = (
        (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    ) & _MASK64  # _mix64, inlined: it runs per row and step
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 11) * (1.0 / (1 << 53))


def sample_by_inversion(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first index whose cumulative probability exceeds ``uniform[i]`` (in [0, 1))
    times the row's total (rows need not be normalised). A zero-probability token is never chosen:
    the cumulative sum does not rise at it. Summed in float64, so the rounding over a large
    vocabulary stays far below any probability that matters."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = uniform.to(torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int], chunk: int = 256
) -> list[TokenLogprobs]:
    """Logprob, rank and top-N (``num_top[i]``) of ``token_ids[i]`` under row i's logits, from the
    raw distribution; a slice of rows at a time, so the [rows, vocab] log-softmax stays small."""
    out: list[TokenLogprobs] = []
    k = max(1, max(num_top))
    for s in range(0, len(token_ids), chunk):
        lp = torch.log_softmax(logits[s : s + chunk].float(), dim=-1)
        target = torch.tensor(token_ids[s : s + chunk], device=lp.device)
        chosen = lp.gather(1, target[:, None])[:, 0]
        ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
        top_v, top_i = lp.topk(k, dim=-1)
        for tid, n, value, rank, tv, ti in zip(
            token_ids[s : s + chunk],
            num_top[s : s + chunk],
            chosen.tolist(),
            ranks.tolist(),
            top_v.tolist(),
            top_i.tolist(),
        ):
            out.append(TokenLogprobs(tid, value, rank, list(zip(ti[:n], tv[:n]))))
    return out


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)  # the unseeded rows' shared randomness
        self.generator.manual_seed(seed)
        self.device = device

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        to_host: bool = True,
        positions: list[int] | None = None,
    ) -> tuple[list[int] | torch.Tensor, list[TokenLogprobs | None]]:
        """Sampled ids (a list, or with ``to_host=False`` the device tensor: the caller copies it
        back without waiting) and each row's logprobs when its request asks for them.
        ``positions``: each row's output position (the index of the token it samples in the
        request's output); by default each request's output length, right when every request's
        tokens are all known (a step scheduled ahead of its previous step's tokens passes them)."""
        raw = logits  # logprobs come from the model's distribution, before penalties and bans
        logits = self.adjust(logits, requests)

        # Decisions from the host-side params, never from device values: no sync but the one
        # copy of the sampled ids below.
        greedy = [r.sampling_params.greedy for r in requests]
        if not any(greedy):
            tokens = self._sample(logits, requests, greedy, positions)
        else:
            tokens = greedy_tokens(logits)
            if not all(greedy):
                mask = to_device(greedy, torch.bool, logits.device)
                tokens = torch.where(
                    mask, tokens, self._sample(logits, requests, greedy, positions)
                )

        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if to_host:
            token_list = tokens.tolist()  # the step's one device-to-host copy
        elif wanted:  # logprobs need the chosen ids on the host: these rows' only
            token_list = dict(zip(wanted, tokens[wanted].tolist()))
        if wanted:
            found = token_logprobs(
                raw[wanted],
                [token_list[i] for i in wanted],
                [requests[i].sampling_params.logprobs for i in wanted],
            )
            for i, lp in zip(wanted, found):
                logprobs[i] = lp
        return (token_list if to_host else tokens), logprobs

    @staticmethod
    def adjust(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Penalties and logit bias, then min_tokens' ban on EOS and stop token ids (``logits``
        itself when nothing applies)."""
        raw = logits
        logits = apply_penalties(logits, requests)
        for i, req in enumerate(requests):
            sp = req.sampling_params
            if req.num_output_tokens < sp.min_tokens:
                banned = list(req.eos_token_ids | req.stop_token_ids)
                if banned:
                    if logits is raw:
                        logits = logits.clone()  # only when something is banned: 12 MB at batch 64
                    logits[i, banned] = float("-inf")
        return logits

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        greedy: list[bool],
        positions: list[int] | None,
    ) -> torch.Tensor:
        probs = self.probs(logits, requests)
        return sample_by_inversion(
            probs, self.uniforms(requests, probs.device, [not g for g in greedy], positions)
        )

    def uniforms(
        self,
        requests: list[Request],
        device,
        wanted: list[bool] | None = None,
        positions: list[int] | None = None,
        stream: int = 0,
    ) -> torch.Tensor:
        """One uniform per request (0 where ``wanted`` is False), in float64. A seeded row's is
        ``seeded_uniform(seed, position, stream)`` (``positions``: as in ``__call__``); unseeded
        rows share one draw from the engine's generator."""
        at = [i for i in range(len(requests)) if wanted is None or wanted[i]]
        seeded = [i for i in at if requests[i].sampling_params.seed is not None]
        values = None
        if seeded:
            values = to_device(
                [
                    seeded_uniform(
                        requests[i].sampling_params.seed,
                        positions[i] if positions is not None else requests[i].num_output_tokens,
                        stream,
                    )
                    for i in seeded
                ],
                torch.float64,
                device,
            )
            if len(seeded) == len(requests):
                return values
        shared = [i for i in at if requests[i].sampling_params.seed is None] if seeded else at
        if len(shared) == len(requests):
            return torch.rand(
                len(shared), generator=self.generator, device=device, dtype=torch.float64
            )
        out = torch.zeros(len(requests), dtype=torch.float64, device=device)
        if shared:
            out[to_device(shared, torch.long, device)] = torch.rand(
                len(shared), generator=self.generator, device=device, dtype=torch.float64
            )
        if seeded:
            out[to_device(seeded, torch.long, device)] = values
        return out

    def probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k, top-p, min-p applied."""
        params = [r.sampling_params for r in requests]
        dev = logits.device
        temps = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, dev)
        logits = logits / temps[:, None]
        if any(p.top_k > 0 for p in params):
            top_k = to_device([p.top_k for p in params], torch.long, dev)
            k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
            sorted_logits = logits.sort(dim=-1, descending=True).values
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_p = to_device([p.top_p for p in params], torch.float32, dev)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Drop tokens once the mass before them already reaches top_p ...
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
            # ... but never the top token (nor one tied with it): a top_p below float32's smallest
            # subnormal (1e-46, 1e-300) is 0 here, which would drop every token of the row.
            drop_sorted &= sorted_logits < sorted_logits[:, :1]
            # A row with top_p=1 in a batch that truncates keeps everything: its cumulative sum can
            # round up to 1 before the tail, which would cut its least likely tokens.
            drop_sorted &= (top_p < 1.0)[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            # min_p <= 1, so the top token (and any tied with it) is never below the threshold
            min_p = to_device([p.min_p for p in params], torch.float32, dev)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs
