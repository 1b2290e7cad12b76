"""The engine core: scheduler + KV-cache manager + model runner, one step at a time.

Token ids in, token ids out. Text (tokenisation, detokenisation, stop strings)
lives a layer above, in LLMEngine, so a server can run this loop in its own
thread or process without the HTTP side waiting on it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvmesh.common.models import resolve_model_dir
from kvmesh.engine.config import EngineArgs, ModelConfig, parse_size
from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.model_runner import ModelRunner
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampler import TokenLogprobs
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams
from kvmesh.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class PromptTooLong(InvalidParameter):
    def __init__(self, message: str):
        super().__init__("prompt", message)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int


def _pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class EngineCore:
    def __init__(self, args: EngineArgs):
        args.validate()
        self.args = args
        self.model_dir = resolve_model_dir(args.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.model_id = args.served_model_name or args.model
        self.device = _pick_device(args.device)
        self.dtype = self.model_config.resolve_dtype(args.dtype, self.device)
        self.block_size = args.block_size

        per_block = self.model_config.kv_bytes_per_block(args.block_size, self.dtype)
        num_blocks = args.num_kv_blocks or parse_size(args.kv_cache_memory) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {args.kv_cache_memory} holds no block of {per_block} bytes")
        capacity = num_blocks * args.block_size
        if args.max_model_len is not None:
            if args.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len {args.max_model_len} does not fit the KV cache "
                    f"({num_blocks} blocks x {args.block_size} = {capacity} tokens): "
                    "raise num_kv_blocks / kv_cache_memory or lower max_model_len")
            self.max_model_len = args.max_model_len
        else:
            self.max_model_len = min(self.model_config.max_position_embeddings, capacity)
        max_batched = args.max_num_batched_tokens
        if not args.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)  # a whole prompt must fit one step
        self.max_num_batched_tokens = max_batched
        self.num_blocks = num_blocks

        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching, args.enable_kv_events)
        self.scheduler = Scheduler(self.kv, max_batched, args.max_num_seqs, self.max_model_len,
                                   args.enable_chunked_prefill)
        self.runner = ModelRunner(self.model_config, self.model_dir, self.dtype, self.device,
                                  num_blocks, args.block_size, self.max_model_len, args.seed,
                                  batch_hint=args.max_num_seqs)
        self.eos_token_ids: set[int] = set(self.model_config.eos_token_id)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self._pending_aborts: list[EngineCoreOutput] = []
        log.info("engine ready: model=%s dtype=%s device=%s blocks=%d (%d tokens) max_model_len=%d",
                 self.model_id, self.dtype, self.device, num_blocks, capacity, self.max_model_len)

    # -- requests ----------------------------------------------------------------
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
        """Checks of sampling params that need the vocabulary."""
        self.check_token_ids("stop_token_ids", params.stop_token_ids)
        self.check_token_ids("logit_bias", params.logit_bias or ())

    def check_token_ids(self, param: str, token_ids) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter(param, f"token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> Request:
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, self.model_id,
                          self.block_size, self.max_model_len, cache_salt, arrival_time)
        self.scheduler.add_request(request)
        return request

    def abort_requests(self, request_ids, report: bool = True) -> None:
        """End requests and free their blocks; with `report`, the next step emits an
        "abort" output for each (a caller that already finished them passes False)."""
        for rid in request_ids:
            req = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                self.runner.sampler.forget(rid)
                if report:
                    self._pending_aborts.append(EngineCoreOutput(
                        rid, [], finish_reason="abort",
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        num_prompt_tokens=req.num_prompt_tokens))

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or abort outputs the next step will emit."""
        return self.scheduler.has_unfinished() or bool(self._pending_aborts)

    # -- the step ------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        outputs, self._pending_aborts = self._pending_aborts, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        for req in sched.requests:
            # Prompt tokens computed this step (recomputation after preemption counts too).
            n = sched.num_scheduled_tokens[req.request_id]
            self.prompt_tokens += max(0, min(req.num_prompt_tokens - req.num_computed_tokens, n))
        sampled, logprobs, prompt_lps = self.runner.execute(sched, self.kv)
        if prompt_lps:
            by_id = {r.request_id: r for r in sched.requests}
            for rid, entries in prompt_lps.items():
                for pos, lp in entries:  # a recompute after preemption writes the same values again
                    by_id[rid].prompt_logprobs[pos] = lp
        for req, token in self.scheduler.update_from_output(sched, sampled):
            self.generation_tokens += 1
            finished = req.status.finished
            if finished:
                self.runner.sampler.forget(req.request_id)
            lp = logprobs.get(req.request_id)
            outputs.append(EngineCoreOutput(
                req.request_id, [token], [lp] if lp is not None else [],
                finish_reason=req.status.value if finished else None,
                stop_reason=req.stop_reason if finished else None,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                num_prompt_tokens=req.num_prompt_tokens,
                prompt_logprobs=(list(req.prompt_logprobs) if req.prompt_logprobs is not None
                                 and req.num_output_tokens == 1 else None)))
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def take_kv_events(self):
        return self.kv.take_events()

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_cache_usage=self.kv.usage,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.kv.pool.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_steps=self.num_steps,
        )
