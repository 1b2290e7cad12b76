"""The ``speculative_config`` engine argument (vLLM's shape), validated with errors naming the field."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram",)


class SpeculativeConfigError(ValueError):
    """A bad ``speculative_config``; ``field`` names the offending key (``speculative_config.<key>``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram prompt lookup: draft the ``num_speculative_tokens`` tokens that followed the most
    recent earlier occurrence of the request's last n tokens (n from ``prompt_lookup_max`` down
    to ``prompt_lookup_min``).

    When it is worth it:
    * ``disable_by_batch_size``: no drafts in a step that has this many running requests or more
      (a big batch is compute-bound: drafts cost more than they save). ``None``: never.
    * per request, ``acceptance_threshold`` / ``acceptance_min_drafts`` / ``acceptance_ema`` and
      ``reprobe_interval``: a request whose acceptance rate (an exponential moving average over its
      verified drafts, each weighted by its draft length) is below the threshold after at least
      ``acceptance_min_drafts`` drafts stops drafting for ``reprobe_interval`` steps, then drafts
      once more to re-probe; each failed probe doubles the pause (up to 16x), a good one resets it.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = 16
    acceptance_threshold: float = 0.25
    acceptance_min_drafts: int = 4
    acceptance_ema: float = 0.3
    reprobe_interval: int = 16

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """A config from a dict, a JSON object string, or a config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            if value is not None:
                value.validate()
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(
                    "speculative_config", f"not valid JSON: {exc.msg}"
                ) from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError(
                "speculative_config", f"must be a JSON object (a dict), got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config.{unknown[0]}",
                f"unknown key (known: {', '.join(sorted(known))})",
            )
        if "num_speculative_tokens" not in value:
            raise SpeculativeConfigError(
                "speculative_config.num_speculative_tokens",
                "is required (how many tokens each draft proposes)",
            )
        value = dict(value)
        # vLLM: giving only one of the two lookup bounds sets both.
        if "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
            value["prompt_lookup_min"] = (
                min(value["prompt_lookup_max"], cls.prompt_lookup_min)
                if _is_int(value["prompt_lookup_max"])
                else value["prompt_lookup_max"]
            )
        if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
            value["prompt_lookup_max"] = (
                max(value["prompt_lookup_min"], cls.prompt_lookup_max)
                if _is_int(value["prompt_lookup_min"])
                else value["prompt_lookup_min"]
            )
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        def bad(name: str, message: str):
            raise SpeculativeConfigError(f"speculative_config.{name}", message)

        if self.method not in METHODS:
            bad("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name, low, high in (
            ("num_speculative_tokens", 1, 32),
            ("prompt_lookup_max", 1, 64),
            ("prompt_lookup_min", 1, 64),
            ("acceptance_min_drafts", 1, 1 << 20),
            ("reprobe_interval", 1, 1 << 20),
        ):
            v = getattr(self, name)
            if not _is_int(v) or not low <= v <= high:
                bad(name, f"must be an integer in [{low}, {high}], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad(
                "prompt_lookup_min",
                f"must be at most prompt_lookup_max ({self.prompt_lookup_max}), "
                f"got {self.prompt_lookup_min}",
            )
        d = self.disable_by_batch_size
        if d is not None and (not _is_int(d) or d < 1):
            bad("disable_by_batch_size", f"must be a positive integer or null (never), got {d!r}")
        for name in ("acceptance_threshold", "acceptance_ema"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                bad(name, f"must be a number in [0, 1], got {v!r}")
        if self.acceptance_ema == 0.0:
            bad("acceptance_ema", "must be above 0 (the weight of each new draft's acceptance)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
