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
from kvmesh.engine.sampling_params import SamplingParams

log = logging.getLogger("kvmesh.server.engine")


class EngineDeadError(RuntimeError):
    pass


class EngineStepError(RuntimeError):
    """The engine step failed on this request (or, as a last resort, on the whole batch); the
    request was ended and its client gets a 500 (or a final SSE error event)."""


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    arrival: float = field(default_factory=time.monotonic)


class AsyncEngine:
    """Runs an LLMEngine in its own thread; ``generate()`` is an async iterator of outputs."""

    def __init__(self, engine_args: EngineArgs, kv_publisher: Any = None):
        self.engine_args = engine_args
        self.kv_publisher = kv_publisher
        self.engine = None  # LLMEngine, created on the engine thread
        self.tokenizer = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.sampling_defaults: dict[str, Any] = {}  # the model's generation-config defaults
        self.stats = None  # EngineStats snapshot, refreshed by the engine thread after each step
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched only on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.num_step_errors = 0

    # -- lifecycle ------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(("stop",))
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

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Checks that need the model (thread-safe: reads immutable config only)."""
        self.engine.core.validate_prompt(prompt_token_ids)
        self.engine.core.validate_params(params)

    def add(self, request_id: str, prompt: str | list[int], prompt_token_ids: list[int],
            params: SamplingParams, cache_salt: str | None = None) -> RequestStream:
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        # The text side (detokenizer, stop strings) lives on this thread, not the engine's.
        self.engine.create_state(prompt, params, request_id, prompt_token_ids)
        self._commands.put(("add", request_id, prompt, prompt_token_ids, params, cache_salt))
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._commands.put(("abort", [request_id]))

    def abort_all(self) -> list[str]:
        """End every in-flight request (the drain timeout), keeping their streams: each gets the
        core's final "abort" output, so its response ends properly (a finish reason, then
        [DONE]) instead of being cut, and its KV blocks are freed. Returns the request ids."""
        rids = [rid for rid, stream in self._streams.items() if not stream.finished]
        if rids:
            self._commands.put(("abort", rids))
        return rids

    def release(self, request_id: str) -> None:
        """Forget a finished request's stream."""
        self._streams.pop(request_id, None)

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
                    self._commands.put(("abort", [rid]))
                    self.engine.core.step_failures["request"] += 1  # read by the engine thread's stats
                    item = EngineStepError(f"processing this request's output failed: {type(exc).__name__}: {exc}")
                    by_stop_string = False
                if item is None:
                    continue
                if by_stop_string:
                    self._commands.put(("abort", [rid]))  # the core still runs it
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
            self.tokenizer = self.engine.tokenizer
            self.max_model_len = self.engine.max_model_len
            self.vocab_size = self.engine.core.model_config.vocab_size
            self.sampling_defaults = dict(self.engine.sampling_defaults)
            self.stats = self.engine.core.stats()
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
            if not engine.has_unfinished_requests():
                cmds.append(self._commands.get())
            while True:
                try:
                    cmds.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if any(cmd[0] == "stop" for cmd in cmds):
                self._stopped.set()
                return
            try:
                items = self._iteration(cmds)
            except Exception as exc:  # noqa: BLE001 - never let the engine thread die silently
                items = self._fail_all(exc)
            if items:
                self._loop.call_soon_threadsafe(self._deliver, items)

    def _iteration(self, cmds: list[tuple]) -> list[tuple[str, Any]]:
        """Apply commands, run one step, publish its KV events; returns what to deliver."""
        engine = self.engine
        items: list[tuple[str, Any]] = []
        for cmd in cmds:
            if cmd[0] == "add":
                _, rid, prompt, ids, params, salt = cmd
                try:
                    engine.core.add_request(rid, ids, params, salt)
                except Exception as exc:  # noqa: BLE001 - answered to that request only
                    items.append((rid, exc))
            elif cmd[0] == "abort":
                engine.core.abort_requests(cmd[1])
        if engine.has_unfinished_requests():
            # Token ids only: detokenisation happens on the event loop (_deliver).
            items.extend((o.request_id, o) for o in engine.core.step())
        self._publish_events()
        self.stats = engine.core.stats()
        return items

    def _fail_all(self, exc: Exception) -> list[tuple[str, Any]]:
        """The last resort, when a failure escapes the core's own per-request isolation (a fault
        outside the model run: scheduling, bookkeeping): every in-flight request is ended, and the
        prefix cache, which that step may have left inconsistent, is dropped."""
        self.num_step_errors += 1
        log.exception("engine step failed outside the model run; aborting all in-flight requests")
        engine = self.engine
        rids = list(engine.core.scheduler.requests)
        engine.core.step_failures["batch"] += 1
        try:
            engine.core.abort_requests(rids)
            engine.core.step()  # flush the abort outputs
            if not engine.core.reset_prefix_cache():
                log.warning("the prefix cache could not be reset after a failed step")
        except Exception:  # noqa: BLE001
            log.exception("cleanup after a failed step failed too")
        try:
            self._publish_events()
            self.stats = engine.core.stats()
        except Exception:  # noqa: BLE001
            log.exception("KV events / stats after a failed step")
        err = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
        return [(rid, err) for rid in rids]

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
            return {"kv_cache_usage": 0.0, "num_running": 0, "num_waiting": 0, "num_total_blocks": 0}
        return {"kv_cache_usage": s.kv_cache_usage, "num_running": s.num_running,
                "num_waiting": s.num_waiting, "num_total_blocks": s.num_total_blocks,
                "num_free_blocks": s.num_free_blocks}

