"""The API process's side of the engine core process (vLLM V1's AsyncMPClient + output processor).

``ProcAsyncEngine`` has AsyncEngine's interface (api.py uses either): it spawns the core process
(engine/core_proc.py), sends adds and aborts over a ZMQ PUSH socket, and reads each step's outputs
on the event loop from a PULL socket, then detokenises them, applies stop strings and fans them out
to the request streams exactly as the in-thread mode does (``AsyncEngine._deliver``).

Validation that needs the engine's limits (the context length, the vocabulary) runs here on the
figures the core sends once when it is ready (``CoreReady``): no round trip per request.

A dead core process is noticed at once: its process sentinel is watched by the event loop. Every
in-flight stream then ends with an error, ``alive`` turns false (``/health`` 503, ``/ready`` 503),
and the ``on_dead`` callbacks run (``kvmesh serve`` exits non-zero so the pod restarts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.config import EngineArgs
from kvmesh.engine.core_messages import AbortRequests, AddRequest
from kvmesh.engine.core_proc import (
    ABORT,
    ADD,
    LOAD_FAILED,
    OUTPUTS,
    READY,
    SHUTDOWN,
    UTILITY,
    UTILITY_RESULT,
    CoreProcConfig,
    CoreReady,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    failure_exception,
    utility_exception,
)
from kvmesh.engine.llm_engine import TextEngine
from kvmesh.engine.model_limits import EngineLimits
from kvmesh.engine.server.async_engine import AsyncEngine, EngineDeadError
from kvmesh.engine.threads import ThreadPlan, core_environment

log = logging.getLogger("kvmesh.server.engine")


class FrontendEngine(TextEngine):
    """The text side (tokenizer, per-request detokenizer and stop strings) of a core that runs in
    another process; ``limits`` are the figures it sent when it was ready."""

    def __init__(self, args: EngineArgs, model_dir: str, ready: CoreReady):
        super().__init__(model_dir, args.generation_config)
        self.limits = EngineLimits(ready.max_model_len, ready.vocab_size)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len


_EVENT_KINDS = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def events_from_wire(wire: list[list[Any]]) -> list:
    return [_EVENT_KINDS[w[0]](*w[1:]) for w in wire]


class CoreProcess:
    """The engine core's process: a fresh interpreter (not multiprocessing: nothing of this process's
    ``__main__`` or ``sys.path`` is replayed in it; ``-P``: not even the working directory, which in
    a checkout would shadow the stdlib's ``operator`` and kvmesh's installed copy), its config
    pickled on stdin. ``sentinel`` is the
    read end of a pipe whose write end only the child holds: it turns readable (EOF) the moment the
    child exits, however it exits."""

    def __init__(self, cfg: CoreProcConfig):
        read_fd, write_fd = os.pipe()
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-P", "-c", "from kvmesh.engine.core_proc import main; main()"],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                close_fds=True,
                env=core_environment(cfg.threads),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.sentinel = read_fd
        self.pid = self._popen.pid
        try:
            self._popen.stdin.write(pickle.dumps(cfg))
            self._popen.stdin.close()
        except OSError:  # it died at once: the sentinel says so
            pass

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class ProcAsyncEngine(AsyncEngine):
    """AsyncEngine with the core in its own process (the server's default)."""

    def __init__(
        self,
        engine_args: EngineArgs,
        kv_publisher: Any = None,
        threads: ThreadPlan | None = None,
        log_level: str = "info",
    ):
        super().__init__(engine_args, kv_publisher)
        self.mode = "process"
        self.threads = threads
        self.log_level = log_level
        self.process: CoreProcess | None = None
        self.dead = threading.Event()  # the core died after it was loaded
        self.exit_code: int | None = None
        self._closing = False
        self._ipc_dir: str | None = None
        self._zctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._in = None  # PUSH, used on the event loop only
        self._out = None  # PULL (asyncio)
        self._tasks: list[asyncio.Task] = []
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._step_decoder = msgspec.msgpack.Decoder(StepOutputs)
        self._frontend_failures = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ipc_dir = tempfile.mkdtemp(prefix="kvmesh-core-")
        in_addr, out_addr = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        self._zctx = zmq.Context(io_threads=1)
        self._in = self._zctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._actx = zmq.asyncio.Context(io_threads=1)
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        cfg = CoreProcConfig(
            self.engine_args,
            in_addr,
            out_addr,
            os.getpid(),
            self.threads,
            self.log_level,
            self.core_loop,
        )
        self._tasks.append(loop.create_task(self._startup(cfg)))

    def _spawn(self, cfg: CoreProcConfig) -> CoreProcess:
        return CoreProcess(cfg)

    async def _startup(self, cfg: CoreProcConfig) -> None:
        loop = self._loop
        try:
            self.process = self._spawn(cfg)
            loop.add_reader(self.process.sentinel, self._on_process_exit)
            log.info("engine core process %d started", self.process.pid)
            kind, payload = await self._out.recv_multipart()
            if kind == LOAD_FAILED:
                raise EngineDeadError(
                    f"the engine core failed to load: {msgspec.msgpack.decode(payload)}"
                )
            if kind != READY:
                raise EngineDeadError(f"the engine core sent {kind!r} before it was ready")
            ready = msgspec.msgpack.decode(payload, type=CoreReady)
            # The text side: the tokenizer loads off the loop (other routes keep answering).
            self.engine = await asyncio.to_thread(
                FrontendEngine, self.engine_args, ready.model_dir, ready
            )
            self.tokenizer = self.engine.tokenizer
            self.limits = self.engine.limits
            self.model_dir = ready.model_dir
            self.max_model_len = ready.max_model_len
            self.vocab_size = ready.vocab_size
            self.sampling_defaults = dict(self.engine.sampling_defaults)
            self.stats = ready.stats
            self.adapters.sync(ready.loras)
            self._tasks.append(loop.create_task(self._output_loop()))
            self.loaded.set()
            log.info(
                "engine core process %d ready%s",
                ready.pid,
                f" ({ready.threads})" if ready.threads else "",
            )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported through /health, the logs and the exit code
            log.error("engine failed to load: %s", exc)
            self.load_error = exc
            self._kill()

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the core down (the server is stopping): ask, then wait, then kill."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        proc = self.process
        if proc is not None:
            try:
                self._loop.remove_reader(proc.sentinel)
            except Exception:  # noqa: BLE001 - the loop may be closing
                pass
            if proc.is_alive() and self.loaded.is_set():
                try:
                    self._in.send_multipart([SHUTDOWN, b""], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                proc.join(timeout)
            self._kill()
            proc.close()
        self._close_sockets()

    def _kill(self) -> None:
        proc = self.process
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(5)

    def _close_sockets(self) -> None:
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close(0)
        for ctx in (self._zctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._in = self._out = self._zctx = self._actx = None
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    @property
    def alive(self) -> bool:
        return self.process is not None and not self.dead.is_set() and self.process.is_alive()

    def _on_process_exit(self) -> None:
        """The core process ended (its sentinel fired, on the event loop)."""
        proc = self.process
        self._loop.remove_reader(proc.sentinel)
        proc.join(5)
        self.exit_code = proc.exitcode
        if self._closing:
            return
        if not self.loaded.is_set():
            if self.load_error is None:
                self.load_error = EngineDeadError(
                    f"the engine core process exited with code {proc.exitcode} while loading"
                )
                log.error("%s", self.load_error)
            for task in self._tasks:
                task.cancel()
            return
        self.dead.set()
        err = EngineDeadError(
            f"the engine core process died (exit code {proc.exitcode}); this replica is restarting"
        )
        log.error("%s: ending %d in-flight requests", err, len(self._streams))
        self._fail_streams(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        for callback in list(self.on_dead):
            try:
                callback()
            except Exception:  # noqa: BLE001
                log.exception("on_dead callback failed")

    # -- to the core --------------------------------------------------------------------------------
    def _submit(self, msg: AddRequest | AbortRequests) -> None:
        frames = [ADD if isinstance(msg, AddRequest) else ABORT, self._encoder.encode(msg)]
        if self._in is None or self.dead.is_set():
            if isinstance(msg, AddRequest):
                raise EngineDeadError("the engine core is not running")
            return
        self._in.send_multipart(frames, copy=False)

    def _count_frontend_failure(self) -> None:
        self._frontend_failures += 1
        if self.stats is not None:
            self.stats.step_failures["request"] = self.stats.step_failures.get("request", 0) + 1

    async def utility(self, name: str, *args):
        if self._in is None or not self.alive:
            raise EngineDeadError("the engine core is not running")
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        self._in.send_multipart(
            [UTILITY, self._encoder.encode(UtilityCall(call_id, name, list(args)))]
        )
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    # -- from the core ------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        sock = self._out
        decode = self._step_decoder.decode
        while True:
            kind, payload = await sock.recv_multipart(copy=False)
            if kind.bytes == OUTPUTS:
                msg = decode(payload.buffer)
                self._on_step(msg)
            elif kind.bytes == UTILITY_RESULT:
                res = msgspec.msgpack.decode(payload.buffer, type=UtilityResult)
                fut = self._calls.get(res.call_id)
                if fut is not None and not fut.done():
                    if res.ok:
                        fut.set_result(res.value)
                    else:
                        fut.set_exception(utility_exception(res))
            else:
                log.warning("unexpected message %r from the engine core", kind.bytes)
            # A message already queued makes the await above return without yielding: let the HTTP
            # side run between messages, or a core that runs ahead would starve it.
            await asyncio.sleep(0)

    def _on_step(self, msg: StepOutputs) -> None:
        if msg.kv_events and self.kv_publisher is not None:
            # Published before the outputs are delivered, as the in-thread mode does.
            self.kv_publisher.publish(events_from_wire(msg.kv_events))
        stats = msg.stats
        if self._frontend_failures:
            stats.step_failures["request"] = (
                stats.step_failures.get("request", 0) + self._frontend_failures
            )
        self.stats = stats
        self.step_timing = msg.timing
        items: list[tuple[str, Any]] = [(f.request_id, failure_exception(f)) for f in msg.failures]
        items.extend((o.request_id, o) for o in msg.outputs)
        if items:
            try:
                self._deliver(items)
            except Exception:  # noqa: BLE001 - never stop reading the core's outputs
                log.exception("delivering a step's outputs failed")
