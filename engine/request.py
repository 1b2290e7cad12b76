"""A request's state inside the engine core: tokens, progress, and block keys."""

from __future__ import annotations

import enum
import time

from kvmesh.common.block_keys import block_key, root_key
from kvmesh.common.lora import adapter_identity
from kvmesh.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = (
        "error"  # an engine step failed on this request (EngineCoreOutput.error says how)
    )

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int],
        model_id: str,
        block_size: int,
        max_model_len: int,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        resumed_token_ids: list[int] | None = None,
        lora=None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # A continuation (mid-stream resume) starts with the output another replica generated:
        # prefilled with the prompt, counted as output (max_tokens, min_tokens, penalties, stops).
        self.all_token_ids = list(prompt_token_ids) + list(resumed_token_ids or ())
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set() if sampling_params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(sampling_params.stop_token_ids)
        self.block_size = block_size
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set once, on first admission
        # ... and split by tier ({"GPU": n, "CPU": n, "SHARED": n}) when the engine has tiers
        self.num_cached_tokens_by_medium: dict[str, int] | None = None
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Draft tokens for the next step (speculative decoding): not part of all_token_ids until
        # verified, so neither block keys nor stop checks ever see them.
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens sampled by a step still in flight (scheduled on, not yet known).
        self.num_output_placeholders = 0
        # Constrained decoding: the request's grammar (engine/structured/backend.py RequestGrammar),
        # set by the engine core; the scheduler holds the request back while it compiles.
        self.structured = None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        # Admission order (engine/prefill_order.py): the `priority` policy's key (lower first),
        # and how often a later arrival was admitted while this one waited (the sjf policy's aging).
        self.priority = priority
        self.prefill_skips = 0
        # Whole-request token limit: max_tokens, capped by the model length.
        limit = max_model_len - self.num_prompt_tokens
        if sampling_params.max_tokens is not None:
            limit = min(limit, sampling_params.max_tokens)
        self.max_output_tokens = limit
        # Prompt logprobs by position (the first token has none), filled as the prompt is computed.
        self.prompt_logprobs: list | None = (
            [None] * self.num_prompt_tokens if sampling_params.prompt_logprobs is not None else None
        )
        # The adapter it runs with (engine/lora/adapter.py LoRAAdapter: name, int_id, digest, ...);
        # None: the base model. Its blocks chain from the adapter's root (kvmesh.common.lora).
        self.lora = lora
        identity = model_id if lora is None else adapter_identity(model_id, lora.name, lora.digest)
        self._root = root_key(identity, cache_salt)
        self._block_keys: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def block_keys(self, num_blocks: int) -> list[int]:
        """Keys of the first `num_blocks` full blocks, extended lazily as tokens arrive."""
        keys = self._block_keys
        bs = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            parent = keys[-1] if keys else self._root
            keys.append(block_key(parent, self.all_token_ids[i * bs : (i + 1) * bs]))
        return keys[:num_blocks]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.structured is not None:
            self.structured.accept(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Decide, after a token was appended, whether the request is done."""
        n_out = self.num_output_tokens
        last = self.all_token_ids[-1]
        if self.structured is not None and self.structured.done:
            # The grammar is complete (its stop token taken; min_tokens cannot add to it).
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if n_out >= self.sampling_params.min_tokens:
            if last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
