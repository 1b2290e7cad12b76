"""The engine's limits on a request (context length, vocabulary) and the checks made against them.

One copy of these checks: the engine core runs them when a request is added, and the API process
runs them on the figures the core process sent when it was ready (no round trip per request).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams


class PromptTooLong(InvalidParameter):
    def __init__(self, message: str):
        super().__init__("prompt", message)


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    vocab_size: int

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidParameter("prompt", "prompt is empty: it must contain at least one token")
        if n >= self.max_model_len:
            raise PromptTooLong(
                f"prompt has {n} tokens, but the model's maximum context length is {self.max_model_len} "
                f"tokens and at least one must be left for the output")
        self.check_token_ids("prompt", prompt_token_ids)

    def validate_params(self, params: SamplingParams) -> None:
        """Checks of sampling params that need the model (SamplingParams checked the rest on
        construction): every count within the vocabulary, every token id in it."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise InvalidParameter("top_k", f"top_k must be -1 (off) or at most the vocabulary size {vocab}, "
                                            f"got {params.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise InvalidParameter(name, f"{name} must be at most the vocabulary size {vocab}")
        self.check_token_ids("stop_token_ids", params.stop_token_ids)
        self.check_token_ids("logit_bias", params.logit_bias or ())

    def check_token_ids(self, param: str, token_ids) -> None:
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter(param, f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
