"""What every OpenAI request shares (vLLM's ``serving_engine.py``): the server's config and state,
auth and readiness, reading and validating the body, building the sampling parameters, fitting
``max_tokens`` to the context, admission, the outputs with their latency metrics, the SSE framing
of a stream and the JSON of a whole response.

A request kind is a subclass: ``serving_completion.CompletionHandler`` and
``serving_chat.ChatHandler`` say how their prompt is tokenised and how one choice reads (a
text or a message, their logprobs); ``serving_tokenization`` reuses the body checks only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvmesh.common.cache_salt import InvalidCacheSalt, check_cache_salt
from kvmesh.common.json_body import load_json
from kvmesh.engine.model_limits import RESUME_PARAM, ResumeTooLong
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams
from kvmesh.engine.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kvmesh.engine.server.errors import APIError, bad_request, error_body
from kvmesh.engine.server.metrics import ServerMetrics
from kvmesh.engine.server.off_loop import LARGE_BODY_BYTES, off_loop
from kvmesh.engine.server.protocol import first_error_param, invalid_text_field

log = logging.getLogger("kvmesh.server")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_num_seqs: int = 128
    max_waiting: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    retry_after_s: int = 1
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None    # a name in tool_parsers.TOOL_PARSERS

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


# -- helpers --------------------------------------------------------------------------------
def usage_field(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <compact JSON>`` and a blank line."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def decode_body(raw: bytes, model_cls: type[BaseModel]):
    """The request model of a JSON body, or the 400 (APIError) that names what is wrong."""
    try:
        data = load_json(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    if "cache_salt" in model_cls.model_fields:  # the router's check too: the same 400
        try:
            check_cache_salt(data.get("cache_salt"))
        except InvalidCacheSalt as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None
    bad_text = invalid_text_field(raw, data)
    if bad_text is not None:  # every string field: prompt, messages, stop, model, ...
        raise bad_request(f"{bad_text} is not valid Unicode text (a lone surrogate such as \\ud800)",
                          param=bad_text, code="invalid_text")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        param, message = first_error_param(exc)
        raise bad_request(message, param=param)


@dataclass
class Choice:
    """One engine request of an HTTP request: choice ``index`` (the response's), of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: str | list[int]
    ids: list[int]
    params: SamplingParams
    stream: RequestStream | None = None
    resumed: list[int] = field(default_factory=list)  # a continuation's ids already sent (resume)


class RequestHandler:
    """One HTTP request: read and validate its body, check its model."""

    def __init__(self, state: ServerState, request: Request):
        self.state = state
        self.engine = state.engine
        self.request = request
        self.created = int(time.time())
        self.request_id = (request.headers.get("x-request-id") or "")[:128] or uuid.uuid4().hex
        self.headers = {"X-Request-Id": self.request_id}

    async def parse(self, model_cls: type[BaseModel]):
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
        # a large body is decoded and validated in the request pool: the loop keeps answering
        return await off_loop(len(raw), decode_body, raw, model_cls, threshold=LARGE_BODY_BYTES)

    def check_model(self, model: str | None) -> None:
        name = self.state.config.served_model_name
        if model is not None and model != name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}`.",
                           param="model", code="model_not_found")

    async def read_body(self, model_cls: type[BaseModel]):
        """The validated body, for the served model."""
        body = await self.parse(model_cls)
        self.check_model(body.model)
        return body


class GenerationHandler(RequestHandler):
    """One generation request's life: parse, validate, admit, then stream or collect outputs.

    A subclass names its request model and says how a prompt becomes token ids
    (``prompts``, ``tokenize_prompt``) and how one choice reads (``stream_choice``,
    ``full_choice``).
    """

    request_model: ClassVar[type[BaseModel]]
    prompt_param: ClassVar[str]       # the field a context-length error names
    id_prefix: ClassVar[str]          # the response id: prefix + request id
    response_object: ClassVar[str]    # "object" of a whole response
    chunk_object: ClassVar[str]       # "object" of a stream chunk
    # where return_token_ids puts the prompt's ids: each choice (completions) or the response (chat)
    prompt_ids_per_choice: ClassVar[bool] = False
    streaming = False
    echo = False
    echo_only = False
    with_prompt_logprobs = False
    return_token_ids = False
    resuming = False  # a continuation (resume): only what follows the resumed ids is sent

    # -- what a kind defines ----------------------------------------------------------------
    def prompts(self, body) -> list[Any]:
        """The request's prompts, each tokenised by ``tokenize_prompt``."""
        raise NotImplementedError

    async def tokenize_prompt(self, body, prompt) -> tuple[str | list[int], list[int]]:
        """(the prompt as the engine keeps it, its token ids); InvalidParameter for a bad one."""
        raise NotImplementedError

    def read_options(self, body) -> None:
        """Options of the kind's own (completion: echo)."""

    def stream_preamble(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """Choices sent, one chunk each, before any output (chat: the assistant role)."""
        return []

    def stream_prefix(self, c: Choice, out: RequestOutput, first: bool) -> tuple[str, list[tuple[int, Any]]]:
        """Text sent before a choice's first output, and its prompt's logprob entries (echo)."""
        return "", []

    def stream_choice(self, c: Choice, out: RequestOutput, prefix: str, prompt_entries: list[tuple[int, Any]],
                      delta_text: str, delta_lps: list, finish: str | None, want_lp: bool) -> dict[str, Any] | None:
        """One choice of a stream chunk (None: no chunk for this output)."""
        raise NotImplementedError

    def full_choice(self, c: Choice, out: RequestOutput, text: str, lps: list, finish: str | None,
                    want_lp: bool) -> dict[str, Any]:
        """One choice of a whole response."""
        raise NotImplementedError

    # -- input ---------------------------------------------------------------------------
    async def prepare(self, body) -> list[Choice]:
        """One engine request per (prompt, sample): the prompts tokenised here, on the HTTP side
        (long ones in a worker thread so the event loop keeps serving other streams)."""
        engine = self.engine
        try:
            params = body.sampling_params(engine.sampling_defaults)
            await engine.check_structured(params)  # a spec the backend refuses: a 400 before anything runs
            n = body.num_choices()
            resumed = body.resume_token_ids()
            prompts = self.prompts(body)
            plan = body.resume_choices(len(prompts) * n)
            if resumed is not None:
                if len(prompts) != 1:
                    raise InvalidParameter(self.prompt_param, "a continuation (resume) continues one prompt; "
                                                              "several go on with resume.choices")
                plan = {0: resumed}
            if plan is not None:
                # the client had the prompt's echo and logprobs from the original stream
                params = replace(params, prompt_logprobs=None)
            choices: list[Choice] = []
            for p_index, prompt in enumerate(prompts):
                indices = range(p_index * n, (p_index + 1) * n)
                if plan is not None and not any(i in plan for i in indices):
                    continue  # a continuation: every choice of this prompt finished before the break
                prompt, ids = await self.tokenize_prompt(body, prompt)
                await off_loop(len(ids), engine.validate, ids, params)
                fitted = self._fit_max_tokens(body, ids, params)
                for j, index in enumerate(indices):
                    if plan is not None and index not in plan:
                        continue  # finished before the break: not run again
                    # Seeded samples of one prompt differ by seed + j (as vLLM's parallel sampling),
                    # a continuation's too: it keeps the original's choice indices.
                    sample = fitted.sample(j)
                    so_far = plan[index] if plan is not None else []
                    if so_far:  # every id against the vocabulary, and room left to generate
                        where = None if resumed is not None else f"resume.choices.{list(plan).index(index)}"
                        await self._validate_resume(ids, sample, so_far, where)
                    choices.append(Choice(index, p_index, prompt, ids, sample, resumed=so_far))
        except ResumeTooLong as exc:
            raise bad_request(str(exc), param=exc.param, code="context_length_exceeded" if exc.context else None)
        except InvalidParameter as exc:
            exc = body.renamed(exc)
            raise bad_request(str(exc), param=exc.param)
        return choices

    async def _validate_resume(self, ids: list[int], sample: SamplingParams, so_far: list[int],
                               where: str | None) -> None:
        """A continued choice's ids; ``where``: its entry in resume.choices (None: the one-choice
        form), which the error then names."""
        try:
            await off_loop(len(ids) + len(so_far), self.engine.validate, ids, sample, so_far)
        except InvalidParameter as exc:
            if where is None or exc.param != RESUME_PARAM:
                raise
            param = f"{where}.output_token_ids"
            message = str(exc).replace(RESUME_PARAM, param)
            renamed = ResumeTooLong(message, exc.context) if isinstance(exc, ResumeTooLong) else InvalidParameter(
                param, message)
            renamed.param = param
            raise renamed from None

    def _fit_max_tokens(self, body, ids: list[int], params: SamplingParams) -> SamplingParams:
        max_len = self.engine.max_model_len
        room = max_len - len(ids)
        prompt_param = self.prompt_param
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

    def check_capacity(self, requests: int = 1) -> None:
        state = self.state
        if self.engine.num_in_flight + requests > state.config.capacity:
            state.metrics.reject("queue_full")
            raise APIError(429, f"the server is at capacity ({state.config.capacity} requests admitted: "
                           f"{state.config.max_num_seqs} running + {state.config.max_waiting} waiting); "
                           "retry later", code="queue_full",
                           headers={"Retry-After": str(state.config.retry_after_s)})

    def admit(self, choices: list[Choice], cache_salt: str | None) -> None:
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
                c.stream = self.engine.add(rid, c.prompt, c.ids, c.params, cache_salt, c.resumed or None)
                log.info("request %s admitted: %d prompt tokens, max_tokens=%s, stream=%s%s", rid,
                         len(c.ids), c.params.max_tokens, self.streaming,
                         f", resumed after {len(c.resumed)} tokens" if c.resumed else "")
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

    def token_text(self, tid: int) -> str:
        return self.engine.tokenizer.decode([tid], skip_special_tokens=False)

    def prompt_logprobs_field(self, out: RequestOutput) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token, {token id: logprob, rank, decoded_token} for the
        token itself and the top N."""
        field_ = []
        for lp in out.prompt_logprobs or []:
            if lp is None:
                field_.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.token_text(lp.token_id)}}
            for rank, (tid, value) in enumerate(lp.top, 1):
                entry.setdefault(str(tid), {"logprob": value, "rank": rank, "decoded_token": self.token_text(tid)})
            field_.append(entry)
        return field_

    def chunk(self, choices: list[dict[str, Any]], usage=None, include_usage=False) -> dict[str, Any]:
        obj = {"id": self.response_id, "object": self.chunk_object, "created": self.created,
               "model": self.state.config.served_model_name, "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return obj

    @property
    def response_id(self) -> str:
        return self.id_prefix + self.request_id

    def usage(self, choices: list[Choice], completion_tokens: list[int], cached: list[int]) -> dict[str, Any]:
        """Prompt and cached tokens once per prompt (its first choice), completion tokens of all."""
        first: dict[int, Choice] = {}
        for c in choices:
            first.setdefault(c.prompt_index, c)
        # a continuation's cache hit may reach into its resumed ids: only the prompt's part counts
        return usage_field(sum(len(c.ids) for c in first.values()), sum(completion_tokens),
                           sum(min(cached[c.index], len(c.ids)) for c in first.values()))

    def with_token_ids(self, choice: dict[str, Any], c: Choice, token_ids: list[int], first: bool,
                       obj: dict[str, Any] | None = None) -> dict[str, Any]:
        """return_token_ids (vLLM's): the choice's ``token_ids``, and the prompt's ids with the first
        output (on the choice for completions, on ``obj`` - the response or chunk - for chat);
        never on a continuation, whose client has them already."""
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if first and not (self.resuming and self.streaming):
                if self.prompt_ids_per_choice:
                    choice["prompt_token_ids"] = list(c.ids)
                elif obj is not None:
                    obj["prompt_token_ids"] = list(c.ids)
        return choice

    async def stream_response(self, choices: list[Choice], include_usage: bool,
                              continuous_usage: bool = False) -> AsyncIterator[str]:
        want_lp = choices[0].params.logprobs is not None
        # by choice index (a continuation runs only some of the request's choices, under their own indices)
        size = choices[-1].index + 1
        n_out, cached = [0] * size, [0] * size
        started = [False] * size
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:  # one engine request's outputs into the merged queue
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
            for k, choice in enumerate([] if self.resuming else self.stream_preamble(choices)):
                chunk = self.chunk([choice], so_far(), include_usage)
                self.with_token_ids(choice, choices[k], [], first=k == 0, obj=chunk)
                yield sse(chunk)
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
                # a continuation's usage counts the resumed ids too: the whole request, once
                n_out[i] = 0 if self.echo_only else len(out.token_ids) + len(c.resumed)
                cached[i] = out.num_cached_tokens
                delta_text, delta_lps = ("", []) if self.echo_only else (out.delta_text, out.delta_logprobs)
                delta_ids = [] if self.echo_only else out.delta_token_ids
                prefix, prompt_entries = self.stream_prefix(c, out, first)
                with_plp = first and self.with_prompt_logprobs
                # with return_token_ids every id is sent as it comes, text or not (a resume needs them all)
                if not (prefix or delta_text or out.finished or (want_lp and delta_lps) or with_plp
                        or (self.return_token_ids and delta_ids)):
                    continue
                finish = out.finish_reason if out.finished else None
                if self.echo_only and finish:
                    finish = "length"
                choice = self.stream_choice(c, out, prefix, prompt_entries, delta_text, delta_lps, finish, want_lp)
                if choice is None:  # nothing to send yet (chat: a tool parser holds back what may be markup)
                    continue
                if with_plp:
                    choice["prompt_logprobs"] = self.prompt_logprobs_field(out)
                self.with_token_ids(choice, c, delta_ids, first=first and self.prompt_ids_per_choice)
                yield sse(self.chunk([choice], so_far(), include_usage))
            if include_usage:
                yield sse(self.chunk([], self.usage(choices, n_out, cached), True))
        except Exception as exc:  # noqa: BLE001 - the status line is sent already: report in-band
            log.exception("request %s failed mid-stream", self.request_id)
            yield sse(error_body(500, str(exc)))
        finally:
            for task in tasks:  # the client left (or one choice failed): abort the others
                task.cancel()
        yield SSE_DONE

    async def collect(self, choices: list[Choice]) -> list[RequestOutput]:
        """Run every choice to completion; abort them all if the client disconnects meanwhile."""
        final: dict[int, RequestOutput] = {}

        async def consume(c: Choice) -> None:
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

    def full_response(self, choices: list[Choice], outs: list[RequestOutput]) -> dict[str, Any]:
        items, generated = [], []
        response = {"id": self.response_id, "object": self.response_object,
                    "created": self.created, "model": self.state.config.served_model_name, "choices": items}
        for c, out in zip(choices, outs):
            comp, want_lp = out.outputs[0], c.params.logprobs is not None
            text, lps, finish, ids = comp.text, comp.logprobs or [], comp.finish_reason, comp.token_ids
            if self.echo_only:  # the prompt alone: the one token generated is dropped
                text, lps, finish, ids = "", [], "length", []
            generated.append(0 if self.echo_only else len(comp.token_ids) + len(c.resumed))
            item = self.full_choice(c, out, text, lps, finish, want_lp)
            if self.with_prompt_logprobs:
                item["prompt_logprobs"] = self.prompt_logprobs_field(out)
            items.append(self.with_token_ids(item, c, ids, first=c.index == 0 or self.prompt_ids_per_choice,
                                             obj=response))
        cached = [0] * (choices[-1].index + 1)  # by choice index, as usage() reads it
        for c, out in zip(choices, outs):
            cached[c.index] = out.num_cached_tokens
        response["usage"] = self.usage(choices, generated, cached)
        return response

    # -- the request ------------------------------------------------------------------------
    async def handle(self) -> Response:
        # auth and readiness: checked for every /v1 route by build_app's guard
        self.check_capacity()  # refuse early, before parsing and tokenising (checked again at admission)
        body = await self.read_body(self.request_model)
        choices = await self.prepare(body)
        self.streaming = body.stream
        self.with_prompt_logprobs = body.prompt_logprobs is not None
        self.return_token_ids = body.return_token_ids
        self.read_options(body)
        if body.resume is not None:  # the client had the prompt's echo and logprobs already
            self.resuming = True
            self.echo = self.echo_only = self.with_prompt_logprobs = False
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
        # a long answer (echo, logprobs of every token) is built and rendered in the request pool
        return await off_loop(self.response_size(choices, outs), self.json_response, choices, outs)

    def response_size(self, choices: list[Choice], outs: list[RequestOutput]) -> int:
        """About how many token entries full_response builds: tokens times their top-N logprobs."""
        size = 0
        for c, out in zip(choices, outs):
            tokens = len(out.outputs[0].token_ids) + (len(c.ids) if self.echo or self.with_prompt_logprobs else 0)
            size += tokens * (1 + (c.params.logprobs or 0) + (c.params.prompt_logprobs or 0))
        return size

    def json_response(self, choices: list[Choice], outs: list[RequestOutput]) -> JSONResponse:
        return JSONResponse(self.full_response(choices, outs), headers=self.headers)

    async def _counted(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for item in gen:
                yield item
        finally:
            self.state.active -= 1
            await gen.aclose()
