"""FastAPI routes: the OpenAI API, health/readiness, /load and /metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.common import openapi as oa
from kvmesh.common.tokenizer import TemplateError
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams
from kvmesh.engine.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kvmesh.engine.server.errors import APIError, bad_request, error_body
from kvmesh.engine.server.metrics import ServerMetrics
from kvmesh.engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          TokenizeRequest, first_error_param, invalid_text_field)

log = logging.getLogger("kvmesh.server")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_num_seqs: int = 128
    max_waiting: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    retry_after_s: int = 1

    @property
    def capacity(self) -> int:
        """Requests admitted at once: the running batch plus the bounded waiting queue."""
        return self.max_num_seqs + self.max_waiting


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    draining: bool = False
    active: int = 0  # admitted requests whose HTTP response has not finished yet
    started: float = field(default_factory=time.time)
    metrics: ServerMetrics | None = None

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine, self.config.served_model_name, lambda: self.draining)

    @property
    def ready(self) -> bool:
        return self.engine.loaded.is_set() and self.engine.alive and not self.draining

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: refusing new requests; %d in flight", self.engine.num_in_flight)
        self.draining = True

    async def wait_drained(self, timeout: float) -> bool:
        """Wait until every admitted request has finished and its response has been written.

        `active` counts responses still being written; a response whose generator never
        started (client gone before the first byte) would never decrement it, so once the
        engine has nothing in flight, responses get at most one more second.
        """
        deadline = time.monotonic() + timeout
        engine_idle_since: float | None = None
        while True:
            now = time.monotonic()
            if self.engine.num_in_flight == 0:
                engine_idle_since = engine_idle_since or now
                if self.active <= 0 or now - engine_idle_since > 1.0:
                    return True
            else:
                engine_idle_since = None
            if now >= deadline:
                return False
            await asyncio.sleep(0.05)


# -- helpers --------------------------------------------------------------------------------
def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass
class _Choice:
    """One engine request of an HTTP request: choice ``index`` (the response's), of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: str | list[int]
    ids: list[int]
    params: SamplingParams
    stream: RequestStream | None = None


class _Handler:
    """One request's life: parse, validate, admit, then stream or collect outputs."""

    def __init__(self, state: ServerState, request: Request, kind: str):
        self.state = state
        self.engine = state.engine
        self.request = request
        self.kind = kind  # "completion" | "chat"
        self.created = int(time.time())
        self.request_id = (request.headers.get("x-request-id") or "")[:128] or uuid.uuid4().hex
        self.headers = {"X-Request-Id": self.request_id}

    # -- input ---------------------------------------------------------------------------
    async def parse(self, model_cls):
        cfg = self.state.config
        length = self.request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            self.state.metrics.reject("body_too_large")
            raise APIError(413, f"request body is {length} bytes; the limit is {cfg.max_body_bytes}",
                           code="body_too_large")
        chunks, size = [], 0
        async for chunk in self.request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                self.state.metrics.reject("body_too_large")
                raise APIError(413, f"request body exceeds the limit of {cfg.max_body_bytes} bytes",
                               code="body_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json")
        if not isinstance(data, dict):
            raise bad_request("request body must be a JSON object")
        bad_text = invalid_text_field(raw, data)
        if bad_text is not None:  # every string field: prompt, messages, stop, model, ...
            raise bad_request(f"{bad_text} is not valid Unicode text (a lone surrogate such as \\ud800)",
                              param=bad_text, code="invalid_text")
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            param, message = first_error_param(exc)
            raise bad_request(message, param=param)

    def check_model(self, model: str | None) -> None:
        name = self.state.config.served_model_name
        if model is not None and model != name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}`.",
                           param="model", code="model_not_found")

    async def prepare(self, body) -> list[_Choice]:
        """One engine request per (prompt, sample): the prompts tokenised here, on the HTTP side
        (long ones in a worker thread so the event loop keeps serving other streams)."""
        engine = self.engine
        try:
            params = body.sampling_params(engine.sampling_defaults)
            n = body.num_choices()
            prompts = body.prompt_inputs() if self.kind == "completion" else [None]
            choices: list[_Choice] = []
            for p_index, prompt in enumerate(prompts):
                prompt, ids = await self._tokenize(body, prompt, params)
                fitted = self._fit_max_tokens(body, ids, params)
                for j in range(n):
                    # Seeded samples of one prompt differ by seed + j (as vLLM's parallel sampling).
                    choices.append(_Choice(len(choices), p_index, prompt, ids, fitted.sample(j)))
        except InvalidParameter as exc:
            exc = body.renamed(exc)
            raise bad_request(str(exc), param=exc.param)
        return choices

    async def _tokenize(self, body, prompt, params: SamplingParams) -> tuple[str | list[int], list[int]]:
        engine = self.engine
        if self.kind == "completion":
            ids = (await self._off_loop(len(prompt), engine.tokenizer.encode, prompt)
                   if isinstance(prompt, str) else list(prompt))
        else:
            messages = body.template_messages()
            try:
                size = sum(len(m["content"]) for m in messages)
                ids = await self._off_loop(size, partial(engine.tokenizer.encode_chat, messages,
                                                         body.add_generation_prompt, body.continue_final_message,
                                                         body.chat_template_kwargs))
            except TemplateError as exc:
                raise InvalidParameter("messages", str(exc))
            prompt = ids
        engine.validate(ids, params)
        return prompt, ids

    def _fit_max_tokens(self, body, ids: list[int], params: SamplingParams) -> SamplingParams:
        max_len = self.engine.max_model_len
        room = max_len - len(ids)
        prompt_param = "prompt" if self.kind == "completion" else "messages"
        if params.max_tokens is None or len(ids) + params.max_tokens <= max_len:
            if params.min_tokens > room:  # no max_tokens: the context bounds the output, below min_tokens
                raise bad_request(
                    f"This model's maximum context length is {max_len} tokens. However, you requested at "
                    f"least {len(ids) + params.min_tokens} tokens ({len(ids)} in the {prompt_param}, min_tokens "
                    f"{params.min_tokens}). Please reduce the length of the {prompt_param} or min_tokens.",
                    param="min_tokens", code="context_length_exceeded")
            return params
        if body.requested_max_tokens() is None and room >= max(1, params.min_tokens):
            # The model's default (max_new_tokens), not the client's ask: shorten it to fit.
            return replace(params, max_tokens=room)
        # the client's max_tokens (as it named it), or else its min_tokens, does not fit
        param = body.request_param("max_tokens") if body.requested_max_tokens() is not None else "min_tokens"
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the "
            f"{prompt_param}, {params.max_tokens} in the completion). Please reduce the length "
            f"of the {prompt_param} or the completion.", param=param,
            code="context_length_exceeded")

    @staticmethod
    async def _off_loop(size: int, fn, *args):
        if size < 8192:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def check_capacity(self, requests: int = 1) -> None:
        state = self.state
        if self.engine.num_in_flight + requests > state.config.capacity:
            state.metrics.reject("queue_full")
            raise APIError(429, f"the server is at capacity ({state.config.capacity} requests admitted: "
                           f"{state.config.max_num_seqs} running + {state.config.max_waiting} waiting); "
                           "retry later", code="queue_full",
                           headers={"Retry-After": str(state.config.retry_after_s)})

    def admit(self, choices: list[_Choice], cache_salt: str | None) -> None:
        state = self.state
        if state.draining:
            state.metrics.reject("draining")
            raise APIError(503, "the server is draining and admits no new requests",
                           headers={"Retry-After": "1"})
        if len(choices) > state.config.capacity:  # could never be admitted: retrying is no use
            per_prompt = len(choices) // (choices[-1].prompt_index + 1)
            raise bad_request(f"{len(choices)} choices (prompts x n) exceed the {state.config.capacity} requests "
                              "this server admits at once", param="n" if per_prompt > 1 else "prompt")
        self.check_capacity(len(choices))
        try:
            for c in choices:
                rid = self.engine.unique_id(self.request_id if len(choices) == 1 else f"{self.request_id}-{c.index}")
                c.stream = self.engine.add(rid, c.prompt, c.ids, c.params, cache_salt)
                log.info("request %s admitted: %d prompt tokens, max_tokens=%s, stream=%s", rid,
                         len(c.ids), c.params.max_tokens, getattr(self, "streaming", False))
        except BaseException as exc:
            for c in choices:  # all or nothing
                if c.stream is not None:
                    self.engine.abort(c.stream.request_id)
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc))
            raise

    # -- outputs ---------------------------------------------------------------------------
    async def outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The request's outputs, with latency metrics observed as they arrive."""
        m = self.state.metrics
        last: float | None = None
        finished = False
        try:
            async for out in self.engine.stream_outputs(stream):
                now = time.monotonic()
                n = len(out.delta_token_ids)
                if n:
                    if last is None:
                        m.ttft.observe(now - stream.arrival)
                        if n > 1:
                            for _ in range(n - 1):
                                m.itl.observe(0.0)
                    else:
                        for _ in range(n):
                            m.itl.observe((now - last) / n)
                    last = now
                if out.finished:
                    finished = True
                    m.e2e.observe(now - stream.arrival)
                    m.request_finished(out.finish_reason)
                    log.info("request %s finished: %s, %d tokens, %d cached prompt tokens", self.request_id,
                             out.finish_reason, len(out.token_ids), out.num_cached_tokens)
                yield out
        finally:
            if not finished:
                m.request_finished("abort")
                log.info("request %s aborted before it finished", self.request_id)

    def _token_text(self, tid: int) -> str:
        return self.engine.tokenizer.decode([tid], skip_special_tokens=False)

    def completion_logprobs(self, lps, offset: int, prompt: list[tuple[int, Any]] = ()) -> dict[str, Any]:
        """OpenAI's completion logprobs; with echo, the prompt's (token id, logprob or None) first."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in [*prompt, *((lp.token_id, lp) for lp in lps)]:
            text = self._token_text(tid)
            tokens.append(text)
            token_lps.append(lp.logprob if lp is not None else None)
            tops.append({self._token_text(t): v for t, v in lp.top} if lp is not None else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def echo_prefix(self, c: _Choice, out: RequestOutput) -> tuple[str, list[tuple[int, Any]]]:
        """The prompt's text and its (token id, logprob) entries, for echo."""
        text = c.prompt if isinstance(c.prompt, str) else self.engine.tokenizer.decode(
            c.ids, skip_special_tokens=c.params.skip_special_tokens)
        lps = out.prompt_logprobs or [None] * len(c.ids)
        return text, list(zip(c.ids, lps))

    def prompt_logprobs_field(self, out: RequestOutput) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token, {token id: logprob, rank, decoded_token} for the
        token itself and the top N."""
        field_ = []
        for lp in out.prompt_logprobs or []:
            if lp is None:
                field_.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self._token_text(lp.token_id)}}
            for rank, (tid, value) in enumerate(lp.top, 1):
                entry.setdefault(str(tid), {"logprob": value, "rank": rank, "decoded_token": self._token_text(tid)})
            field_.append(entry)
        return field_

    def chat_logprobs(self, lps) -> dict[str, Any]:
        content = []
        for lp in lps:
            text = self._token_text(lp.token_id)
            content.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": (t := self._token_text(tid)), "logprob": v,
                                              "bytes": list(t.encode())} for tid, v in lp.top]})
        return {"content": content}

    def chunk(self, choices: list[dict[str, Any]], usage=None, include_usage=False) -> dict[str, Any]:
        obj = {"id": self.response_id, "object": self.chunk_object, "created": self.created,
               "model": self.state.config.served_model_name, "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return obj

    @property
    def response_id(self) -> str:
        return ("cmpl-" if self.kind == "completion" else "chatcmpl-") + self.request_id

    @property
    def chunk_object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion.chunk"

    def usage(self, choices: list[_Choice], completion_tokens: list[int], cached: list[int]) -> dict[str, Any]:
        """Prompt and cached tokens once per prompt (its first choice), completion tokens of all."""
        first: dict[int, _Choice] = {}
        for c in choices:
            first.setdefault(c.prompt_index, c)
        return _usage(sum(len(c.ids) for c in first.values()), sum(completion_tokens),
                      sum(cached[c.index] for c in first.values()))

    async def stream_response(self, choices: list[_Choice], include_usage: bool,
                              continuous_usage: bool = False) -> AsyncIterator[str]:
        want_lp = choices[0].params.logprobs is not None
        offsets, n_out, cached = [0] * len(choices), [0] * len(choices), [0] * len(choices)
        started = [False] * len(choices)
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:  # one engine request's outputs into the merged queue
            gen = self.outputs(c.stream)
            try:
                async for out in gen:
                    merged.put_nowait((c, out))
            except Exception as exc:  # noqa: BLE001 - reported in-band below
                merged.put_nowait((c, exc))
            finally:
                await gen.aclose()
                merged.put_nowait((c, None))

        def so_far() -> dict[str, Any] | None:
            return self.usage(choices, n_out, cached) if continuous_usage else None

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            if self.kind == "chat":
                for c in choices:
                    yield _sse(self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], so_far(), include_usage))
            running = len(choices)
            while running:
                c, out = await merged.get()
                if out is None:
                    running -= 1
                    continue
                if isinstance(out, Exception):
                    raise out
                i = c.index
                first, started[i] = not started[i], True
                n_out[i], cached[i] = (0 if self.echo_only else len(out.token_ids)), out.num_cached_tokens
                delta_text, delta_lps = ("", []) if self.echo_only else (out.delta_text, out.delta_logprobs)
                prefix, prompt_entries = self.echo_prefix(c, out) if self.echo and first else ("", [])
                with_plp = first and self.with_prompt_logprobs
                if not (prefix or delta_text or out.finished or (want_lp and delta_lps) or with_plp):
                    continue
                finish = out.finish_reason if out.finished else None
                if self.echo_only and finish:
                    finish = "length"
                if self.kind == "completion":
                    text = prefix + delta_text
                    choice = {"index": i, "text": text,
                              "logprobs": self.completion_logprobs(delta_lps, offsets[i], prompt_entries)
                              if want_lp else None,
                              "finish_reason": finish, "stop_reason": out.outputs[0].stop_reason if finish else None}
                    offsets[i] += len(text)
                else:
                    delta = {"content": delta_text} if delta_text or not finish else {}
                    choice = {"index": i, "delta": delta,
                              "logprobs": self.chat_logprobs(delta_lps) if want_lp else None,
                              "finish_reason": finish}
                    if finish:
                        choice["stop_reason"] = out.outputs[0].stop_reason
                if with_plp:
                    choice["prompt_logprobs"] = self.prompt_logprobs_field(out)
                yield _sse(self.chunk([choice], so_far(), include_usage))
            if include_usage:
                yield _sse(self.chunk([], self.usage(choices, n_out, cached), True))
        except Exception as exc:  # noqa: BLE001 - the status line is sent already: report in-band
            log.exception("request %s failed mid-stream", self.request_id)
            yield _sse(error_body(500, str(exc)))
        finally:
            for task in tasks:  # the client left (or one choice failed): abort the others
                task.cancel()
        yield "data: [DONE]\n\n"

    async def collect(self, choices: list[_Choice]) -> list[RequestOutput]:
        """Run every choice to completion; abort them all if the client disconnects meanwhile."""
        final: dict[int, RequestOutput] = {}

        async def consume(c: _Choice) -> None:
            gen = self.outputs(c.stream)
            try:
                async for out in gen:
                    final[c.index] = out
            finally:
                await gen.aclose()

        tasks = [asyncio.ensure_future(consume(c)) for c in choices]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()  # re-raises a choice's failure
                if not pending:
                    return [final[c.index] for c in choices]
                if await self.request.is_disconnected():
                    log.info("request %s: client disconnected", self.request_id)
                    raise APIError(499, "client disconnected")
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

    def full_response(self, choices: list[_Choice], outs: list[RequestOutput]) -> dict[str, Any]:
        items, generated = [], []
        for c, out in zip(choices, outs):
            comp, want_lp = out.outputs[0], c.params.logprobs is not None
            text, lps, finish = comp.text, comp.logprobs or [], comp.finish_reason
            if self.echo_only:  # the prompt alone: the one token generated is dropped
                text, lps, finish = "", [], "length"
            generated.append(0 if self.echo_only else len(comp.token_ids))
            if self.kind == "completion":
                prefix, prompt_entries = self.echo_prefix(c, out) if self.echo else ("", [])
                item = {"index": c.index, "text": prefix + text,
                        "logprobs": self.completion_logprobs(lps, 0, prompt_entries) if want_lp else None,
                        "finish_reason": finish, "stop_reason": comp.stop_reason}
            else:
                item = {"index": c.index, "message": {"role": "assistant", "content": text},
                        "logprobs": self.chat_logprobs(lps) if want_lp else None,
                        "finish_reason": finish, "stop_reason": comp.stop_reason}
            if self.with_prompt_logprobs:
                item["prompt_logprobs"] = self.prompt_logprobs_field(out)
            items.append(item)
        usage = self.usage(choices, generated, [o.num_cached_tokens for o in outs])
        return {"id": self.response_id, "object": "text_completion" if self.kind == "completion" else "chat.completion",
                "created": self.created, "model": self.state.config.served_model_name, "choices": items,
                "usage": usage}

    async def handle(self, model_cls) -> Response:
        # auth and readiness: checked for every /v1 route by build_app's guard
        self.check_capacity()  # refuse early, before parsing and tokenising (checked again at admission)
        body = await self.parse(model_cls)
        self.check_model(body.model)
        choices = await self.prepare(body)
        self.streaming = body.stream
        self.echo = self.kind == "completion" and body.echo
        self.echo_only = self.kind == "completion" and body.echo_only
        self.with_prompt_logprobs = body.prompt_logprobs is not None
        self.admit(choices, body.cache_salt)
        self.state.active += 1
        if body.stream:
            return StreamingResponse(self._counted(self.stream_response(choices, body.include_usage,
                                                                        body.continuous_usage)),
                                     media_type="text/event-stream",
                                     headers={**self.headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            outs = await self.collect(choices)
        except APIError:
            raise
        except InvalidParameter as exc:  # refused by the engine itself
            raise bad_request(str(exc), param=exc.param)
        except Exception as exc:  # noqa: BLE001 - an engine failure fails this request only
            log.exception("request %s failed", self.request_id)
            raise APIError(500, f"{exc}", code="engine_error")
        finally:
            self.state.active -= 1
        return JSONResponse(self.full_response(choices, outs), headers=self.headers)

    async def _counted(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for item in gen:
                yield item
        finally:
            self.state.active -= 1
            await gen.aclose()


def check_ready(state: ServerState) -> None:
    if state.draining:
        state.metrics.reject("draining")
        raise APIError(503, "the server is draining and admits no new requests", headers={"Retry-After": "1"})
    if not state.engine.loaded.is_set():
        raise APIError(503, "the model is still loading", headers={"Retry-After": "1"})
    if not state.engine.alive:
        raise APIError(503, "the engine is not running")


def check_auth(state: ServerState, request: Request) -> None:
    key = state.config.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


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
    auth = bool(state.config.api_key)

    def api(method: str, path: str) -> dict[str, Any]:
        """A route's OpenAPI operation (kvmesh.common.openapi): its JSON request body (the routes
        read raw JSON, so FastAPI would document none) and every status it answers."""
        return oa.operation(method, path, auth=auth)

    def openapi() -> dict[str, Any]:
        """FastAPI's document, plus the shared schemas: the model name and, once the model is
        loaded, its vocabulary bound the token ids."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        doc["components"] = oa.components(state.config.served_model_name, state.engine.vocab_size or None, auth)
        if state.engine.loaded.is_set():  # final: the vocabulary is known
            app.openapi_schema = doc
        return doc

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if "x-request-id" in request.headers:
            exc.headers.setdefault("X-Request-Id", request.headers["x-request-id"])
        if exc.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # its headers too: a 405 must say which methods the route allows (Allow)
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=exc.headers)

    async def guard(request: Request) -> None:
        """Every /v1 route: the API key, then readiness. Like vLLM, nothing under /v1 answers before
        the model is loaded (503 with Retry-After), /v1/models included: a client that polls it
        before sending can trust its 200. /health is liveness, /ready readiness."""
        check_auth(state, request)
        check_ready(state)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(guard)])

    @v1.post("/completions", openapi_extra=api("post", "/v1/completions"))
    async def completions(request: Request):
        return await _Handler(state, request, "completion").handle(CompletionRequest)

    @v1.post("/chat/completions", openapi_extra=api("post", "/v1/chat/completions"))
    async def chat_completions(request: Request):
        return await _Handler(state, request, "chat").handle(ChatCompletionRequest)

    @v1.get("/models", openapi_extra=api("get", "/v1/models"))
    async def models(request: Request):
        eng = state.engine
        return {"object": "list", "data": [{
            "id": state.config.served_model_name, "object": "model", "created": int(state.started),
            "owned_by": "kvmesh", "root": str(eng.engine_args.model), "parent": None,
            "max_model_len": eng.max_model_len or None}]}

    app.include_router(v1)

    async def tokenizer_request(request: Request, model_cls):
        """Auth, readiness, the body and its model: what /tokenize and /detokenize check first."""
        await guard(request)
        handler = _Handler(state, request, model_cls.__name__)
        body = await handler.parse(model_cls)
        handler.check_model(body.model)
        return body

    @app.post("/tokenize", openapi_extra=api("post", "/tokenize"))
    async def tokenize(request: Request):
        """vLLM's /tokenize: the token ids the engine would see for a prompt or chat messages."""
        body = await tokenizer_request(request, TokenizeRequest)
        tok = state.engine.tokenizer
        try:
            body.check()
            if body.messages is not None:
                ids = tok.encode_chat([m.as_template_dict(i) for i, m in enumerate(body.messages)],
                                      body.add_generation_prompt,
                                      body.continue_final_message, body.chat_template_kwargs)
            else:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except InvalidParameter as exc:
            raise bad_request(str(exc), param=exc.param)
        except TemplateError as exc:
            raise bad_request(str(exc), param="messages")
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    @app.post("/detokenize", openapi_extra=api("post", "/detokenize"))
    async def detokenize(request: Request):
        body = await tokenizer_request(request, DetokenizeRequest)
        try:
            state.engine.engine.core.check_token_ids("tokens", body.tokens)
        except InvalidParameter as exc:
            raise bad_request(str(exc), param=exc.param)
        return {"prompt": state.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health", openapi_extra=oa.simple_get("liveness: 500 once the engine failed to load, 503 once its "
                                                    "core process (or thread) exited", [200, 500, 503],
                                                    status_body=True))
    async def health():
        if state.engine.load_error is not None:
            return JSONResponse({"status": "error", "error": str(state.engine.load_error)}, status_code=500)
        if state.engine.loaded.is_set() and not state.engine.alive:
            return JSONResponse({"status": "error", "error": f"engine core ({state.engine.mode}) exited"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/ready", openapi_extra=oa.simple_get("readiness: 503 while loading, draining or with the engine "
                                                   "down", [200, 503], status_body=True))
    async def ready():
        if state.ready:
            return {"status": "ready"}
        reason = "draining" if state.draining else "loading" if not state.engine.loaded.is_set() else "engine down"
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/load", openapi_extra=oa.simple_get("load figures the router and autoscalers read", [200],
                                                  {"application/json": {"schema": oa.LOAD}}))
    async def load():
        snap = state.engine.snapshot()
        return {"model": state.config.served_model_name, "kv_cache_usage": snap["kv_cache_usage"],
                "num_running": snap["num_running"], "num_waiting": snap["num_waiting"],
                "num_total_blocks": snap["num_total_blocks"], "num_in_flight": state.engine.num_in_flight,
                "draining": state.draining, "ready": state.ready, "timestamp": time.time()}

    @app.get("/metrics", openapi_extra=oa.simple_get("Prometheus metrics (vLLM's names)", [200],
                                                     {"text/plain": {"schema": {"type": "string"}}}))
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
