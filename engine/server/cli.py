"""`kvmesh serve`: one engine replica (the engine container of each pod).

Flags follow docs/cli.md (the operator renders pods with exactly these); this module
adds a few of its own (--max-body-bytes, --device, --seed, --log-level).

Signals: uvicorn's own handlers are replaced. The first SIGTERM (or SIGINT) starts a
graceful drain: /ready turns 503, new requests get 503, in-flight requests finish for
up to --drain-timeout seconds; those still running then are aborted (each response ends
with finish_reason "abort" and [DONE], and frees its KV blocks), then the server stops
and the process exits 0. A second signal stops at once.

The engine core runs in its own process by default (``--engine-mode process``; engine/core_proc.py):
if it dies, every in-flight stream ends with an error, /health turns 503 and this process exits 3.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

from kvmesh.common.logging_setup import setup_logging
from kvmesh.engine.cli_args import add_engine_arguments, engine_args_from
from kvmesh.engine.lora.cli_args import add_lora_arguments, lora_engine_args
from kvmesh.engine.server.tool_parsers import TOOL_PARSERS

log = logging.getLogger("kvmesh.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_lora_arguments(parser)
    parser.add_argument("--host", default="0.0.0.0", help="HTTP listen address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="waiting-queue bound; over it requests get 429",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="largest accepted request body; larger ones get 413",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVMESH_API_KEY"),
        help="required on every /v1 route when set (env KVMESH_API_KEY)",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="ZMQ PUB bind address for KV events, e.g. tcp://*:5557 (off by default)",
    )
    parser.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER bind address for KV-event replay, e.g. tcp://*:5558",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: how long in-flight requests may finish (seconds)",
    )
    parser.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", "info"))
    parser.add_argument(
        "--engine-mode",
        choices=["process", "thread"],
        default=os.environ.get("KVMESH_ENGINE_MODE", "process"),
        help="process: the engine core (scheduler + model) runs in its own process, the "
        "API process keeps HTTP, tokenisation and streaming (the default); thread: "
        "the core runs in a thread of the API process (env KVMESH_ENGINE_MODE)",
    )
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=None,
        help="torch/OpenMP threads of the engine core (default: OMP_NUM_THREADS if set, "
        "else every CPU not left to the frontend); process mode",
    )
    parser.add_argument(
        "--frontend-cores",
        default="auto",
        metavar="K",
        help="CPUs left to the API process; the core is pinned to the others (auto: 1 "
        "on 4 or more CPUs, 0 below: shared); process mode",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides whether to call tools, and '
        "--tool-call-parser reads its calls (without it, auto is a 400, as in vLLM)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format a model writes its tool calls in: hermes (JSON in tool_call tags; Hermes, "
        "Qwen 2.5) or llama3_json (Llama 3.1/3.2 JSON); also the default tool prompt's "
        "format for a chat template without tool support",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve /metrics (only) on this port, so a NetworkPolicy can admit "
        "scrapers there without exposing the API",
    )


def build_state(args: argparse.Namespace):
    from kvmesh.engine.server.api import ServerConfig, ServerState
    from kvmesh.engine.server.async_engine import AsyncEngine

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    served_name = args.served_model_name or args.model
    engine_args = engine_args_from(
        args,
        server=True,
        enable_kv_events=bool(args.kv_events_endpoint),
        **lora_engine_args(args, served_name),
    )
    engine_args.validate()
    publisher = None
    if args.kv_events_endpoint:
        from kvmesh.common.kv_events import KVEventPublisher

        publisher = KVEventPublisher(args.kv_events_endpoint, args.kv_events_replay_endpoint)
        log.info("KV events: PUB %s, replay %s", publisher.endpoint, publisher.replay_endpoint)
    if args.engine_mode == "process":
        from kvmesh.engine.server.core_client import ProcAsyncEngine
        from kvmesh.engine.threads import plan_threads

        threads = plan_threads(args.omp_threads, args.frontend_cores)
        engine = ProcAsyncEngine(engine_args, publisher, threads, args.log_level)
    else:
        engine = AsyncEngine(engine_args, publisher)
    config = ServerConfig(
        served_model_name=served_name,
        api_key=args.api_key or None,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        allow_runtime_lora_updating=runtime_lora_updating(),
    )
    return ServerState(engine, config)


def runtime_lora_updating() -> bool:
    """vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def _make_server(app, host: str, port: int, log_level: str):
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # ours are installed by serve(); uvicorn's would cut streams
            yield

        def install_signal_handlers(self) -> None:  # older uvicorn
            pass

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=5,
        access_log=False,
    )
    return _Server(config)


