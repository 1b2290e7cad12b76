"""Per-request sampling parameters, validated on construction (vLLM's names)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

from kvmesh.common.request_limits import INT64_MAX, MAX_LOGPROBS, SEED_MAX, SEED_MIN
from kvmesh.engine.structured.params import StructuredOutputsParams


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (the server's 400 body uses it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bound_text(low, high) -> str:
    if high is None or high == INT64_MAX:
        return f">= {low}"
    return f"in [{low}, {high}]"


def _int(param: str, value, low: int, high: int, what: str | None = None) -> int:
    """An integer in [low, high] (as a plain int), or InvalidParameter naming ``param``."""
    if not _is_int(value) or not low <= value <= high:
        bound = what or (
            _bound_text(low, high) + (f" (at most {high})" if high == INT64_MAX else "")
        )
        raise InvalidParameter(param, f"{param} must be an integer {bound}, got {_show(value)}")
    return int(value)


def _float(
    param: str,
    value,
    low: float,
    high: float | None,
    low_open: bool = False,
    what: str | None = None,
) -> float:
    """A finite number in [low, high] ((low, high] with ``low_open``): never NaN or infinite."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        try:
            value = float(value)
        except OverflowError:  # an integer too large for a float
            ok = False
    ok = (
        ok
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (high is None or value <= high)
    )
    if not ok:
        bound = (
            (f"> {low}" if low_open else f">= {low}")
            if high is None
            else (f"in {'(' if low_open else '['}{low}, {high}]")
        )
        raise InvalidParameter(
            param,
            f"{param} must be a finite number {bound}, got {_show(value)}"
            + (f" for {what}" if what else ""),
        )
    return value


def check_text(param: str, text: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate ("\\ud800" in JSON) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameter(
            param, f"{param} is not valid Unicode text: {exc.reason} at position {exc.start}"
        ) from None


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    repetition_penalty: float = (
        1.0  # CTRL/HF's: divides (or multiplies) logits of prompt + generated tokens
    )
    logit_bias: dict[int, float] | None = (
        None  # OpenAI's: token id -> bias in [-100, 100] added to its logit
    )
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = (
        None  # top-N logprobs per prompt token (its prompt is not read from the cache)
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # samples per prompt: fanned out into n engine requests (seeds seed, seed+1, ...)
    # Constrained decoding (vLLM's shape): a JSON schema, any JSON object, a regex, a choice or an
    # EBNF grammar the output must follow (engine/structured/, docs/structured-outputs.md).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidParameter("stop", "stop must be a string or a list of strings")
        self.stop = list(self.stop or [])
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidParameter("stop_token_ids", "stop_token_ids must be a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Every number within what the engine can hold: integers in range (int64 at most, so they
        fit a tensor), floats finite and in range. Bounds that need the model (the vocabulary)
        are checked by EngineCore.validate_params."""
        self.n = _int("n", self.n, 1, INT64_MAX)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1, INT64_MAX)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        self.temperature = _float("temperature", self.temperature, 0.0, None)
        self.top_p = _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = _int("top_k", self.top_k, -1, INT64_MAX, "-1 or 0 (off), or positive")
        self.min_p = _float("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _float(
            "repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True
        )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParameter("logit_bias", "logit_bias must map token ids to biases")
            bias = {}
            for tid, value in self.logit_bias.items():
                if not _is_int(tid) or tid < 0:
                    raise InvalidParameter(
                        "logit_bias",
                        f"logit_bias keys must be token ids (non-negative "
                        f"integers), got {_show(tid)}",
                    )
                bias[int(tid)] = _float(
                    "logit_bias", value, -100.0, 100.0, what=f"the bias of token {tid}"
                )
            self.logit_bias = bias
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameter("stop", "stop must be non-empty strings")
            check_text("stop", s)
        self.stop_token_ids = [
            _int("stop_token_ids", t, 0, INT64_MAX, "non-negative token ids")
            for t in self.stop_token_ids
        ]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise InvalidParameter("structured_outputs", f"structured_outputs: {exc}") from None
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise InvalidParameter(
                "structured_outputs", "structured_outputs must be a StructuredOutputsParams"
            )
        if self.seed is not None:
            # The seeds of the n samples (seed, seed + 1, ...) must all fit torch's generator.
            self.seed = _int(
                "seed",
                self.seed,
                SEED_MIN,
                SEED_MAX - (self.n - 1),
                "in [-2**63, 2**64 - 1] (a 64-bit seed"
                + (", seed + n - 1 included)" if self.n > 1 else ")"),
            )

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias to apply before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def sample(self, j: int) -> SamplingParams:
        """The params of sample ``j`` of the ``n``: one engine request, seeded ``seed + j``."""
        if self.n == 1:
            return self
        return replace(self, n=1, seed=None if self.seed is None else self.seed + j)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
