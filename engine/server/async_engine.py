"""The engine thread and its asyncio bridge.

The engine core is not thread-safe, so one dedicated thread owns it. The asyncio side
talks to it only through a thread-safe command queue (add / abort / stop), drained
between steps; the thread blocks on that queue when it has nothing to do (no
spinning). Each step's outputs are handed back to the event loop in one
``call_soon_threadsafe`` call that fans them out to per-request asyncio queues.

Tokenisation and chat templating happen on the HTTP side (the tokenizer is safe to
call from any thread), and ``prompt_token_ids`` are passed in, so a long prompt
never delays a step. The engine thread steps only the core (token ids in, token ids
out); detokenisation and stop strings run on the event loop when outputs are delivered
(``LLMEngine.process_output``), and a stop string sends an abort back to the core.

This is the in-thread mode (``kvmesh serve --engine-mode thread``). The server's default runs the
core in its own process instead (``ProcAsyncEngine``, engine/server/core_client.py) behind the
same interface: the HTTP handlers (api.py) use either.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.config import EngineArgs
from kvmesh.engine.core_messages import AbortRequests, AddRequest
from kvmesh.engine.core_proc import CoreLoop, EngineStepError  # noqa: F401 - EngineStepError: api's import
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.server.adapters import ServedAdapters
from kvmesh.engine.server.lora_metrics import LoraRequestsInfo
from kvmesh.engine.server.off_loop import off_loop

log = logging.getLogger("kvmesh.server.engine")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Utility:
    """A utility call queued for the engine thread; its answer resolves ``future`` on the event loop."""

    future: asyncio.Future
    name: str
    args: list


_STOP = object()  # the engine thread's last command


def _resolve(fut: asyncio.Future, result, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncEngine:
    """Runs an LLMEngine in its own thread; ``generate()`` is an async iterator of outputs."""

    def __init__(self, engine_args: EngineArgs, kv_publisher: Any = None):
        self.engine_args = engine_args
        self.kv_publisher = kv_publisher
        self.engine = None  # LLMEngine, created on the engine thread
        self.tokenizer = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.limits = None  # EngineLimits, once loaded: the checks that need the model
        self.model_dir = None  # the checkpoint (tokenizer) the model loaded from: structured outputs compile on it
        self.sampling_defaults: dict[str, Any] = {}  # the model's generation-config defaults
        # vllm:lora_requests_info, fed by each stats update (enable_lora only)
        self.lora_info = (
            LoraRequestsInfo(engine_args.max_loras) if engine_args.enable_lora else None
        )
        self.adapters = ServedAdapters()  # the loaded adapters requests may name
        self.stats = None  # EngineStats snapshot, refreshed by the engine thread after each step
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched only on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._core_loop: CoreLoop | None = None
        self.core_loop: type[CoreLoop] = (
            CoreLoop  # the loop body; a subclass may add utility calls (tests)
        )
        self.step_timing: dict[str, float] = {}  # StepTimer.snapshot(), refreshed with the stats
        self.on_dead: list = []  # callbacks (on the event loop) once the engine died after loading
        self.mode = "thread"

    @property
    def stats(self):
        return self._stats

    @stats.setter
    def stats(self, value) -> None:
        self._stats = value
        if self.lora_info is not None:
            self.lora_info.observe(value)

    @property
    def num_step_errors(self) -> int:
        return self._core_loop.num_step_errors if self._core_loop is not None else 0

    # -- lifecycle ------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def wait_loaded(self) -> None:
        while not self.loaded.is_set():
            if self.load_error is not None:
                raise EngineDeadError(f"engine failed to load: {self.load_error}")
            await asyncio.sleep(0.05)

    # -- asyncio side -----------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def unique_id(self, request_id: str) -> str:
        rid, i = request_id, 1
        while rid in self._streams:
            rid = f"{request_id}-{i}"
            i += 1
        return rid

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resumed_token_ids: list[int] | None = None,
    ) -> None:
        """Checks that need the model (thread-safe: reads immutable config only)."""
        self.limits.validate_prompt(prompt_token_ids)
        self.limits.validate_params(params)
        if resumed_token_ids is not None:
            self.limits.validate_resume(prompt_token_ids, resumed_token_ids, params)

    async def check_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar before it is admitted, in the request pool (milliseconds; at
        worst the compile deadline): a spec the backend refuses, or one that does not compile in
        time, is an InvalidParameter naming its field. The grammar stays cached for an engine core
        in this process (a core process compiles it again, off its step loop)."""
        if params.structured_outputs is None:
            return
        from kvmesh.engine.structured.backend import backend_for

        backend = backend_for(self.model_dir, self.limits.vocab_size)
        await off_loop(0, backend.check, params.structured_outputs, threshold=0)

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        resumed_token_ids: list[int] | None = None,
        lora_name: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """``resumed_token_ids``: a continuation's output so far (LLMEngine.add_request);
        ``lora_name``: the loaded adapter it runs with (None: the base); ``priority``: lower first
        (the priority scheduling policy)."""
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        # The text side (detokenizer, stop strings) lives on this thread, not the engine's.
        self.engine.create_state(prompt, params, request_id, prompt_token_ids, resumed_token_ids)
        self._submit(
            AddRequest(
                request_id,
                prompt_token_ids,
                params,
                cache_salt,
                resumed_token_ids=list(resumed_token_ids or ()),
                lora_name=lora_name,
                priority=priority,
            )
        )
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._submit(AbortRequests([request_id]))

    def abort_all(self) -> list[str]:
        """End every in-flight request (the drain timeout), keeping their streams: each gets the
        core's final "abort" output, so its response ends properly (a finish reason, then
        [DONE]) instead of being cut, and its KV blocks are freed. Returns the request ids."""
        rids = [rid for rid, stream in self._streams.items() if not stream.finished]
        if rids:
            self._submit(AbortRequests(rids))
        return rids

    def release(self, request_id: str) -> None:
        """Forget a finished request's stream."""
        self._streams.pop(request_id, None)

    def _submit(self, msg: AddRequest | AbortRequests) -> None:
        """A message for the core (core_messages.py), applied by the engine thread between steps."""
        self._commands.put(msg)

    def _count_frontend_failure(self) -> None:
        self.engine.core.step_failures["request"] += 1  # read by the engine thread's stats

    async def utility(self, name: str, *args):
        """Run a utility call on the core between steps (``core_loop``'s ``utility``):
        "reset_prefix_cache", "add_lora", "remove_lora", "list_loras"."""
        fut = asyncio.get_running_loop().create_future()
        self._commands.put(_Utility(fut, name, list(args)))
        return await fut

    def call_utility(self, name: str, *args, timeout: float = 60.0):
        """``utility`` from another thread (a test): blocks until the core answered."""
        return asyncio.run_coroutine_threadsafe(self.utility(name, *args), self._loop).result(
            timeout
        )

    def _fail_streams(self, exc: BaseException) -> None:
        """End every in-flight stream with ``exc`` (on the event loop)."""
        for stream in list(self._streams.values()):
            if not stream.finished:
                stream.finished = True
                stream.queue.put_nowait(exc)

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        # On the event loop: detokenise one step's core outputs and fan them out. A failure
        # here (or a core output carrying one) ends that request only.
        for rid, item in items:
            if not isinstance(item, BaseException) and item.error is not None:
                item = EngineStepError(f"the engine failed on this request: {item.error}")
            if isinstance(item, BaseException):
                self.engine.states.pop(rid, None)
            elif rid not in self.engine.states:
                continue  # ended already (an earlier failure, a stop string): the core's late outputs
            else:
                try:
                    item, by_stop_string = self.engine.process_output(item)
                except Exception as exc:  # noqa: BLE001 - e.g. the detokenizer: this request only
                    log.exception("request %s: processing its output failed", rid)
                    self.engine.states.pop(rid, None)
                    self._submit(AbortRequests([rid]))
                    self._count_frontend_failure()
                    item = EngineStepError(
                        f"processing this request's output failed: {type(exc).__name__}: {exc}"
                    )
                    by_stop_string = False
                if item is None:
                    continue
                if by_stop_string:
                    self._submit(AbortRequests([rid]))  # the core still runs it
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                stream.finished = True
            stream.queue.put_nowait(item)

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            from kvmesh.engine.llm_engine import LLMEngine

            self.engine = LLMEngine(self.engine_args)
            self._core_loop = self.core_loop(self.engine.core)
            self.tokenizer = self.engine.tokenizer
            self.limits = self.engine.core.limits
            self.model_dir = self.engine.core.model_dir
            self.max_model_len = self.engine.max_model_len
            self.vocab_size = self.engine.core.model_config.vocab_size
            self.sampling_defaults = dict(self.engine.sampling_defaults)
            self.stats = self.engine.core.stats()
            if self.engine_args.enable_lora:  # the adapters of --lora-modules
                self.adapters.sync(self.engine.core.list_loras())
            self._publish_events()
            self.loaded.set()
        except BaseException as exc:  # noqa: BLE001 - reported through /health and logs
            log.exception("engine failed to load")
            self.load_error = exc
            return
        engine = self.engine
        while True:
            # Block when idle; otherwise take whatever arrived since the last step.
            cmds = []
            while not cmds and not engine.has_unfinished_requests():
                try:
                    cmds.append(self._commands.get(timeout=1.0))
                except queue.Empty:  # idle: publish what the shared tier wrote behind the requests
                    self._publish_events()
            while True:
                try:
                    cmds.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if any(cmd is _STOP for cmd in cmds):
                self._stopped.set()
                return
            try:
                items = self._iteration(cmds)
            except Exception as exc:  # noqa: BLE001 - never let the engine thread die silently
                log.exception("engine iteration failed")
                items = [(rid, exc) for rid in list(engine.core.scheduler.requests)]
            if items:
                self._loop.call_soon_threadsafe(self._deliver, items)

    def _iteration(self, cmds: list) -> list[tuple[str, Any]]:
        """Apply commands, run one step, publish its KV events; returns what to deliver."""
        loop = self._core_loop
        items: list[tuple[str, Any]] = []
        for cmd in cmds:
            if isinstance(cmd, AddRequest):
                exc = loop.add(cmd)
                if exc is not None:
                    items.append((cmd.request_id, exc))
            elif isinstance(cmd, AbortRequests):
                loop.abort(cmd)
            elif isinstance(cmd, _Utility):
                try:
                    result = loop.utility(cmd.name, cmd.args)
                    self._loop.call_soon_threadsafe(_resolve, cmd.future, result, None)
                except Exception as exc:  # noqa: BLE001 - the caller's
                    self._loop.call_soon_threadsafe(_resolve, cmd.future, None, exc)
        # Token ids only: detokenisation happens on the event loop (_deliver).
        items.extend(loop.step())
        self._publish_events()
        self.stats = self.engine.core.stats()
        self.step_timing = loop.timer.snapshot()
        return items

    def _publish_events(self) -> None:
        if self.kv_publisher is None:
            return
        events = self.engine.core.take_kv_events()
        if events:
            self.kv_publisher.publish(events)

    # -- the generator ------------------------------------------------------------------
    async def stream_outputs(self, stream: RequestStream):
        """Yield RequestOutputs of one request until it finishes; aborts it if the consumer leaves."""
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if item.finished:
                    done = True
                    return
        finally:
            if done:
                self.release(stream.request_id)
            else:
                self.abort(stream.request_id)

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        if s is None:
            return {
                "kv_cache_usage": 0.0,
                "num_running": 0,
                "num_waiting": 0,
                "num_total_blocks": 0,
            }
        return {
            "kv_cache_usage": s.kv_cache_usage,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_total_blocks": s.num_total_blocks,
            "num_free_blocks": s.num_free_blocks,
        }
