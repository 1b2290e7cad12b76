"""The engine core: scheduler + KV-cache manager + model runner, one step at a time.

Token ids in, token ids out. Text (tokenisation, detokenisation, stop strings)
lives a layer above, in LLMEngine, so a server can run this loop in its own
thread or process without the HTTP side waiting on it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvmesh.common.kv_tiers import MEDIA
from kvmesh.engine.builtin import resolve_model_dir
from kvmesh.engine.config import EngineArgs, ModelConfig, parse_size, pick_device
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_offload.shared_tier import EventInbox, build_shared_store
from kvmesh.engine.kv_offload.tiers import TierStats, build_tiers
from kvmesh.engine.lora.manager import LoRAManager, describe
from kvmesh.engine.lora.request import LoRAError, LoRARequest
from kvmesh.engine.model_limits import EngineLimits
from kvmesh.engine.model_runner import ModelRunner
from kvmesh.engine.prefill_order import check_priority
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampler import TokenLogprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler, SchedulerOutput
from kvmesh.engine.spec_decode.controller import SpecDecodeStats

log = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = (
        None  # with finish_reason "error": what failed in the step, for this request only
    )
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = (
        None  # with the first token, when asked for
    )
    # num_cached_tokens by tier ({"GPU": n, "CPU": n, "SHARED": n}); None: the engine has no tiers
    num_cached_tokens_by_medium: dict[str, int] | None = None

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
    # Failed steps: "request" counts requests failed alone (the rest of their step went on),
    # "batch" counts steps that lost every request in them.
    step_failures: dict[str, int] = field(default_factory=dict)
    spec_decode: SpecDecodeStats | None = None  # with speculative_config: drafts and acceptance
    # LoRA (enable_lora): adapters of the running and the waiting requests, and the step's limit
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_loras: int = 0
    engine_threads: int = 0  # torch threads of the forwards (cpu_contention.py adapts them)
    kv_tiers: TierStats | None = None  # the KV tiers' figures, when the engine has tiers


def _subset(sched: SchedulerOutput, requests: list[Request]) -> SchedulerOutput:
    ids = {r.request_id for r in requests}
    return SchedulerOutput(
        {r.request_id: sched.num_scheduled_tokens[r.request_id] for r in requests},
        list(requests),
        starts={k: v for k, v in sched.starts.items() if k in ids},
        epochs=sched.epochs,
        is_async=sched.is_async,
    )


@dataclass
class _InFlight:
    """An async step between its dispatch and the application of its outputs."""

    sched: SchedulerOutput
    request_ids: list[str]  # every request it holds (sched.requests may shrink on failure)
    prepared: object = None  # the runner's PreparedStep (None: prepare failed)
    future: Future | None = None  # the step thread's StepResult
    dispatched_at: float = 0.0  # perf_counter at dispatch (the tiers' prefill cost)
    completed: list = field(default_factory=list)  # blocks it completes (the shared tier's)


def _wait(batch: _InFlight) -> None:
    """Until the step thread is done with a step whose results are discarded anyway."""
    if batch.future is not None:
        try:
            batch.future.result()
        except Exception:  # noqa: BLE001 - discarded
            pass


def _transfer_then_raise(runner: ModelRunner, transfers, exc: Exception):
    """On the step thread, for a step whose prepare failed: its tier copies, then its error."""
    runner.transfer(transfers)
    raise exc


def needs_sync(request: Request) -> bool:
    """Whether a request's next step must see its previous token on the host, so that it cannot be
    scheduled before that token is applied (async scheduling drains the pipeline and takes a
    synchronous step while any such request is unfinished): penalties count the output tokens,
    and min_tokens bans EOS / stop ids by the output's length until it is reached. Speculative
    decoding (drafts proposed from the history) makes every step synchronous (EngineCore), and so
    does constrained decoding: the next token's mask needs the matcher past the previous one."""
    sp = request.sampling_params
    return (
        bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0)
        or request.num_output_tokens < sp.min_tokens
        or request.structured is not None
    )


