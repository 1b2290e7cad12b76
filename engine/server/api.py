"""The engine server's FastAPI app (vLLM's ``api_server.py``): routes only. A route hands its request
to a handler: ``serving_completion``, ``serving_chat``, ``serving_tokenization`` (on the shared
``serving_base``); auth and readiness are ``server_state``'s checks; health, readiness, /load and
/metrics answer from the server state here."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.common import openapi as oa
from kvmesh.engine.server.errors import APIError, error_body
from kvmesh.engine.server.server_state import ServerConfig, ServerState, check_auth, check_ready
from kvmesh.engine.server.serving_chat import ChatHandler
from kvmesh.engine.server.serving_completion import CompletionHandler
from kvmesh.engine.server.serving_lora import LoRAHandler
from kvmesh.engine.server.serving_tokenization import TokenizationHandler

__all__ = ["ServerConfig", "ServerState", "build_app"]

log = logging.getLogger("kvmesh.server")


# -- the app -------------------------------------------------------------------------------
def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.engine.alive and not state.engine.loaded.is_set():
            state.engine.start(asyncio.get_running_loop())
        yield
        state.engine.stop()

    app = FastAPI(title="kvmesh engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    _openapi_document(app, state)
    _error_handlers(app)
    _openai_routes(app, state)
    _operations_routes(app, state)
    return app


def _api(state: ServerState, method: str, path: str) -> dict[str, Any]:
    """A route's OpenAPI operation (kvmesh.common.openapi): its JSON request body (the routes read
    raw JSON, so FastAPI would document none) and every status it answers."""
    return oa.operation(method, path, auth=bool(state.config.api_key))


def _openapi_document(app: FastAPI, state: ServerState) -> None:
    def openapi() -> dict[str, Any]:
        """FastAPI's document, plus the shared schemas: the model name and, once the model is
        loaded, its vocabulary bound the token ids."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        # with adapters, `model` is any name (they come and go): no enum of the served one
        lora = state.engine.engine_args.enable_lora
        doc["components"] = oa.components(
            None if lora else state.config.served_model_name,
            state.engine.vocab_size or None,
            bool(state.config.api_key),
        )
        if state.engine.loaded.is_set():  # final: the vocabulary is known
            app.openapi_schema = doc
        return doc

    app.openapi = openapi


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if "x-request-id" in request.headers:
            exc.headers.setdefault("X-Request-Id", request.headers["x-request-id"])
        if exc.status >= 500:
            log.warning(
                "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message
            )
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # its headers too: a 405 must say which methods the route allows (Allow)
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=exc.headers,
        )


def _openai_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/* and vLLM's /tokenize, /detokenize: each hands its request to its handler."""

    async def guard(request: Request) -> None:
        """Every /v1 route: the API key, then readiness. Like vLLM, nothing under /v1 answers before
        the model is loaded (503 with Retry-After), /v1/models included: a client that polls it
        before sending can trust its 200. /health is liveness, /ready readiness."""
        check_auth(state, request)
        check_ready(state)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(guard)])

    @v1.post("/completions", openapi_extra=_api(state, "post", "/v1/completions"))
    async def completions(request: Request):
        return await CompletionHandler(state, request).handle()

    @v1.post("/chat/completions", openapi_extra=_api(state, "post", "/v1/chat/completions"))
    async def chat_completions(request: Request):
        return await ChatHandler(state, request).handle()

    @v1.get("/models", openapi_extra=_api(state, "get", "/v1/models"))
    async def models(request: Request):
        eng = state.engine
        served, created = state.config.served_model_name, int(state.started)
        base = {
            "id": served,
            "object": "model",
            "created": created,
            "owned_by": "kvmesh",
            "root": str(eng.engine_args.model),
            "parent": None,
            "max_model_len": eng.max_model_len or None,
        }
        return {"object": "list", "data": [base, *eng.adapters.cards(served, created)]}

    if state.config.allow_runtime_lora_updating:
        _lora_routes(v1)
    app.include_router(v1)

    @app.post("/tokenize", openapi_extra=_api(state, "post", "/tokenize"))
    async def tokenize(request: Request):
        """vLLM's /tokenize: the token ids the engine would see for a prompt or chat messages."""
        await guard(request)  # outside /v1: auth and readiness checked here
        return await TokenizationHandler(state, request).tokenize()

    @app.post("/detokenize", openapi_extra=_api(state, "post", "/detokenize"))
    async def detokenize(request: Request):
        await guard(request)
        return await TokenizationHandler(state, request).detokenize()


def _lora_routes(v1: APIRouter) -> None:
    """vLLM's runtime adapter loads and unloads (behind the /v1 guard: the API key, readiness)."""
    ops = {
        "load": "load (or with load_inplace, replace) a LoRA adapter",
        "unload": "unload a LoRA adapter; requests running with it finish with it",
    }

    @v1.post("/load_lora_adapter", summary=ops["load"])
    async def load_lora_adapter(request: Request):
        return await LoRAHandler(request.app.state.server, request).load()

    @v1.post("/unload_lora_adapter", summary=ops["unload"])
    async def unload_lora_adapter(request: Request):
        return await LoRAHandler(request.app.state.server, request).unload()


def _operations_routes(app: FastAPI, state: ServerState) -> None:
    """Liveness, readiness, the load figures and the metrics: answered from the server state."""

    @app.get(
        "/health",
        openapi_extra=oa.simple_get(
            "liveness: 500 once the engine failed to load, 503 once its "
            "core process (or thread) exited",
            [200, 500, 503],
            status_body=True,
        ),
    )
    async def health():
        if state.engine.load_error is not None:
            return JSONResponse(
                {"status": "error", "error": str(state.engine.load_error)}, status_code=500
            )
        if state.engine.loaded.is_set() and not state.engine.alive:
            return JSONResponse(
                {"status": "error", "error": f"engine core ({state.engine.mode}) exited"},
                status_code=503,
            )
        return {"status": "ok"}

    @app.get(
        "/ready",
        openapi_extra=oa.simple_get(
            "readiness: 503 while loading, draining or with the engine down",
            [200, 503],
            status_body=True,
        ),
    )
    async def ready():
        if state.ready:
            return {"status": "ready"}
        reason = (
            "draining"
            if state.draining
            else "loading"
            if not state.engine.loaded.is_set()
            else "engine down"
        )
        return JSONResponse({"status": reason}, status_code=503)

    @app.get(
        "/load",
        openapi_extra=oa.simple_get(
            "load figures the router and autoscalers read",
            [200],
            {"application/json": {"schema": oa.LOAD}},
        ),
    )
    async def load():
        snap = state.engine.snapshot()
        return {
            "model": state.config.served_model_name,
            "kv_cache_usage": snap["kv_cache_usage"],
            "num_running": snap["num_running"],
            "num_waiting": snap["num_waiting"],
            "num_total_blocks": snap["num_total_blocks"],
            "num_in_flight": state.engine.num_in_flight,
            "draining": state.draining,
            "ready": state.ready,
            "timestamp": time.time(),
        }

    @app.get(
        "/metrics",
        openapi_extra=oa.simple_get(
            "Prometheus metrics (vLLM's names)",
            [200],
            {"text/plain": {"schema": {"type": "string"}}},
        ),
    )
    async def metrics():
        return Response(
            state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )
