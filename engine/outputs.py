"""What the engine hands back: vLLM-shaped request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.sampler import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # Characters of the output sent before this text: a continuation's resumed text (else 0).
    text_offset: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), once the prompt is computed.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Streaming deltas of the last step (the full text/token_ids are in outputs[0]).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With finish_reason "error": the engine step failed on this request (and on it alone).
    error: str | None = None
    # num_cached_tokens by tier ({"GPU": n, "CPU": n, "SHARED": n}); None: the engine has no tiers
    num_cached_tokens_by_medium: dict[str, int] | None = None

    # Conveniences for the common single-output case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
