"""The base of the generation handlers (vLLM's ``serving_engine.py``): one request's life: its body, its
choices prepared, admission, then its outputs streamed or collected.

A request kind is a subclass: ``serving_completion.CompletionHandler`` and
``serving_chat.ChatHandler`` say how their prompt is tokenised and how one choice reads (a
text or a message, their logprobs); ``serving_tokenization`` reuses the body checks only
(``request_body.RequestHandler``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, ClassVar

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from kvmesh.engine.lora.request import LoRAError
from kvmesh.engine.model_limits import ResumeTooLong
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.prefill_order import check_priority
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.adapters import model_not_found
from kvmesh.engine.server.async_engine import EngineDeadError
from kvmesh.engine.server.choices import Choice, fit_max_tokens, validate_resume
from kvmesh.engine.server.errors import APIError, bad_request
from kvmesh.engine.server.off_loop import off_loop
from kvmesh.engine.server.request_body import RequestHandler
from kvmesh.engine.server.streaming import OutputStreaming

log = logging.getLogger("kvmesh.server")


class GenerationHandler(RequestHandler, OutputStreaming):
    """One generation request's life: parse, validate, admit, then stream or collect outputs.

    A subclass names its request model and says how a prompt becomes token ids
    (``prompts``, ``tokenize_prompt``) and how one choice reads (``stream_choice``,
    ``full_choice``).
    """

    request_model: ClassVar[type[BaseModel]]
    prompt_param: ClassVar[str]  # the field a context-length error names
    id_prefix: ClassVar[str]  # the response id: prefix + request id
    response_object: ClassVar[str]  # "object" of a whole response
    chunk_object: ClassVar[str]  # "object" of a stream chunk
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

    def stream_prefix(
        self, c: Choice, out: RequestOutput, first: bool
    ) -> tuple[str, list[tuple[int, Any]]]:
        """Text sent before a choice's first output, and its prompt's logprob entries (echo)."""
        return "", []

    def stream_choice(
        self,
        c: Choice,
        out: RequestOutput,
        prefix: str,
        prompt_entries: list[tuple[int, Any]],
        delta_text: str,
        delta_lps: list,
        finish: str | None,
        want_lp: bool,
    ) -> dict[str, Any] | None:
        """One choice of a stream chunk (None: no chunk for this output)."""
        raise NotImplementedError

    def full_choice(
        self, c: Choice, out: RequestOutput, text: str, lps: list, finish: str | None, want_lp: bool
    ) -> dict[str, Any]:
        """One choice of a whole response."""
        raise NotImplementedError

    # -- input ---------------------------------------------------------------------------
    async def prepare(self, body) -> list[Choice]:
        """One engine request per (prompt, sample): the prompts tokenised here, on the HTTP side
        (long ones in a worker thread so the event loop keeps serving other streams)."""
        engine = self.engine
        try:
            params = body.sampling_params(engine.sampling_defaults)
            check_priority(body.priority, engine.engine_args.scheduling_policy)
            await engine.check_structured(
                params
            )  # a spec the backend refuses: a 400 before anything runs
            n = body.num_choices()
            resumed = body.resume_token_ids()
            prompts = self.prompts(body)
            plan = body.resume_choices(len(prompts) * n)
            if resumed is not None:
                if len(prompts) != 1:
                    raise InvalidParameter(
                        self.prompt_param,
                        "a continuation (resume) continues one prompt; "
                        "several go on with resume.choices",
                    )
                plan = {0: resumed}
            choices: list[Choice] = []
            for p_index, prompt in enumerate(prompts):
                indices = range(p_index * n, (p_index + 1) * n)
                if plan is not None and not any(i in plan for i in indices):
                    continue  # a continuation: every choice of this prompt finished before the break
                prompt, ids = await self.tokenize_prompt(body, prompt)
                await off_loop(len(ids), engine.validate, ids, params)
                fitted = fit_max_tokens(body, ids, params, engine.max_model_len, self.prompt_param)
                for j, index in enumerate(indices):
                    if plan is not None and index not in plan:
                        continue  # finished before the break: not run again
                    # Seeded samples of one prompt differ by seed + j (as vLLM's parallel sampling),
                    # a continuation's too: it keeps the original's choice indices.
                    sample = fitted.sample(j)
                    so_far = plan[index] if plan is not None else []
                    if (
                        so_far
                    ):  # the client had the prompt's echo and logprobs from the original stream
                        sample = replace(sample, prompt_logprobs=None)
                    if so_far:  # every id against the vocabulary, and room left to generate
                        where = (
                            None
                            if resumed is not None
                            else f"resume.choices.{list(plan).index(index)}"
                        )
                        await validate_resume(engine, ids, sample, so_far, where)
                    choices.append(Choice(index, p_index, prompt, ids, sample, resumed=so_far))
        except ResumeTooLong as exc:
            raise bad_request(
                str(exc), param=exc.param, code="context_length_exceeded" if exc.context else None
            )
        except InvalidParameter as exc:
            exc = body.renamed(exc)
            raise bad_request(str(exc), param=exc.param)
        return choices

    def check_capacity(self, requests: int = 1) -> None:
        state = self.state
        if self.engine.num_in_flight + requests > state.config.capacity:
            state.metrics.reject("queue_full")
            raise APIError(
                429,
                f"the server is at capacity ({state.config.capacity} requests admitted: "
                f"{state.config.max_num_seqs} running + {state.config.max_waiting} waiting); "
                "retry later",
                code="queue_full",
                headers={"Retry-After": str(state.config.retry_after_s)},
            )

    def admit(self, choices: list[Choice], cache_salt: str | None, priority: int = 0) -> None:
        state = self.state
        if state.draining:
            state.metrics.reject("draining")
            raise APIError(
                503,
                "the server is draining and admits no new requests",
                headers={"Retry-After": "1"},
            )
        if len(choices) > state.config.capacity:  # could never be admitted: retrying is no use
            per_prompt = len(choices) // (choices[-1].prompt_index + 1)
            raise bad_request(
                f"{len(choices)} choices (prompts x n) exceed the {state.config.capacity} requests "
                "this server admits at once",
                param="n" if per_prompt > 1 else "prompt",
            )
        self.check_capacity(len(choices))
        try:
            for c in choices:
                rid = self.engine.unique_id(
                    self.request_id if len(choices) == 1 else f"{self.request_id}-{c.index}"
                )
                c.stream = self.engine.add(
                    rid,
                    c.prompt,
                    c.ids,
                    c.params,
                    cache_salt,
                    c.resumed or None,
                    self.lora_name,
                    priority,
                )
                log.info(
                    "request %s admitted: %d prompt tokens, max_tokens=%s, stream=%s%s",
                    rid,
                    len(c.ids),
                    c.params.max_tokens,
                    self.streaming,
                    f", resumed after {len(c.resumed)} tokens" if c.resumed else "",
                )
        except BaseException as exc:
            for c in choices:  # all or nothing
                if c.stream is not None:
                    self.engine.abort(c.stream.request_id)
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc))
            raise

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
            # (echo: of the choices it has ids of; one the continuation starts from nothing gets it)
            self.resuming = True
            self.echo_only = self.with_prompt_logprobs = False
        self.admit(choices, body.cache_salt, body.priority)
        self.state.active += 1
        if body.stream:
            return StreamingResponse(
                self._counted(
                    self.stream_response(choices, body.include_usage, body.continuous_usage)
                ),
                media_type="text/event-stream",
                headers={**self.headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            outs = await self.collect(choices)
        except APIError:
            raise
        except LoRAError:  # its adapter was unloaded between the name's check and the core
            raise model_not_found(self.lora_name, self.state.config.served_model_name)
        except InvalidParameter as exc:  # refused by the engine itself
            raise bad_request(str(exc), param=exc.param)
        except Exception as exc:  # noqa: BLE001 - an engine failure fails this request only
            log.exception("request %s failed", self.request_id)
            raise APIError(500, f"{exc}", code="engine_error")
        finally:
            self.state.active -= 1
        # a long answer (echo, logprobs of every token) is built and rendered in the request pool
        return await off_loop(self.response_size(choices, outs), self.json_response, choices, outs)

    async def _counted(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for item in gen:
                yield item
        finally:
            self.state.active -= 1
            await gen.aclose()