class EngineCore:
    def __init__(self, args: EngineArgs):
        args.validate()
        if args.lora_modules and not args.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        self.args = args
        self.model_dir = resolve_model_dir(args.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.model_id = args.served_model_name or args.model
        self.device = pick_device(args.device)
        self.dtype, dtype_reason = self.model_config.dtype_choice(args.dtype, self.device)
        self.block_size = args.block_size

        per_block = self.model_config.kv_bytes_per_block(args.block_size, self.dtype)
        runner = None
        if (
            self.device.type == "cuda"
            and args.num_kv_blocks is None
            and args.kv_cache_memory is None
        ):
            runner, num_blocks = self._size_kv_from_gpu_memory(args, per_block)
        else:
            num_blocks = (
                args.num_kv_blocks or parse_size(args.kv_cache_memory or "4GiB") // per_block
            )
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {args.kv_cache_memory} holds no block of {per_block} bytes"
            )
        capacity = num_blocks * args.block_size
        if args.max_model_len is not None:
            if args.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len {args.max_model_len} does not fit the KV cache "
                    f"({num_blocks} blocks x {args.block_size} = {capacity} tokens): "
                    "raise num_kv_blocks / kv_cache_memory or lower max_model_len"
                )
            self.max_model_len = args.max_model_len
        else:
            self.max_model_len = min(self.model_config.max_position_embeddings, capacity)
        max_batched = args.max_num_batched_tokens
        if not args.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)  # a whole prompt must fit one step
        self.max_num_batched_tokens = max_batched
        self.limits = EngineLimits(self.max_model_len, self.model_config.vocab_size)
        self.num_blocks = num_blocks

        self.tiers = self._build_tiers(args, per_block)  # None: the KV cache alone
        self.kv = KVCacheManager(
            num_blocks,
            args.block_size,
            args.enable_prefix_caching,
            args.enable_kv_events,
            tiers=self.tiers,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_batched,
            args.max_num_seqs,
            self.max_model_len,
            args.enable_chunked_prefill,
            max_loras=args.max_loras if args.enable_lora else 0,
            policy=args.scheduling_policy,
            max_prefill_skips=args.max_prefill_skips,
        )
        self.loras: LoRAManager | None = None  # enable_lora: the adapters served beside the base
        if args.enable_lora:
            self.loras = LoRAManager(
                args.max_loras, args.max_cpu_loras, args.max_lora_rank, self.model_config
            )
            self.scheduler.on_finish = self._release_adapter
        if runner is None:
            runner = ModelRunner(
                self.model_config,
                self.model_dir,
                self.dtype,
                self.device,
                num_blocks,
                args.block_size,
                self.max_model_len,
                args.seed,
                batch_hint=args.max_num_seqs,
                attention_backend=args.attention_backend,
            )
        else:
            runner.allocate_kv_cache(num_blocks)
        self.runner = runner
        if self.tiers is not None:
            host = self.tiers.host
            runner.use_kv_tiers(host.num_slots if host is not None else 0, self.tiers.meter)
        for module in args.lora_modules if args.enable_lora else ():
            self.add_lora(module)
        if self.device.type == "cuda" and not args.enforce_eager:
            graphs = args.compilation_config
            self.runner.capture_cuda_graphs(
                args.max_num_seqs,
                self.max_model_len,
                decode=graphs.full_decode,
                piecewise_sizes=graphs.piecewise_token_sizes(max_batched),
            )
        self.spec = None  # speculative decoding (spec_decode/), when speculative_config asks for it
        if args.speculative_config is not None:
            from kvmesh.engine.spec_decode.config import SpeculativeConfig
            from kvmesh.engine.spec_decode.controller import SpecDecoder

            self.spec = SpecDecoder(
                SpeculativeConfig.parse(args.speculative_config), self.max_model_len
            )
        self.eos_token_ids: set[int] = set(self.model_config.eos_token_id)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.step_failures = {"request": 0, "batch": 0}
        self._pending_aborts: list[EngineCoreOutput] = []
        self._compiling: dict[
            str, Request
        ] = {}  # structured requests whose grammar is not ready yet
        # Async scheduling (docs/engine.md): at most 2 steps between dispatch and their outputs'
        # application; their device work runs on one step thread, in order.
        self.async_scheduling = (
            args.async_scheduling
            if args.async_scheduling is not None
            else self.device.type == "cuda"
        )
        self._in_flight: deque[_InFlight] = deque()
        self._sync_next = (
            False  # an async schedule ran out of blocks: the next step drains and may preempt
        )
        self._sync_candidates: dict[str, Request] = {}  # requests for which needs_sync() may hold
        self._step_thread: ThreadPoolExecutor | None = None
        self.num_async_steps = 0
        self.num_threads = torch.get_num_threads()  # set_threads (cpu_contention.py)
        self._step_thread_threads: int | None = None  # what the step thread last applied
        self.num_sync_steps = 0
        log.info(
            "engine ready: model=%s dtype=%s (%s) device=%s blocks=%d (%d tokens) "
            "max_model_len=%d async_scheduling=%s",
            self.model_id,
            self.dtype,
            dtype_reason,
            self.device,
            num_blocks,
            capacity,
            self.max_model_len,
            self.async_scheduling,
        )

    def _build_tiers(self, args: EngineArgs, per_block: int):
        """The host tier and the shared tier's store, as the arguments ask."""
        inbox = EventInbox() if args.enable_kv_events else None
        cfg = self.model_config
        layout = (cfg.num_hidden_layers, cfg.num_key_value_heads, args.block_size, cfg.head_dim)
        shared = build_shared_store(args, self.model_id, self.dtype, layout, per_block, inbox)
        return build_tiers(args, per_block, shared, inbox)

    def _size_kv_from_gpu_memory(self, args: EngineArgs, per_block: int) -> tuple[ModelRunner, int]:
        """Load the model, profile one step at the largest batch, and fit the KV cache into
        what gpu_memory_utilization leaves (kv_memory.py)."""
        from kvmesh.engine import kv_memory

        model_len = args.max_model_len or self.model_config.max_position_embeddings
        runner = ModelRunner(
            self.model_config,
            self.model_dir,
            self.dtype,
            self.device,
            0,
            args.block_size,
            model_len,
            args.seed,
            batch_hint=args.max_num_seqs,
            attention_backend=args.attention_backend,
        )
        max_batched = (
            args.max_num_batched_tokens
            if args.enable_chunked_prefill
            else max(args.max_num_batched_tokens, model_len)
        )
        sizing = kv_memory.size_kv_cache(
            runner,
            max_batched,
            args.max_num_seqs,
            model_len,
            args.gpu_memory_utilization,
            per_block,
        )
        kv_memory.log_capacity(
            sizing, args.block_size, min(model_len, sizing.num_blocks * args.block_size)
        )
        return runner, sizing.num_blocks

    # -- requests ----------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.limits.validate_prompt(prompt_token_ids)

    def validate_params(self, params: SamplingParams) -> None:
        self.limits.validate_params(params)

    def check_token_ids(self, param: str, token_ids) -> None:
        self.limits.check_token_ids(param, token_ids)

    def structured_backend(self):
        """The grammar side of constrained decoding (engine/structured/backend.py), shared with
        an API server in the same process."""
        from kvmesh.engine.structured.backend import backend_for

        return backend_for(self.model_dir, self.model_config.vocab_size)

    def check_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (waiting for it): a bad spec is an InvalidParameter
        before anything is queued. Not for the step loop: add_request compiles off it."""
        if params.structured_outputs is not None:
            self.structured_backend().check(params.structured_outputs)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        resumed_token_ids: list[int] | None = None,
        lora_name: str | None = None,
        priority: int = 0,
    ) -> Request:
        """``resumed_token_ids``: a continuation's output so far (generated elsewhere).
        ``lora_name``: a loaded adapter to run with (LoRAError if there is none by that name).
        ``priority``: lower first, under the ``priority`` scheduling policy only."""
        self.validate_prompt(prompt_token_ids)
        check_priority(priority, self.scheduler.order.policy)
        self.validate_params(params)
        if resumed_token_ids is not None:
            self.limits.validate_resume(prompt_token_ids, resumed_token_ids, params)
        lora = None if lora_name is None else self.lora_adapter(lora_name)
        if request_id in self.scheduler.in_flight and request_id not in self.scheduler.requests:
            # The id of a request that ended while a step holding it is in flight (its blocks,
            # keyed by the id, are not freed yet): apply those steps first; their outputs go out
            # with the next step's.
            while self._in_flight:
                self._pending_aborts.extend(self._apply_oldest())
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            self.eos_token_ids,
            self.model_id,
            self.block_size,
            self.max_model_len,
            cache_salt,
            arrival_time,
            resumed_token_ids,
            lora=lora,
            priority=priority,
        )
        if params.structured_outputs is not None:
            request.structured = self.structured_backend().start(
                params.structured_outputs, request.eos_token_ids or self.eos_token_ids
            )
            self._compiling[request_id] = request
        self.scheduler.add_request(request)
        if lora is not None:
            self.loras.acquire(lora)  # released when the request ends (scheduler.on_finish)
        if needs_sync(request):
            self._sync_candidates[request_id] = request
        return request

    # -- LoRA adapters (enable_lora) -----------------------------------------------------------
    def _lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise LoRAError("LoRA is not enabled on this engine (enable_lora)")
        return self.loras

    def lora_adapter(self, name: str):
        """The adapter a request naming ``name`` would run with now; LoRAError if none."""
        return self._lora_manager().get(name)

    def add_lora(self, req: LoRARequest) -> dict:
        """Load an adapter (between steps); a loaded name with new files means the new adapter
        for requests to come. Returns its ``list_loras`` entry; LoRAError when refused."""
        return describe(self._lora_manager().load(req))

    def remove_lora(self, name: str) -> bool:
        """Unload an adapter: new requests cannot name it; running ones finish with it."""
        return self.loras is not None and self.loras.remove(name)

    def list_loras(self) -> list[dict]:
        return [] if self.loras is None else self.loras.list()

    def _release_adapter(self, request: Request) -> None:
        if request.lora is not None and self.loras is not None:
            self.loras.release(request.lora)

    def abort_requests(self, request_ids, report: bool = True) -> None:
        """End requests and free their blocks; with `report`, the next step emits an
        "abort" output for each (a caller that already finished them passes False)."""
        for rid in request_ids:
            req = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                if self.spec is not None:
                    self.spec.forget(rid)
                if report:
                    self._pending_aborts.append(
                        EngineCoreOutput(
                            rid,
                            [],
                            finish_reason="abort",
                            num_cached_tokens=max(req.num_cached_tokens, 0),
                            num_prompt_tokens=req.num_prompt_tokens,
                        )
                    )

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, abort outputs the next step will emit, or async
        steps whose outputs are still to be applied."""
        return (
            self.scheduler.has_unfinished() or bool(self._pending_aborts) or bool(self._in_flight)
        )

    def has_pending_kv_events(self) -> bool:
        """KV events from the tiers' own thread (the shared tier's writer) that no step has
        taken yet: an idle engine's loop publishes them without a step."""
        tiers = self.tiers
        return (
            tiers is not None and tiers.shared_events is not None and tiers.shared_events.pending()
        )

    # -- the step ------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One engine step. With async scheduling: schedule and dispatch step N+1, then apply the
        outputs of step N (which ran meanwhile); a call may return no outputs (the first, which
        only dispatches), and outputs come in order per request."""
        shared = self.tiers.shared if self.tiers is not None else None
        if shared is None:
            return self._step()
        shared.engine_busy(True)  # the shared tier's writer yields while steps run
        try:
            return self._step()
        finally:
            shared.engine_busy(self.has_unfinished_requests())

    def _step(self) -> list[EngineCoreOutput]:
        outputs, self._pending_aborts = self._pending_aborts, []
        if self._compiling:
            outputs.extend(self._poll_grammars())
        if not self.async_scheduling:
            outputs.extend(self._sync_step())
            return outputs
        if self._must_sync():
            while self._in_flight:
                outputs.extend(self._apply_oldest())
            self._sync_next = False
            self.num_sync_steps += 1
            outputs.extend(self._sync_step())
            return outputs
        sched = self.scheduler.schedule(async_step=True)
        if sched.blocked:
            self._sync_next = True
        dispatched = not sched.is_empty
        if dispatched:
            self._dispatch(sched)
        # Keep at most one step in flight between calls: N+1 is scheduled only while N runs.
        while self._in_flight and (
            len(self._in_flight) > 1 or not dispatched or self._in_flight[-1].prepared is None
        ):
            outputs.extend(self._apply_oldest())
        return outputs

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar is ready become schedulable; one whose compile failed (a spec
        the backend refuses, or the deadline) ends with an "error" output, alone. When nothing
        else can run, waits a moment for a compile instead of spinning."""
        outputs = []
        for rid, req in list(self._compiling.items()):
            if self.scheduler.requests.get(rid) is not req:
                del self._compiling[rid]  # aborted while compiling
                continue
            try:
                if not req.structured.poll():
                    continue
            except Exception as exc:  # noqa: BLE001 - this request's grammar only
                log.warning("request %s: its grammar failed: %s", rid, exc)
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
                outputs.append(
                    EngineCoreOutput(
                        rid,
                        [],
                        finish_reason="error",
                        error=f"{type(exc).__name__}: {exc}",
                        num_prompt_tokens=req.num_prompt_tokens,
                    )
                )
            del self._compiling[rid]
        if (
            self._compiling
            and not outputs
            and not self.scheduler.running
            and not self._in_flight
            and len(self._compiling) == len(self.scheduler.waiting)
        ):
            futures.wait(
                [r.structured.handle.future for r in self._compiling.values()],
                timeout=0.005,
                return_when=futures.FIRST_COMPLETED,
            )
        return outputs

    def _must_sync(self) -> bool:
        """The next step is synchronous: speculative decoding, a request that needs_sync(), or an
        async schedule that ran out of blocks (only a synchronous step preempts)."""
        if self.spec is not None or self._sync_next:
            return True
        for rid, req in list(self._sync_candidates.items()):
            if self.scheduler.requests.get(rid) is not req:
                del self._sync_candidates[rid]  # ended
            elif needs_sync(req):
                return True
            else:
                del self._sync_candidates[rid]  # min_tokens reached: async from now on
        return False

    def _count_prompt_tokens(self, sched: SchedulerOutput) -> None:
        self.prompt_tokens += self._prefill_tokens(sched)

    @staticmethod
    def _prefill_tokens(sched: SchedulerOutput) -> int:
        """Prompt tokens computed in a step (recomputation after preemption counts too); read
        before the step's progress is applied (a sync step) or from its starts (an async one)."""
        total = 0
        for req in sched.requests:
            n = sched.num_scheduled_tokens[req.request_id]
            start = sched.starts[req.request_id] if sched.is_async else req.num_computed_tokens
            total += max(0, min(req.num_prompt_tokens - start, n))
        return total

    def _observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """The tiers' prefill cost: the step's time, its prefill share, per prefilled block."""
        if self.tiers is None or sched.is_empty:
            return
        self.tiers.meter.observe_step(
            seconds, self._prefill_tokens(sched), sched.total_tokens, self.block_size
        )

    def _dispatch(self, sched: SchedulerOutput) -> None:
        """Build the step's inputs here and queue its device work on the step thread, behind the
        step in flight (whose sampled ids fill this one's placeholders on the device)."""
        self.num_steps += 1
        self.num_async_steps += 1
        self._count_prompt_tokens(sched)
        batch = _InFlight(sched, [r.request_id for r in sched.requests])
        batch.dispatched_at = time.perf_counter()
        prev = self._in_flight[-1] if self._in_flight else None
        transfers = self.kv.take_transfers()
        batch.completed = self.kv.take_completed()
        try:
            batch.prepared = self.runner.prepare(
                sched, self.kv, prev.prepared.sample_rows if prev else None
            )
        except Exception as exc:  # noqa: BLE001 - isolated when the step is applied
            if transfers:  # the tier copies still run, in order on the step thread
                batch.future = self._steps().submit(
                    _transfer_then_raise, self.runner, transfers, exc
                )
            else:
                batch.future = Future()
                batch.future.set_exception(exc)
        else:
            batch.prepared.transfers = transfers
            batch.future = self._steps().submit(self._run_async, batch, prev)
        self._in_flight.append(batch)

    def _steps(self) -> ThreadPoolExecutor:
        """The step thread (started on first use)."""
        if self._step_thread is None:
            init = None
            if self.device.type == "cuda" and self.device.index is not None:
                init = lambda: torch.cuda.set_device(self.device)  # noqa: E731 - the thread's current device
            self._step_thread = ThreadPoolExecutor(
                1, thread_name_prefix="kvmesh-step", initializer=init
            )
        return self._step_thread

    def _run_async(self, batch: _InFlight, prev: _InFlight | None):
        """On the step thread: the step, on the previous step's sampled ids."""
        if self._step_thread_threads != self.num_threads:  # set_threads: OpenMP's is per thread
            torch.set_num_threads(self.num_threads)
            self._step_thread_threads = self.num_threads
        prev_result = None
        if (
            prev is not None
            and prev.future is not None
            and prev.future.done()
            and prev.future.exception() is None
        ):
            prev_result = prev.future.result()
        return self.runner.run(batch.prepared, prev_result)

    def _apply_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight and apply its outputs. When it failed, the steps
        dispatched after it (which ran on its state) are undone, and it is run again synchronously
        in parts until the failure is pinned to its request(s)."""
        batch = self._in_flight.popleft()
        try:
            return self._apply(batch)
        finally:
            self._release(
                batch
            )  # even when applying raised: its requests' blocks are not held for ever

    def _apply(self, batch: _InFlight) -> list[EngineCoreOutput]:
        sched = batch.sched
        try:
            sampled, logprobs, prompt_lps = self.runner.finish(batch.future.result())
            failed = {}
            self._observe_step(sched, time.perf_counter() - batch.dispatched_at)
            self.kv.write_completed(batch.completed, self.runner.kv_caches)
        except Exception as exc:  # noqa: BLE001 - isolated below
            while self._in_flight:
                self._revert(self._in_flight.pop())
            # Requests that ended meanwhile are not run again.
            live = self._live(sched)
            for r in sched.requests:
                if r not in live:
                    del sched.num_scheduled_tokens[r.request_id]
            sched.requests = live
            if live:
                sampled, logprobs, prompt_lps, failed = self._isolate(sched, exc)
            else:
                sampled, logprobs, prompt_lps, failed = {}, {}, {}, {}
        outputs: list[EngineCoreOutput] = []
        if failed:
            outputs.extend(self._drop_failed(sched, failed, sampled, logprobs, prompt_lps))
        outputs.extend(
            self._outputs(
                sched,
                sampled,
                logprobs,
                prompt_lps,
                self.scheduler.update_from_async_output(sched, sampled),
            )
        )
        return outputs

    def _live(self, sched: SchedulerOutput) -> list[Request]:
        """The step's requests that are still the same requests: not ended, not preempted since."""
        return [
            r
            for r in sched.requests
            if self.scheduler.requests.get(r.request_id) is r
            and r.num_preemptions == sched.epochs[r.request_id]
        ]

    def _release(self, batch: _InFlight) -> None:
        self.scheduler.release(batch.sched, batch.request_ids)

    def _revert(self, batch: _InFlight) -> None:
        """Undo a dispatched step that will not be applied: wait until the step thread is done with
        it, drop from the prefix cache the blocks it wrote, and put
        its requests' progress back (scheduler.unschedule)."""
        _wait(batch)
        sched = batch.sched
        live = self._live(sched)
        for req in live:
            rid = req.request_id
            self.kv.pool.uncache(
                self.kv.blocks_written(req, sched.num_scheduled_tokens[rid], sched.starts[rid])
            )
        self.scheduler.unschedule(sched)
        self._release(batch)
        self.num_steps -= 1
        self.num_async_steps -= 1

    def set_threads(self, n: int) -> None:
        """Torch's thread count for the forwards from the next step on. OpenMP keeps it per
        thread: set here, on the loop's thread (which runs the forward unless steps are async),
        and by the step thread before its next step."""
        torch.set_num_threads(n)
        self.num_threads = n

    def discard_in_flight(self) -> None:
        """Drop the async steps in flight without applying them (the last-resort failure path,
        which then aborts every request)."""
        while self._in_flight:
            batch = self._in_flight.pop()
            _wait(batch)
            self._release(batch)
        self.scheduler.release_all()

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None
        if self.tiers is not None and self.tiers.shared is not None:
            self.tiers.shared.close()  # what is queued is written

    def _sync_step(self) -> list[EngineCoreOutput]:
        """One synchronous step: schedule, run, apply (the only kind without async scheduling)."""
        outputs: list[EngineCoreOutput] = []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        self._count_prompt_tokens(sched)
        t0 = time.perf_counter()
        completed = self.kv.take_completed()
        sampled, logprobs, prompt_lps, failed = self._execute(sched)
        if not failed:
            self._observe_step(sched, time.perf_counter() - t0)
            self.kv.write_completed(completed, self.runner.kv_caches)
        if failed:
            outputs.extend(self._drop_failed(sched, failed, sampled, logprobs, prompt_lps))
        if self.spec is not None:
            self._record_drafts(sched, sampled)
        outputs.extend(
            self._outputs(
                sched,
                sampled,
                logprobs,
                prompt_lps,
                self.scheduler.update_from_output(sched, sampled),
            )
        )
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
            self._trim_drafts()
        return outputs

    def _trim_drafts(self) -> None:
        """A constrained request drafts only what its grammar allows: its drafts are cut before
        the first one the matcher refuses (verification then masks each draft row as well)."""
        for req in self.scheduler.running:
            if req.spec_token_ids and req.structured is not None:
                state = req.structured.synced(req)
                req.spec_token_ids = req.spec_token_ids[: state.validate(req.spec_token_ids)]

    def _outputs(
        self, sched: SchedulerOutput, sampled: dict, logprobs: dict, prompt_lps: dict, updates: list
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if prompt_lps:
            by_id = {r.request_id: r for r in sched.requests}
            for rid, entries in prompt_lps.items():
                for pos, lp in entries:  # a recompute after preemption writes the same values again
                    by_id[rid].prompt_logprobs[pos] = lp
        for req, token in updates:
            tokens = token if isinstance(token, list) else [token]  # a list: verified drafts
            self.generation_tokens += len(tokens)
            finished = req.status.finished
            if finished:
                if self.spec is not None:
                    self.spec.forget(req.request_id)
            lp = logprobs.get(req.request_id)
            outputs.append(
                EngineCoreOutput(
                    req.request_id,
                    tokens,
                    (lp[: len(tokens)] if isinstance(lp, list) else [lp]) if lp is not None else [],
                    finish_reason=req.status.value if finished else None,
                    stop_reason=req.stop_reason if finished else None,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    num_cached_tokens_by_medium=self._by_medium(req),
                    num_prompt_tokens=req.num_prompt_tokens,
                    prompt_logprobs=(
                        list(req.prompt_logprobs)
                        if req.prompt_logprobs is not None and req.num_output_tokens == len(tokens)
                        else None
                    ),
                )
            )
        return outputs

    def _by_medium(self, req: Request) -> dict[str, int] | None:
        """The request's cached tokens by tier, when the engine has tiers."""
        if self.tiers is None:
            return None
        if req.num_cached_tokens_by_medium is None:  # admitted before any lookup (caching off)
            return {m: 0 for m in MEDIA}
        return dict(req.num_cached_tokens_by_medium)

    def _record_drafts(self, sched: SchedulerOutput, sampled: dict) -> None:
        """Count each verification (before a stop or max_tokens cuts the accepted run short)."""
        for req in sched.requests:
            tokens = sampled.get(req.request_id)
            if isinstance(tokens, list):
                num_drafts = (
                    req.num_computed_tokens
                    + sched.num_scheduled_tokens[req.request_id]
                    - req.num_tokens
                )
                self.spec.record(req.request_id, num_drafts, len(tokens) - 1)

    # -- failures: one request's fault fails that request only ----------------------------
    def _execute(self, sched: SchedulerOutput):
        """runner.execute, isolating failures: when the step raises, it is run again in halves
        (in schedule order, so a request that reads blocks another computes this step still runs
        after it) until each failure is pinned to the request that causes it. Returns
        (sampled, logprobs, prompt logprobs, {request id: exception} of the requests that failed)."""
        try:
            return (*self.runner.execute(sched, self.kv), {})
        except Exception as exc:  # noqa: BLE001 - isolated below
            return self._isolate(sched, exc)

    def _isolate(self, sched: SchedulerOutput, exc: Exception):
        """The step raised ``exc``: run it again in halves (see _execute)."""
        if len(sched.requests) == 1:
            log.error(
                "engine step failed on request %s", sched.requests[0].request_id, exc_info=exc
            )
            return {}, {}, {}, {sched.requests[0].request_id: exc}
        log.error(
            "engine step of %d requests failed; finding the request(s) that cause it",
            len(sched.requests),
            exc_info=exc,
        )
        sampled, logprobs, prompt_lps, failed = {}, {}, {}, {}
        # Bisection costs about 2 log2(n) runs per culprit; past this budget, a failure that
        # every subset hits (not a request's fault) fails what remains rather than running on.
        budget = [8 + 4 * max(1, len(sched.requests)).bit_length()]

        def attempt(part: list) -> None:  # a seeded request draws the same again: by position
            budget[0] -= 1
            try:
                s, lp, plp = self.runner.execute(_subset(sched, part), self.kv)
            except Exception as exc:  # noqa: BLE001
                if len(part) == 1 or budget[0] <= 0:
                    for r in part:
                        log.warning(
                            "request %s fails the engine step: %s: %s",
                            r.request_id,
                            type(exc).__name__,
                            exc,
                        )
                        failed[r.request_id] = exc
                    return
                half = len(part) // 2
                attempt(part[:half])
                attempt(part[half:])
                return
            sampled.update(s)
            logprobs.update(lp)
            prompt_lps.update(plp)

        half = len(sched.requests) // 2
        attempt(sched.requests[:half])
        attempt(sched.requests[half:])
        return sampled, logprobs, prompt_lps, failed

    def _drop_failed(
        self,
        sched: SchedulerOutput,
        failed: dict[str, Exception],
        sampled: dict,
        logprobs: dict,
        prompt_lps: dict,
    ) -> list[EngineCoreOutput]:
        """Fail the requests in ``failed`` (an "error" output each) and keep the rest of the step.

        The KV that a failed request was to write this step is garbage: its blocks leave the
        prefix cache, and a request that read them this step (a prefix-cache hit on a block
        computed in the same step) is sent back to recompute, as are requests reading those."""
        if len(failed) == len(sched.requests) > 1:
            self.step_failures["batch"] += 1
        else:
            self.step_failures["request"] += len(failed)
        tainted = {rid for rid in failed}
        todo = [r for r in sched.requests if r.request_id in failed]
        bad_blocks: set[int] = set()
        while todo:
            req = todo.pop()
            written = self.kv.blocks_written(
                req, sched.num_scheduled_tokens[req.request_id], sched.starts.get(req.request_id)
            )
            self.kv.pool.uncache(written)
            bad_blocks.update(b.block_id for b in written)
            for other in sched.requests:
                if other.request_id not in tainted and bad_blocks.intersection(
                    self.kv.block_table(other.request_id)
                ):
                    tainted.add(other.request_id)
                    todo.append(other)
        outputs = []
        for req in [r for r in sched.requests if r.request_id in tainted]:
            rid = req.request_id
            sampled.pop(rid, None)
            logprobs.pop(rid, None)
            prompt_lps.pop(rid, None)
            del sched.num_scheduled_tokens[rid]
            if rid in failed:
                exc = failed[rid]
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
                if self.spec is not None:
                    self.spec.forget(rid)
                outputs.append(
                    EngineCoreOutput(
                        rid,
                        [],
                        finish_reason="error",
                        error=f"{type(exc).__name__}: {exc}",
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        num_prompt_tokens=req.num_prompt_tokens,
                    )
                )
            else:
                log.info(
                    "request %s read KV of a failed request in the same step: recomputing it", rid
                )
                self.scheduler.requeue(req)  # it samples this token again (the same one, if seeded)
        sched.requests = [r for r in sched.requests if r.request_id not in tainted]
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
            step_failures=dict(self.step_failures),
            spec_decode=self.spec.stats() if self.spec is not None else None,
            running_lora_adapters=_adapter_names(self.scheduler.running),
            waiting_lora_adapters=_adapter_names(self.scheduler.waiting),
            max_loras=self.args.max_loras if self.loras is not None else 0,
            engine_threads=self.num_threads,
            kv_tiers=self.tiers.stats(len(self.kv.pool.cached)) if self.tiers is not None else None,
        )


def _adapter_names(requests) -> list[str]:
    """The distinct adapter names of these requests, in order of first appearance."""
    return list(dict.fromkeys(r.lora.name for r in requests if r.lora is not None))
