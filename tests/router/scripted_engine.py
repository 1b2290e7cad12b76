"""A scripted engine on loopback HTTP that keeps the engine's resume contract exactly and fails where a test says.

Its "model" is a pure function: a choice's next id is a hash of its prompt's ids, the ids it has
generated so far and, when seeded, `seed + j` (j: the choice's place among its prompt's n), so a
continuation that goes on from the wrong ids, or under the wrong index, writes other ids than the
uninterrupted run. Token id t reads " w<t>". It speaks what the router relies on
(docs/engine-server.md, "Mid-stream resume"): `return_token_ids` (completions: `prompt_token_ids`
on each choice's first chunk; chat: on the first role chunk), `resume.output_token_ids` and
`resume.choices` (counted against max_tokens, stop strings over the whole output, no role chunk;
no prompt ids and no echo for a choice that goes on from ids, both for one started from nothing;
completions' `text_offset` going on after the text the client has, its echo included; a usage
counting the continued choices' prompts once and their whole outputs), `n`, a batch of prompts,
`echo`, `logprobs`, stop strings, `stream_options.include_usage`, non-streamed answers.

A `Script` shared by the engines of a test says how the k-th request they receive (in order of
arrival) fails: its connection cut after a number of data events, an error event, or its drain's
`abort`; every body received is kept, to pin the continuations the router sent.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from dataclasses import dataclass, field

VOCAB = 97
CUT = "cut"  # the connection closes (the engine process died)
ERROR = "error"  # an error event in the stream (the engine's own failure)
ABORT = "abort"  # the choice's chunk says finish_reason "abort" (its drain timed out)


@dataclass(frozen=True)
class Failure:
    """After `after` data events (0: before the status line, with CUT), fail as `how`."""

    after: int
    how: str = CUT


@dataclass
class Script:
    failures: list[Failure | None] = field(
        default_factory=list
    )  # by request number: None runs whole
    bodies: list[dict] = field(default_factory=list)  # every request body, in order of arrival
    send_ids: bool = True  # False: an engine that ignores return_token_ids
    finish_apart: bool = False  # "length" in a chunk of its own, after the budget's last id
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: dict) -> Failure | None:
        with self.lock:
            k = len(self.bodies)
            self.bodies.append(body)
            return self.failures[k] if k < len(self.failures) else None


def token_text(t: int) -> str:
    return f" w{t}"


def prompt_ids(text: str) -> list[int]:
    """A prompt's ids: one per word (stable, whatever the router's tokenizer)."""
    return [zlib.crc32(w.encode()) % VOCAB for w in text.split()] or [1]


def next_id(prompt: list[int], out: list[int], seed: int | None) -> int:
    return zlib.crc32(json.dumps([prompt, out, seed]).encode()) % VOCAB


def logprob(t: int) -> float:
    return -round(0.05 + (t % 10) / 10, 2)


@dataclass
class Choice:
    index: int
    prompt_index: int
    prompt_text: str
    prompt: list[int]
    seed: int | None
    out: list[int]  # ids so far (a continuation's resumed ids first)
    resumed: int  # how many of `out` the client had before this request
    sent_text: int = 0  # characters of text the client has (completions' text_offset)
    finish: str | None = None


class ScriptedEngine:
    """An ASGI app; `serve()` runs it on a loopback port in a thread."""

    def __init__(self, script: Script, name: str = "e0"):
        self.script = script
        self.name = name

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/ready" or path == "/health":
            return await _json(send, 200, {"status": "ok"})
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        req = json.loads(body)
        failure = self.script.take(req)
        rid = dict(scope["headers"]).get(b"x-request-id", b"r").decode()
        chat = path.endswith("chat/completions")
        if failure is not None and failure.after == 0 and failure.how == CUT:
            raise ConnectionResetError("scripted: the engine died before answering")
        choices = self.choices(req, chat)
        if req.get("stream"):
            return await self.stream(send, req, chat, choices, rid, failure)
        if failure is not None:
            raise ConnectionResetError("scripted: the engine died while generating")
        return await self.whole(send, req, chat, choices, rid)

    # -- the request's choices ------------------------------------------------------------------
    def choices(self, req: dict, chat: bool) -> list[Choice]:
        if chat:
            prompts = [" ".join(str(m.get("content")) for m in req["messages"])]
        else:
            p = req["prompt"]
            prompts = p if isinstance(p, list) else [p]
        n = req.get("n") or 1
        seed = req.get("seed")
        resume = req.get("resume") or {}
        plan = None
        if "output_token_ids" in resume:
            plan = {0: resume["output_token_ids"]}
        elif "choices" in resume:
            plan = {c["index"]: c["output_token_ids"] for c in resume["choices"]}
        out = []
        for p, text in enumerate(prompts):
            for j in range(n):
                index = p * n + j
                if plan is not None and index not in plan:
                    continue
                done = list(plan[index]) if plan is not None else []
                c = Choice(
                    index,
                    p,
                    text,
                    prompt_ids(text),
                    None if seed is None else seed + j,
                    done,
                    len(done),
                )
                c.sent_text = len("".join(token_text(t) for t in done))
                if done and req.get("echo") and not chat:  # the client had its echo too
                    c.sent_text += len(text)
                out.append(c)
        return out

    def step(self, c: Choice, req: dict) -> tuple[int, str, str | None]:
        """The choice's next id, its text as sent, and its finish reason (None: runs on)."""
        t = next_id(c.prompt, c.out, c.seed)
        c.out.append(t)
        whole = "".join(token_text(x) for x in c.out)
        stops = req.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        text = token_text(t)
        if any(whole.endswith(s) for s in stops):
            c.finish, text = "stop", ""  # the stop string is not sent (one token's text)
        elif len(c.out) >= max_tokens(req):
            c.finish = "length"
        return t, text, c.finish

    # -- a stream ---------------------------------------------------------------------------------
    async def stream(self, send, req, chat, choices, rid, failure):
        ids_on = req.get("return_token_ids") is True and self.script.send_ids
        continuation = "resume" in req
        usage_on = bool((req.get("stream_options") or {}).get("include_usage"))
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time() * 1000) % 1_000_000_000,  # the continuation's own
            "model": "tiny",
        }
        sent = 0
        running = list(choices)

        async def fail_here() -> None:
            """The scripted failure, once `failure.after` events went out (ABORT: on the next one)."""
            if failure is None or sent != failure.after or failure.how == ABORT:
                return
            if failure.how == ERROR:
                await _event(send, {"error": {"message": "scripted", "code": "engine_error"}})
                await _event(send, "[DONE]")
                await send({"type": "http.response.body", "body": b""})
                raise _Aborted
            raise ConnectionResetError("scripted: the engine died mid-stream")

        async def emit(obj) -> None:
            nonlocal sent
            await fail_here()
            event = {**head, **obj}
            if usage_on and "usage" not in event:
                event["usage"] = None
            if failure is not None and failure.how == ABORT and sent == failure.after and running:
                await self.abort(send, head, chat, running, ids_on)
                raise _Aborted
            await _event(send, event)
            sent += 1

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        try:
            if chat and not continuation:
                for k, c in enumerate(choices):
                    ch = {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    obj = {"choices": [ch]}
                    if ids_on:
                        ch["token_ids"] = []
                        if k == 0:
                            obj["prompt_token_ids"] = list(c.prompt)
                    await emit(obj)
            # a choice's first chunk (echo, prompt ids): not again for one going on from its ids
            first = {c.index: not c.resumed for c in choices}
            while running:
                for c in list(running):
                    t, text, finish = self.step(c, req)
                    apart = finish == "length" and self.script.finish_apart
                    ch = self.stream_choice(
                        c, req, chat, t, text, None if apart else finish, first[c.index]
                    )
                    if ids_on:
                        ch["token_ids"] = [t]
                        if first[c.index] and not chat:
                            ch["prompt_token_ids"] = list(c.prompt)
                    first[c.index] = False
                    await emit({"choices": [ch]})
                    if apart:
                        end = (
                            {"index": c.index, "delta": {}, "logprobs": None}
                            if chat
                            else {"index": c.index, "text": "", "logprobs": None}
                        )
                        end["finish_reason"] = finish
                        if ids_on:
                            end["token_ids"] = []
                        await emit({"choices": [end]})
                    if finish is not None:
                        running.remove(c)
            if usage_on:
                await emit({"choices": [], "usage": usage(choices)})
            await fail_here()
        except _Aborted:
            return
        await _event(send, "[DONE]")
        await send({"type": "http.response.body", "body": b""})

    async def abort(self, send, head, chat, running, ids_on) -> None:
        """A drain's end of the running choices: each its "abort" chunk (no new text), then [DONE]."""
        for c in running:
            ch = {"index": c.index, "logprobs": None, "finish_reason": "abort"}
            ch.update({"delta": {}} if chat else {"text": ""})
            if ids_on:
                ch["token_ids"] = []
            await _event(send, {**head, "choices": [ch]})
        await _event(send, "[DONE]")
        await send({"type": "http.response.body", "body": b""})

    def stream_choice(self, c, req, chat, t, text, finish, first) -> dict:
        lp_on = req.get("logprobs") if not chat else req.get("logprobs") is True
        if chat:
            ch = {"index": c.index, "delta": {"content": text} if text or not finish else {}}
            ch["logprobs"] = (
                {"content": [{"token": token_text(t), "logprob": logprob(t), "top_logprobs": []}]}
                if lp_on
                else None
            )
        else:
            prefix = c.prompt_text if req.get("echo") and first else ""
            ch = {"index": c.index, "text": prefix + text}
            if lp_on:
                entries = [(x, None) for x in c.prompt] if prefix else []
                entries.append((t, logprob(t)))
                offsets, at = [], c.sent_text
                for x, _ in entries:
                    offsets.append(at)
                    at += len(token_text(x))
                ch["logprobs"] = {
                    "tokens": [token_text(x) for x, _ in entries],
                    "token_logprobs": [v for _, v in entries],
                    "text_offset": offsets,
                }
            else:
                ch["logprobs"] = None
            c.sent_text += len(prefix + text)
        ch["finish_reason"] = finish
        return ch

    # -- a whole answer -----------------------------------------------------------------------------
    async def whole(self, send, req, chat, choices, rid):
        out = []
        for c in choices:
            text = c.prompt_text if (req.get("echo") and not chat) else ""
            while c.finish is None:
                _, piece, _ = self.step(c, req)
                text += piece
            item = {"index": c.index, "finish_reason": c.finish}
            if chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            out.append(item)
        obj = {
            "id": ("chatcmpl-" if chat else "cmpl-") + rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": 1,
            "model": "tiny",
            "choices": out,
            "usage": usage(choices),
        }
        await _json(send, 200, obj)

    def serve(self):
        return ScriptedServer(self)


class _Aborted(Exception):
    """The scripted drain ended the stream (its events went out whole)."""


def max_tokens(req: dict) -> int:
    return req.get("max_completion_tokens") or req.get("max_tokens") or 16


def usage(choices: list[Choice]) -> dict:
    """The prompts of the choices run, once each; their whole outputs (resumed ids too)."""
    prompts = {}
    for c in choices:
        prompts.setdefault(c.prompt_index, c)
    p = sum(len(c.prompt) for c in prompts.values())
    o = sum(len(c.out) for c in choices)
    return {"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o}


async def _event(send, obj) -> None:
    data = "[DONE]" if obj == "[DONE]" else json.dumps(obj)
    await send(
        {"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True}
    )


async def _json(send, status: int, obj) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


class ScriptedServer:
    """The engine behind a minimal HTTP/1.1 server (chunked bodies, one request per connection)
    in a daemon thread: an exception out of the app closes the connection as a dead process's
    would, before the status line or mid-body (without the last chunk), after what went out."""

    def __init__(self, app: ScriptedEngine):
        from kvmesh.common.ports import free_port

        self.app = app
        self.name = app.name
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        if not started.wait(10):
            raise RuntimeError("scripted engine did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        started.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = [
            (k.strip().lower().encode(), v.strip().encode())
            for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
        ]
        size = int(dict(headers).get(b"content-length", b"0"))
        body = await reader.readexactly(size) if size else b""
        scope = {"type": "http", "method": method, "path": target.split("?")[0], "headers": headers}

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg):
            if msg["type"] == "http.response.start":
                out = [f"HTTP/1.1 {msg['status']} OK".encode()]
                out += [k + b": " + v for k, v in msg.get("headers", [])]
                out += [b"transfer-encoding: chunked", b"connection: close"]
                writer.write(b"\r\n".join(out) + b"\r\n\r\n")
                return
            data = msg.get("body", b"")
            if data:
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            if not msg.get("more_body"):
                writer.write(b"0\r\n\r\n")
            await writer.drain()

        try:
            await self.app(scope, receive, send)
        except Exception:  # noqa: BLE001 - scripted: the engine died, its socket closed by its kernel
            pass
        try:
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
