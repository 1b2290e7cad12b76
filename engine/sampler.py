"""Turn logits into tokens: penalties, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Filters are applied row-wise in one vectorised pass. Random rows sample by
inversion (one uniform per row against the row's cumulative distribution: the
first token whose cumulative probability exceeds it), whose uniform comes from
the request's own generator when it has a seed: a seeded request draws the same
tokens whatever else shares its batch. Inversion draws one random number per
row where the exponential race (argmax of p / E) draws one per vocabulary entry:
on a CPU that race cost 1.5 ms a row at a 49k vocabulary, as much as 7% of a
small batch's decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.penalties import apply_penalties, to_device
from kvmesh.engine.request import Request


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, as argmax picks it, at about half argmax's time on the CPU."""
    return logits.max(dim=-1).indices


def sample_by_inversion(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first index whose cumulative probability exceeds ``uniform[i]`` (in [0, 1))
    times the row's total (rows need not be normalised). A zero-probability token is never chosen:
    the cumulative sum does not rise at it. Summed in float64, so the rounding over a large
    vocabulary stays far below any probability that matters."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = uniform.to(torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int], chunk: int = 256
                   ) -> list[TokenLogprobs]:
    """Logprob, rank and top-N (``num_top[i]``) of ``token_ids[i]`` under row i's logits, from the
    raw distribution; a slice of rows at a time, so the [rows, vocab] log-softmax stays small."""
    out: list[TokenLogprobs] = []
    k = max(1, max(num_top))
    for s in range(0, len(token_ids), chunk):
        lp = torch.log_softmax(logits[s:s + chunk].float(), dim=-1)
        target = torch.tensor(token_ids[s:s + chunk], device=lp.device)
        chosen = lp.gather(1, target[:, None])[:, 0]
        ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
        top_v, top_i = lp.topk(k, dim=-1)
        for tid, n, value, rank, tv, ti in zip(token_ids[s:s + chunk], num_top[s:s + chunk], chosen.tolist(),
                                              ranks.tolist(), top_v.tolist(), top_i.tolist()):
            out.append(TokenLogprobs(tid, value, rank, list(zip(ti[:n], tv[:n]))))
    return out


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.device = device
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def checkpoint(self, requests: list[Request]) -> dict[str, torch.Tensor | None]:
        """The generator states of these (seeded) requests, for rollback() after a failed step."""
        return {r.request_id: (g.get_state() if (g := self._request_generators.get(r.request_id)) is not None
                               else None) for r in requests}

    def rollback(self, checkpoint: dict[str, torch.Tensor | None], requests: list[Request]) -> None:
        """Put the requests' generators back as they were at checkpoint(): a step that is run again
        draws the same noise, so a seeded request samples the same tokens."""
        for r in requests:
            if r.request_id not in checkpoint:
                continue
            state = checkpoint[r.request_id]
            if state is None:
                self._request_generators.pop(r.request_id, None)  # re-created from the seed on use
            elif (g := self._request_generators.get(r.request_id)) is not None:
                g.set_state(state)

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._request_generators[request.request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, requests: list[Request], to_host: bool = True
                 ) -> tuple[list[int] | torch.Tensor, list[TokenLogprobs | None]]:
        """Sampled ids (a list, or with ``to_host=False`` the device tensor: the caller copies it
        back without waiting) and each row's logprobs when its request asks for them."""
        raw = logits  # logprobs come from the model's distribution, before penalties and bans
        logits = self.adjust(logits, requests)

        # Decisions from the host-side params, never from device values: no sync but the one
        # copy of the sampled ids below.
        greedy = [r.sampling_params.greedy for r in requests]
        if not any(greedy):
            tokens = self._sample(logits, requests, greedy)
        else:
            tokens = greedy_tokens(logits)
            if not all(greedy):
                mask = to_device(greedy, torch.bool, logits.device)
                tokens = torch.where(mask, tokens, self._sample(logits, requests, greedy))

        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if to_host:
            token_list = tokens.tolist()  # the step's one device-to-host copy
        elif wanted:  # logprobs need the chosen ids on the host: these rows' only
            token_list = dict(zip(wanted, tokens[wanted].tolist()))
        if wanted:
            found = token_logprobs(raw[wanted], [token_list[i] for i in wanted],
                                   [requests[i].sampling_params.logprobs for i in wanted])
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

    def _sample(self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]) -> torch.Tensor:
        probs = self.probs(logits, requests)
        return sample_by_inversion(probs, self.uniforms(requests, probs.device, wanted=[not g for g in greedy]))

    def uniforms(self, requests: list[Request], device, wanted: list[bool] | None = None) -> torch.Tensor:
        """One uniform per request (0 where ``wanted`` is False), each from its request's generator.
        Unseeded rows share one draw from the engine's."""
        out = torch.zeros(len(requests), device=device)
        at = [i for i in range(len(requests)) if wanted is None or wanted[i]]
        shared = [i for i in at if requests[i].sampling_params.seed is None]
        if shared:
            out[to_device(shared, torch.long, device)] = torch.rand(len(shared), generator=self.generator,
                                                                    device=device)
        for i in at:
            if requests[i].sampling_params.seed is not None:
                out[i:i + 1].uniform_(generator=self._generator_for(requests[i]))
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
