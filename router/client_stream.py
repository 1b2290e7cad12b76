"""The client's side of a resumable stream: its events as they go out, the ids generated so far, and how it ends.

The router asks the engine for the generated token ids (`return_token_ids`) on a stream it may
have to resume, so it knows exactly what the client has received, choice by choice (n > 1 and a
batch of prompts: choice index = prompt index * n + j), and which choices finished. The ids, and the prompt's
ids, are taken out of each event again unless the client asked for them itself. A stream that
a continuation goes on with (another replica, after its engine failed) keeps the original's
`id` and `created`; a restart from nothing (the engine failed before its first token) also
drops the preamble the client already had (the chat role chunk, the prompt's ids).
"""

from __future__ import annotations

import json
import time

from kvmesh.router import vllm_resume

DONE = b"data: [DONE]"

# What the engine's own failure looks like inside a stream: an error event, or a choice it
# aborted (its drain timed out): the generation did not finish, another replica may go on with it.
ENGINE_ERROR = "engine_error"
ABORTED = "aborted"


class ClientStream:
    def __init__(self, send, want_ids: bool, chat: bool, num_choices: int = 1, n: int = 1):
        self.send = send
        self.want_ids = want_ids  # the client asked for return_token_ids itself: pass them on
        self.chat = chat
        self.num_choices = num_choices  # prompts x n
        self.n = n  # choices per prompt: choice i is of prompt i // n
        self.started = False  # the status line went out
        self.events_out = 0  # events the client has received
        self.ids: dict[
            int, list[int]
        ] = {}  # per choice index: its generated ids, as the client has received them
        self.finish_reasons: dict[int, str] = {}  # per choice index that finished: its reason
        self.prompt_tokens: dict[
            int, int
        ] = {}  # per prompt index: its token count (from prompt_token_ids)
        self.prompt_ids: dict[
            int, list[int]
        ] = {}  # per prompt index: its ids, as the engine sent them
        self.usage_offset = (0, 0)  # (prompt, completion) tokens a continuation's usage leaves out
        self.engine_sends_ids = (
            False  # the engine sent token ids: a continuation can go on from them
        )
        self.id: str | None = None  # the original's id and created, kept by every continuation
        self.created: int | None = None
        self.model: str | None = None
        self.object: str | None = None
        self.done = False  # [DONE] went out
        self.usage: dict | None = None
        self.resumed_at: float | None = None  # set while a continuation's first event is awaited
        self.on_resumed = (
            None  # called with the seconds from the break to the continuation's first event
        )
        self._restart = False  # passing through a restart from nothing after the client had events
        self._roles_out: set[int] = set()  # chat: the choices whose role chunk the client has
        self._completions = False  # passing through a vLLM continuation (router/vllm_resume.py)
        self._buf = b""

    # -- the status line, the events --------------------------------------------------------------
    async def start(self, start: dict) -> None:
        if not self.started:
            self.started = True
            await self.send(start)

    def resuming(self, restart: bool, since: float, completions: bool = False) -> None:
        """A continuation (or, with `restart`, the request again from nothing) takes over; `since`:
        when the engine failed (time.perf_counter), for the resume latency. `completions`: a
        vLLM continuation, whose prompt holds the ids the client has (its usage counts them as
        prompt) and whose events are text_completion ones."""
        self._buf = b""
        self._restart = restart and self.events_out > 0
        self._completions = completions and not restart
        self.resumed_at = since
        if self._completions:
            out = len(self.output_ids)
            self.usage_offset = (-out, out)
        else:
            self.usage_offset = (0, 0) if restart else self._left_out()

    # -- the choices ------------------------------------------------------------------------------
    @property
    def output_ids(self) -> list[int]:
        """Every id the client has received, of all choices."""
        return [t for ids in self.ids.values() for t in ids]

    def running(self) -> list[int]:
        """The choices that have not finished, by index."""
        return [i for i in range(self.num_choices) if i not in self.finish_reasons]

    def spent(self, budget: int | None) -> list[int]:
        """Running choices that have generated their whole budget (max_tokens) without a finish
        reason out: the engine would end them with "length" and nothing more."""
        if budget is None:
            return []
        return [i for i in self.running() if len(self.ids.get(i, ())) >= budget]

    def continuation(self) -> dict:
        """The `resume` field that goes on with this stream: one choice's ids, or the running
        choices of several, each with its ids (none yet is fine)."""
        if self.num_choices == 1:
            return {"output_token_ids": self.ids.get(0, [])}
        return {
            "choices": [
                {"index": i, "output_token_ids": self.ids.get(i, [])} for i in self.running()
            ]
        }

    def resume_tokens(self, fallback_prompt_tokens: int) -> int:
        """The tokens a continuation prefills again: each running choice's prompt (its own
        sequence in the engine) and the ids the client has of it. `fallback_prompt_tokens` for a
        prompt whose token count the engine has not sent."""
        return sum(
            self.prompt_tokens.get(i // self.n, fallback_prompt_tokens) + len(self.ids.get(i, ()))
            for i in self.running()
        )

    def whole_usage(self, fallback_prompt_tokens: int) -> dict:
        """The whole request's usage from what the client received (the router ends the stream)."""
        prompts = sum(self.prompt_tokens.values()) if self.prompt_tokens else fallback_prompt_tokens
        out = sum(len(ids) for ids in self.ids.values())
        return {"prompt_tokens": prompts, "completion_tokens": out, "total_tokens": prompts + out}

    def _left_out(self) -> tuple[int, int]:
        """What a continuation's usage does not count: it runs the unfinished choices only, so it
        counts their prompts and outputs; the finished choices' outputs and the prompts none of
        whose choices still run are added back."""
        running = self.running()
        live_prompts = {i // self.n for i in running}
        prompt = sum(count for p, count in self.prompt_tokens.items() if p not in live_prompts)
        out = sum(len(ids) for i, ids in self.ids.items() if i not in running)
        return prompt, out

    async def feed(self, chunk: bytes) -> str | None:
        """Pass the complete events in `chunk` on; ENGINE_ERROR or ABORTED when the engine reported
        its own failure (that event is not passed on: another replica may go on)."""
        self._buf += chunk
        out = []
        broken = None
        while not broken and b"\n\n" in self._buf:
            raw, self._buf = self._buf.split(b"\n\n", 1)
            event, broken = self._event(raw)
            if event is not None:
                out.append(event + b"\n\n")
        if out:
            if self.resumed_at is not None:
                if self.on_resumed is not None:
                    self.on_resumed(time.perf_counter() - self.resumed_at)
                self.resumed_at = None
            self.events_out += len(out)
            await self.send(
                {"type": "http.response.body", "body": b"".join(out), "more_body": True}
            )
        return broken

    async def keep_alive(self) -> None:
        """An SSE comment while no replica can go on with the stream yet: the client, and any proxy
        between, sees the stream alive and what it waits for (SSE clients skip comments)."""
        if self.started:
            await self.send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": b": waiting for a replica to go on with this stream\n\n",
                }
            )

    async def end(self) -> None:
        """The stream is complete: what is left of it, then the end of the body."""
        if self._buf.strip():
            await self.send({"type": "http.response.body", "body": self._buf, "more_body": True})
        self._buf = b""
        await self.send({"type": "http.response.body", "body": b""})

    async def fail(self, event: dict) -> None:
        """End the client's stream with an error event and [DONE] (nothing is silently truncated)."""
        await self.send(
            {
                "type": "http.response.body",
                "more_body": True,
                "body": b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n",
            }
        )
        await self.send({"type": "http.response.body", "body": b""})

    async def close_choices(self, reasons: dict[int, str]) -> None:
        """End these choices here, as the engine would have: each one's last chunk (no text)."""
        events = []
        for i, reason in reasons.items():
            choice = (
                {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
                if self.chat
                else {"index": i, "text": "", "logprobs": None, "finish_reason": reason}
            )
            events.append(self._chunk([choice]))
            self.finish_reasons[i] = reason
        if events:
            await self.send({"type": "http.response.body", "body": _sse(events), "more_body": True})

    async def finish(self, reasons: dict[int, str], usage: dict | None) -> None:
        """End the stream here, as the engine would have: the last chunk of each choice in `reasons`,
        the usage chunk if the client asked for one, then [DONE]."""
        await self.close_choices(reasons)
        events = [{**self._chunk([]), "usage": usage}] if usage is not None else []
        await self.send(
            {"type": "http.response.body", "body": _sse(events) + DONE + b"\n\n", "more_body": True}
        )
        await self.send({"type": "http.response.body", "body": b""})

    @property
    def finished(self) -> bool:
        """Every choice finished (an index the request does not have counts for nothing)."""
        return not self.running()

    # -- one event ------------------------------------------------------------------------------------
    def _event(self, raw: bytes) -> tuple[bytes | None, str | None]:
        """The event as the client gets it (None: dropped), and whether it reports a failure."""
        if not raw.startswith(b"data: ") or raw.startswith(DONE):
            self.done = self.done or raw.startswith(DONE)
            return raw, None
        try:
            obj = json.loads(raw[6:])
        except ValueError:
            return raw, None
        if not isinstance(obj, dict):
            return raw, None
        if "error" in obj and not obj.get("choices"):
            return None, ENGINE_ERROR
        changed = self._completions and self._as_original(obj)
        changed |= self._identity(obj)
        if obj.get("usage"):
            changed |= self._whole_usage(obj["usage"])
            self.usage = obj["usage"]
        if isinstance(obj.get("prompt_token_ids"), list):  # chat: the response's one prompt
            self.prompt_tokens[0] = len(obj["prompt_token_ids"])
            self.prompt_ids[0] = obj["prompt_token_ids"]
        broken = None
        for choice in obj.get("choices") or ():
            changed |= self._choice(choice)
            if choice.get("finish_reason") == "abort":  # the engine's drain cut it: not an end
                choice["finish_reason"], changed, broken = None, True, ABORTED
        if self._preamble(obj) and self._restart:
            return None, broken
        if "prompt_token_ids" in obj and (not self.want_ids or self._restart):
            del obj["prompt_token_ids"]
            changed = True
        if broken and not self._has_content(obj):
            return None, broken
        if not changed:
            return raw, broken
        return b"data: " + json.dumps(
            obj, separators=(",", ":"), ensure_ascii=False
        ).encode(), broken

    def _as_original(self, obj: dict) -> bool:
        """A vLLM continuation's event as the original stream's: its prompt ids (the original's
        and the output so far) dropped, a chat stream's text as the chunk's delta."""
        obj.pop("prompt_token_ids", None)
        for choice in obj.get("choices") or ():
            choice.pop("prompt_token_ids", None)
        if self.chat:
            vllm_resume.as_chat_chunk(obj)
        return True

    def _identity(self, obj: dict) -> bool:
        """The first event sets the stream's id and created; later ones (a continuation's) keep them."""
        if self.id is None:
            self.id, self.created = obj.get("id"), obj.get("created")
            self.model, self.object = obj.get("model"), obj.get("object")
            return False
        changed = False
        if "id" in obj and obj["id"] != self.id:
            obj["id"], changed = self.id, True
        if "created" in obj and obj["created"] != self.created:
            obj["created"], changed = self.created, True
        return changed

    def _whole_usage(self, usage: dict) -> bool:
        """A continuation's usage, made the whole request's (see _left_out)."""
        prompt, out = self.usage_offset
        if not (prompt or out) or not isinstance(usage.get("prompt_tokens"), int):
            return False
        usage["prompt_tokens"] += prompt
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + out
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return True

    def _choice(self, choice: dict) -> bool:
        changed = False
        index = choice.get("index", 0)
        index = index if type(index) is int else 0
        if "token_ids" in choice:
            self.engine_sends_ids = True
            if isinstance(choice["token_ids"], list):
                self.ids.setdefault(index, []).extend(choice["token_ids"])
            if not self.want_ids:
                del choice["token_ids"]
                changed = True
        if isinstance(choice.get("prompt_token_ids"), list):  # completions: each choice's prompt
            self.prompt_tokens[index // self.n] = len(choice["prompt_token_ids"])
            self.prompt_ids[index // self.n] = choice["prompt_token_ids"]
        if "prompt_token_ids" in choice and (not self.want_ids or self._restart):
            del choice["prompt_token_ids"]
            changed = True
        if choice.get("finish_reason") not in (None, "abort"):
            self.finish_reasons[index] = choice["finish_reason"]
        return changed

    def _preamble(self, obj: dict) -> bool:
        """A chat role chunk the client already had (a restart's): dropped. One it has not had (the
        engine failed between the role chunks of several choices) goes out, and is remembered."""
        choices = obj.get("choices") or ()
        if not self.chat or len(choices) != 1:
            return False
        delta = choices[0].get("delta") or {}
        role = (
            "role" in delta
            and not delta.get("content")
            and not choices[0].get("token_ids")
            and not choices[0].get("finish_reason")
        )
        if not role:
            return False
        index = choices[0].get("index", 0)
        if index in self._roles_out:
            return True
        self._roles_out.add(index)
        return False

    @staticmethod
    def _has_content(obj: dict) -> bool:
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if (
                choice.get("text")
                or delta.get("content")
                or delta.get("tool_calls")
                or choice.get("token_ids")
            ):
                return True
        return False

    def _chunk(self, choices: list) -> dict:
        return {
            "id": self.id,
            "object": self.object or ("chat.completion.chunk" if self.chat else "text_completion"),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def _sse(events: list[dict]) -> bytes:
    return b"".join(
        b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events
    )
