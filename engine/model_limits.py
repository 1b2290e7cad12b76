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


RESUME_PARAM = "resume.output_token_ids"  # the continuation's ids, as the API names them


class ResumeTooLong(InvalidParameter):
    """A continuation with no room left to generate in (context or max_tokens)."""

    def __init__(self, message: str, context: bool):
        super().__init__(RESUME_PARAM, message)
        self.context = context  # the context length is the limit (not max_tokens)


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
                f"tokens and at least one must be left for the output"
            )
        self.check_token_ids("prompt", prompt_token_ids)

    def validate_resume(
        self, prompt_token_ids: list[int], resumed_token_ids: list[int], params: SamplingParams
    ) -> None:
        """A continuation's already-generated ids: in the vocabulary, and with room for at least
        one more token under the context length and max_tokens (they count as output)."""
        if not resumed_token_ids:
            raise InvalidParameter(RESUME_PARAM, f"{RESUME_PARAM} must hold at least one token id")
        if params.n != 1:
            raise InvalidParameter("n", "a continuation (resume) continues one choice: n must be 1")
        self.check_token_ids(RESUME_PARAM, resumed_token_ids)
        n_prompt, n_out = len(prompt_token_ids), len(resumed_token_ids)
        if n_prompt + n_out >= self.max_model_len:
            raise ResumeTooLong(
                f"the prompt ({n_prompt} tokens) and {RESUME_PARAM} ({n_out}) fill the model's "
                f"maximum context length of {self.max_model_len} tokens: nothing is left to "
                "generate",
                context=True,
            )
        if params.max_tokens is not None and n_out >= params.max_tokens:
            raise ResumeTooLong(
                f"{RESUME_PARAM} holds {n_out} tokens, max_tokens is {params.max_tokens}: "
                "the request is complete, nothing is left to generate",
                context=False,
            )

    def validate_params(self, params: SamplingParams) -> None:
        """Checks of sampling params that need the model (SamplingParams checked the rest on
        construction): every count within the vocabulary, every token id in it."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise InvalidParameter(
                "top_k",
                f"top_k must be -1 (off) or at most the vocabulary size {vocab}, "
                f"got {params.top_k}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise InvalidParameter(name, f"{name} must be at most the vocabulary size {vocab}")
        self.check_token_ids("stop_token_ids", params.stop_token_ids)
        self.check_token_ids("logit_bias", params.logit_bias or ())

    def check_token_ids(self, param: str, token_ids) -> None:
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter(
                param, f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
