"""The engine core in its own process (vLLM V1's EngineCoreProc), and the step loop both modes share.

The API server process (engine/server/core_client.py) spawns this process and binds two ZMQ
sockets on ipc:// paths in a private temporary folder; the core connects to both:

    API process  --PUSH-->  input   --PULL-->  core process     add / abort / utility / shutdown
    API process  <--PULL--  output  <--PUSH--  core process     ready, per-step outputs, utility results

Every message is two frames, ``[kind, msgspec-msgpack payload]`` (the structs below). The core's
loop never waits on the API process: while it has work it drains the input socket without
blocking between steps; only when idle does it block on it (a one-second poll, so it notices
its parent has gone and exits).

Per step the core sends one ``StepOutputs``: each request's new token ids, logprobs and finish
reason (``EngineCoreOutput``), requests refused or failed outside the model run (``Failure``),
the engine stats, the step-phase timings, and the step's KV events as their wire lists (the API
process publishes them on its ``KVEventPublisher``, so the events contract and its replay are
unchanged). Text never crosses: tokenisation, detokenisation and stop strings are the API
process's.

``CoreLoop`` is the body of one iteration (apply adds/aborts, one step, the last-resort failure
path) and is shared with the in-thread mode (engine/server/async_engine.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.engine.config import EngineArgs
from kvmesh.engine.core_messages import AbortRequests, AddRequest
from kvmesh.engine.cpu_contention import ContentionMonitor, monitor_for
from kvmesh.engine.engine_core import EngineCoreOutput, EngineStats
from kvmesh.engine.lora.request import LoRAError, LoRARequest
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.step_timing import StepTimer
from kvmesh.engine.threads import ThreadPlan, cgroup_cpu_limit

log = logging.getLogger("kvmesh.engine.core")

# frame kinds
ADD, ABORT, UTILITY, SHUTDOWN = b"A", b"X", b"U", b"S"  # in
READY, LOAD_FAILED, OUTPUTS, UTILITY_RESULT = b"R", b"F", b"O", b"u"  # out


# -- messages ------------------------------------------------------------------------------------
class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    name: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    ok: bool
    value: Any = None
    error: str = ""
    error_type: str = ""  # the exception's class name (LoRAError: re-raised as one by the caller)


class Failure(msgspec.Struct, array_like=True):
    """A request the core refused (``param`` set: a validation error naming the field) or failed
    outside the model run (the last resort: the whole step lost)."""

    request_id: str
    message: str
    param: str | None = None
    error_type: str = ""  # the exception's class name (LoRAError: re-raised as one by the caller)


class StepOutputs(msgspec.Struct, array_like=True):
    outputs: list[EngineCoreOutput]
    failures: list[Failure]
    stats: EngineStats
    timing: dict[str, float]
    kv_events: list[Any] = []  # each event's wire list (kvmesh.common.kv_events: to_wire)


class CoreReady(msgspec.Struct):
    pid: int
    model_dir: str  # resolved (a built-in model converted) by the core: the API process loads its tokenizer
    max_model_len: int
    vocab_size: int
    num_blocks: int
    eos_token_ids: list[int]
    stats: EngineStats
    threads: str
    loras: list[dict[str, Any]] = []  # list_loras(): the adapters loaded at start


@dataclass
class CoreProcConfig:
    engine_args: EngineArgs
    input_address: str
    output_address: str
    parent_pid: int
    threads: ThreadPlan | None = None
    log_level: str = "info"
    core_loop: type[CoreLoop] | None = (
        None  # a CoreLoop subclass (tests add utility calls); None: CoreLoop
    )


class EngineStepError(RuntimeError):
    """The engine step failed on this request (or, as a last resort, on the whole batch); the
    request was ended and its client gets a 500 (or a final SSE error event)."""


# -- the loop body, both modes ----------------------------------------------------------------------
class CoreLoop:
    """Adds, aborts and one step of an EngineCore, with the last-resort failure path; items are
    ``(request_id, EngineCoreOutput | exception)``."""

    def __init__(self, core, threads: ThreadPlan | None = None):
        self.core = core
        self.timer = StepTimer.install(core)
        self.num_step_errors = 0
        self.thread_monitor = thread_monitor(core, threads)

    def add(self, msg: AddRequest) -> Exception | None:
        try:
            self.core.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                msg.cache_salt,
                msg.arrival_time,
                msg.resumed_token_ids or None,
                lora_name=msg.lora_name,
                priority=msg.priority,
            )
        except Exception as exc:  # noqa: BLE001 - answered to that request only
            return exc
        return None

    def abort(self, msg: AbortRequests) -> None:
        self.core.abort_requests(msg.request_ids)

    def step(self) -> list[tuple[str, Any]]:
        if not self.core.has_unfinished_requests():
            return []
        self.timer.begin()
        try:
            items = [(o.request_id, o) for o in self.core.step()]
        except Exception as exc:  # noqa: BLE001 - never let the loop die silently
            items = self._fail_all(exc)
        self.timer.end()
        if self.thread_monitor is not None:
            self.thread_monitor.maybe_adapt()
        return items

    def _fail_all(self, exc: Exception) -> list[tuple[str, Any]]:
        """The last resort, when a failure escapes the core's own per-request isolation (a fault
        outside the model run: scheduling, bookkeeping): every in-flight request is ended, and the
        prefix cache, which that step may have left inconsistent, is dropped."""
        self.num_step_errors += 1
        log.exception("engine step failed outside the model run; aborting all in-flight requests")
        core = self.core
        rids = list(core.scheduler.requests)
        core.step_failures["batch"] += 1
        try:
            core.discard_in_flight()  # async scheduling: steps in flight are not applied
            core.abort_requests(rids)
            core.step()  # flush the abort outputs
            if not core.reset_prefix_cache():
                log.warning("the prefix cache could not be reset after a failed step")
        except Exception:  # noqa: BLE001
            log.exception("cleanup after a failed step failed too")
        err = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
        return [(rid, err) for rid in rids]

    def utility(self, name: str, args: list[Any]) -> Any:
        """A call on the core between steps, by name (a subclass may know more of them)."""
        if name == "reset_prefix_cache":
            return self.core.reset_prefix_cache()
        if name == "add_lora":
            req = args[0]
            return self.core.add_lora(req if isinstance(req, LoRARequest) else LoRARequest(*req))
        if name == "remove_lora":
            return self.core.remove_lora(args[0])
        if name == "list_loras":
            return self.core.list_loras()
        raise ValueError(f"unknown utility call {name!r}")


def thread_monitor(core, plan: ThreadPlan | None) -> ContentionMonitor | None:
    """The CPU engine's thread monitor (--adapt-threads). A plan: the core process, which leaves
    its API process's CPU time out of the others' when they share CPUs; none: the in-thread mode
    (the API server is this process)."""
    if core.device.type != "cpu":
        return None
    if plan is not None:
        shared = plan.frontend_cpus is None
        planned, pinned, quota = plan.core_threads, plan.pinned, plan.cpu_quota
        companions = (os.getppid(),) if shared else ()
    else:
        planned, companions, quota = core.num_threads, (), cgroup_cpu_limit()
        pinned = os.environ.get("OMP_NUM_THREADS", "").isdigit()
    return monitor_for(
        core.args.adapt_threads, planned, pinned, core.set_threads, companions, quota
    )


# -- the core process ------------------------------------------------------------------------------
_encoder = msgspec.msgpack.Encoder()


def _send(sock, kind: bytes, msg: Any) -> None:
    sock.send_multipart([kind, _encoder.encode(msg)], copy=False)


def main() -> None:
    """The core process's entry point: ``python -c "from kvmesh.engine.core_proc import main; main()"``,
    its CoreProcConfig pickled on stdin (engine/server/core_client.py spawns it)."""
    import pickle

    cfg = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    run_engine_core(cfg)


def run_engine_core(cfg: CoreProcConfig) -> None:
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the process group: the API process drains
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s"
    )
    sys.exit(EngineCoreProc(cfg).run())


class EngineCoreProc:
    def __init__(self, cfg: CoreProcConfig):
        import zmq

        self.cfg = cfg
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(cfg.input_address)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(cfg.output_address)
        self.loop: CoreLoop | None = None
        self._add_decoder = msgspec.msgpack.Decoder(AddRequest)
        self._abort_decoder = msgspec.msgpack.Decoder(AbortRequests)
        self._utility_decoder = msgspec.msgpack.Decoder(UtilityCall)
        self._failures: list[Failure] = []
        self._shutdown = False
        self._parent_checked = time.monotonic()

    def run(self) -> int:
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - reported to the API process
            log.exception("engine core failed to load")
            _send(self.output, LOAD_FAILED, f"{type(exc).__name__}: {exc}")
            self._close()
            return 1
        try:
            self._busy_loop()
        except BaseException:  # noqa: BLE001
            log.exception("engine core loop died")
            self._close()
            return 1
        self._close()
        return 0

    def _close(self) -> None:
        self.input.close(0)
        self.output.close()
        self.ctx.term()

    def _load(self) -> None:
        from kvmesh.engine.engine_core import EngineCore

        cfg = self.cfg
        threads = ""
        if cfg.threads is not None:
            from kvmesh.engine.threads import apply_in_core

            apply_in_core(cfg.threads)
            threads = cfg.threads.describe()
            log.info("%s", threads)
        core = EngineCore(cfg.engine_args)
        from kvmesh.common.tokenizer import KVMeshTokenizer

        core.eos_token_ids |= KVMeshTokenizer(core.model_dir).eos_token_ids  # as LLMEngine does
        self.loop = (cfg.core_loop or CoreLoop)(core, cfg.threads)
        _send(
            self.output,
            READY,
            CoreReady(
                pid=os.getpid(),
                model_dir=str(core.model_dir),
                max_model_len=core.max_model_len,
                vocab_size=core.model_config.vocab_size,
                num_blocks=core.num_blocks,
                eos_token_ids=sorted(core.eos_token_ids),
                stats=core.stats(),
                threads=threads,
                loras=core.list_loras() if cfg.engine_args.enable_lora else [],
            ),
        )

    def _parent_alive(self) -> bool:
        return os.getppid() == self.cfg.parent_pid

    def _busy_loop(self) -> None:
        import zmq

        loop, core, sock = self.loop, self.loop.core, self.input
        while not self._shutdown:
            if not core.has_unfinished_requests():
                # Idle: block on the input (waking once a second to see that the parent lives).
                if not sock.poll(1000):
                    if not self._parent_alive():
                        log.warning("the API process is gone; the engine core exits")
                        return
                    if core.has_pending_kv_events():  # the shared tier wrote behind the requests
                        self._send_step([])
                    continue
            while True:  # everything that arrived since the last step, without waiting
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
            if self._shutdown:
                return
            stepped = core.has_unfinished_requests()
            items = loop.step() if stepped else []
            if stepped or self._failures:
                self._send_step(items)
            now = time.monotonic()
            if now - self._parent_checked > 1.0:
                self._parent_checked = now
                if not self._parent_alive():
                    log.warning("the API process is gone; the engine core exits")
                    return

    def _handle(self, frames) -> None:
        kind, payload = frames[0].bytes, frames[1].buffer if len(frames) > 1 else b""
        if kind == ADD:
            msg = self._add_decoder.decode(payload)
            exc = self.loop.add(msg)
            if exc is not None:
                self._failures.append(
                    Failure(
                        msg.request_id, str(exc), getattr(exc, "param", None), type(exc).__name__
                    )
                )
        elif kind == ABORT:
            self.loop.abort(self._abort_decoder.decode(payload))
        elif kind == UTILITY:
            call = self._utility_decoder.decode(payload)
            try:
                result = UtilityResult(call.call_id, True, self.loop.utility(call.name, call.args))
                data = _encoder.encode(result)
            except Exception as exc:  # noqa: BLE001 - answered to the caller
                log.warning("utility call %s failed: %s: %s", call.name, type(exc).__name__, exc)
                data = _encoder.encode(
                    UtilityResult(call.call_id, False, None, str(exc), type(exc).__name__)
                )
            self.output.send_multipart([UTILITY_RESULT, data], copy=False)
            self._send_step([])  # the stats and KV events the call may have changed
        elif kind == SHUTDOWN:
            self._shutdown = True
        else:
            log.warning("unknown message kind %r", kind)

    def _send_step(self, items: list[tuple[str, Any]]) -> None:
        t0 = time.perf_counter()
        loop = self.loop
        outputs, failures = [], self._failures
        self._failures = []
        for rid, item in items:
            if isinstance(item, BaseException):
                failures.append(Failure(rid, str(item), getattr(item, "param", None)))
            else:
                outputs.append(item)
        events = loop.core.take_kv_events()
        msg = StepOutputs(
            outputs,
            failures,
            loop.core.stats(),
            loop.timer.snapshot(),
            [e.to_wire() for e in events] if events else [],
        )
        _send(self.output, OUTPUTS, msg)
        # The send belongs to the step it ends (its "output" phase).
        loop.timer.totals["output"] += time.perf_counter() - t0
        if loop.timer._decode and items:
            loop.timer.totals["decode_output"] += time.perf_counter() - t0


def utility_exception(res: UtilityResult) -> Exception:
    """The caller's exception for a failed utility call: an adapter's refusal stays a LoRAError."""
    if res.error_type == "LoRAError":
        return LoRAError(res.error)
    return RuntimeError(f"{res.error_type}: {res.error}" if res.error_type else res.error)


def failure_exception(f: Failure) -> Exception:
    """The API side's exception for a Failure: a 400 naming the field, or an engine error."""
    if f.param is not None:
        return InvalidParameter(f.param, f.message)
    if f.error_type == "LoRAError":  # its adapter was unloaded after the request named it
        return LoRAError(f.message)
    return EngineStepError(f.message)