DRAIN_ABORT_GRACE_S = (
    2.0  # after the drain timeout: the aborted responses get this long to be written
)


async def drain_then_exit(state, server, drain_timeout: float) -> bool:
    """The drain after SIGTERM (``state.begin_drain()`` already refuses new requests): wait up to
    ``drain_timeout`` for the in-flight requests; then abort the rest in the engine, so each
    response still ends properly (finish reason "abort" and [DONE], a 200 with what was
    generated) and frees its KV blocks, and give those responses a moment to be written.
    Then the server exits. Returns whether everything finished in time."""
    drained = await state.wait_drained(drain_timeout)
    if drained:
        log.info("drained: all in-flight requests finished")
    else:
        aborted = state.engine.abort_all()
        log.warning(
            "drain timeout (%.0fs): %d requests still in flight are cut (aborted)",
            drain_timeout,
            len(aborted),
        )
        finished = await state.wait_drained(DRAIN_ABORT_GRACE_S)
        snap = state.engine.snapshot()
        log.info(
            "after the drain timeout: %s; kv cache usage %.1f%%",
            "every response ended"
            if finished
            else f"{state.engine.num_in_flight} requests still in flight",
            100 * snap["kv_cache_usage"],
        )
    server.should_exit = True
    return drained


async def serve(state, host: str, port: int, drain_timeout: float, log_level: str = "info") -> int:
    from kvmesh.engine.server.api import build_app

    app = build_app(state)
    server = _make_server(app, host, port, log_level)
    loop = asyncio.get_running_loop()
    rc = 0

    async def drain() -> None:
        await drain_then_exit(state, server, drain_timeout)

    def on_signal(sig: signal.Signals) -> None:
        if state.draining:
            log.warning("second %s: stopping now", sig.name)
            server.force_exit = True
            server.should_exit = True
            return
        log.info("%s received: draining (up to %.0fs)", sig.name, drain_timeout)
        state.begin_drain()
        loop.create_task(drain())

    async def watch_load() -> None:
        nonlocal rc
        try:
            await state.engine.wait_loaded()
            log.info("model %s loaded; ready", state.config.served_model_name)
        except Exception as exc:  # noqa: BLE001
            log.error("%s", exc)
            rc = 1
            server.should_exit = True

    def on_engine_dead() -> None:
        # The core process died: its streams ended with an error already; exit non-zero so the
        # pod restarts (uvicorn lets those responses finish writing first).
        nonlocal rc
        log.error("the engine core died: exiting so that this replica restarts")
        rc = 3
        server.should_exit = True

    state.engine.on_dead.append(on_engine_dead)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    watcher = loop.create_task(watch_load())
    try:
        await server.serve()
    finally:
        watcher.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if state.engine.kv_publisher is not None:
            state.engine.kv_publisher.close()
    if not server.started and rc == 0:
        rc = 1  # could not bind, or startup failed
    return rc


def run(args: argparse.Namespace) -> int:
    setup_logging("text", args.log_level)
    try:
        state = build_state(args)
    except (
        ValueError,
        FileNotFoundError,
        OSError,
    ) as exc:  # incl. a bad --omp-threads/--frontend-cores
        log.error("cannot start: %s", exc)
        return 2
    if args.metrics_port is not None:
        from kvmesh.common.metrics_port import serve_metrics_only

        serve_metrics_only(state.metrics.registry, args.host, args.metrics_port)
    return asyncio.run(
        serve(state, args.host, args.port, args.drain_timeout, args.log_level.lower())
    )
