"""Per-request sampling parameters, validated on construction (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (the server's 400 body uses it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL/HF's: divides (or multiplies) logits of prompt + generated tokens
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias in [-100, 100] added to its logit
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (its prompt is not read from the cache)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # samples per prompt: fanned out into n engine requests (seeds seed, seed+1, ...)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidParameter:
            return InvalidParameter(param, f"{param} {message}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be a positive integer, got {self.n!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0):
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0.0):
            raise bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        for tid, bias in (self.logit_bias or {}).items():
            if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                raise bad("logit_bias", f"keys must be token ids (non-negative integers), got {tid!r}")
            if not (-100.0 <= bias <= 100.0):
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tid}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", f"must be between 0 and 20, got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias to apply before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
