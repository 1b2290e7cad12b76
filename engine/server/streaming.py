"""A generation request's engine outputs as they arrive: latency metrics observed, then streamed as SSE
chunks or collected whole."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.server.async_engine import RequestStream
from kvmesh.engine.server.choices import Choice
from kvmesh.engine.server.errors import APIError, error_body
from kvmesh.engine.server.responses import SSE_DONE, ResponseAssembly, sse

log = logging.getLogger("kvmesh.server")


class OutputStreaming(ResponseAssembly):
    """The outputs of a :class:`~kvmesh.engine.server.serving_base.GenerationHandler`'s choices (a base
    of it): a stream's chunks through its kind's ``stream_preamble``, ``stream_prefix`` and
    ``stream_choice``, or every choice's last output."""

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
                    log.info(
                        "request %s finished: %s, %d tokens, %d cached prompt tokens",
                        self.request_id,
                        out.finish_reason,
                        len(out.token_ids),
                        out.num_cached_tokens,
                    )
                yield out
        finally:
            if not finished:
                m.request_finished("abort")
                log.info("request %s aborted before it finished", self.request_id)

    async def stream_response(
        self, choices: list[Choice], include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[str]:
        want_lp = choices[0].params.logprobs is not None
        # by choice index (a continuation runs only some of the request's choices, under their own indices)
        size = choices[-1].index + 1
        n_out, cached = [0] * size, [0] * size
        by_medium: list[dict[str, int] | None] = [None] * size
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
            return self.usage(choices, n_out, cached, by_medium) if continuous_usage else None

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
                by_medium[i] = out.num_cached_tokens_by_medium
                delta_text, delta_lps = (
                    ("", []) if self.echo_only else (out.delta_text, out.delta_logprobs)
                )
                delta_ids = [] if self.echo_only else out.delta_token_ids
                prefix, prompt_entries = self.stream_prefix(c, out, first)
                with_plp = first and self.with_prompt_logprobs
                # with return_token_ids every id is sent as it comes, text or not (a resume needs them all)
                if not (
                    prefix
                    or delta_text
                    or out.finished
                    or (want_lp and delta_lps)
                    or with_plp
                    or (self.return_token_ids and delta_ids)
                ):
                    continue
                finish = out.finish_reason if out.finished else None
                if self.echo_only and finish:
                    finish = "length"
                choice = self.stream_choice(
                    c, out, prefix, prompt_entries, delta_text, delta_lps, finish, want_lp
                )
                if (
                    choice is None
                ):  # nothing to send yet (chat: a tool parser holds back what may be markup)
                    continue
                if with_plp:
                    choice["prompt_logprobs"] = self.prompt_logprobs_field(out)
                self.with_token_ids(
                    choice, c, delta_ids, first=first and self.prompt_ids_per_choice
                )
                yield sse(self.chunk([choice], so_far(), include_usage))
            if include_usage:
                yield sse(self.chunk([], self.usage(choices, n_out, cached, by_medium), True))
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
                done, pending = await asyncio.wait(
                    tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION
                )
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
