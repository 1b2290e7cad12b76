"""A stand-in engine for tests, `kvmesh up --engine-command` and the router benchmark.

It speaks the engine's HTTP surface (contract 5) and KV-event stream (contract 2)
without a model: it tokenizes the prompt exactly like the engine, keeps an LRU "prefix
cache" of block keys (contract 1), reports `cached_tokens` from it, publishes
BlockStored / BlockRemoved / AllBlocksCleared with the contract keys, and answers with
`--response-tokens` fake tokens, `--token-delay` seconds apart: token i is " tok<i>", id i.
As the engine, a stream carries each chunk's `token_ids` when asked (`return_token_ids`), and
a continuation (`resume.output_token_ids`: the ids already sent) goes on from the next position.

LoRA, as the engine (kvmesh/mesh/stub_lora.py): `--lora-modules name=path ...` (or `--enable-lora`
and `/v1/load_lora_adapter`), a request's `model` naming an adapter (404 for an unknown one) keys its
blocks from the adapter's identity and publishes them with its `lora_id` and `lora_name`.

Test hooks: `GET /stub/stats` (requests, request ids and bodies seen, cancellations),
`POST /stub/config` (fail_status, fail_count, waiting, running_extra, token_delay, draining),
`POST /stub/reset_cache` (publishes AllBlocksCleared).

Admission, as the engine's (`kvmesh serve --max-num-seqs N --max-waiting M`): with
`--max-num-seqs` set, at most N requests generate at once, M more wait, and any request
beyond N + M is refused with 429, `Retry-After: 1` and the engine's error body (code
`queue_full`). `/stub/stats` counts `rejected` and the most ever admitted (`max_admitted`).

    python -m kvmesh.mesh.stub_engine --port 8101 --kv-events-endpoint tcp://127.0.0.1:5601
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
import uuid
from collections import OrderedDict
from typing import Any

from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE, block_keys
from kvmesh.common.cache_salt import InvalidCacheSalt, check_cache_salt
from kvmesh.common.chat_prompt import chat_request_prompt
from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.common.prompts import prompt_batch
from kvmesh.mesh.lora_args import lora_module
from kvmesh.mesh.stub_lora import StubAdapter, StubAdapters, UnknownModel


class StubEngine:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model = args.served_model_name or args.model
        self.block_size = args.block_size
        self.num_blocks = args.num_blocks
        self.encoder = None
        if not args.no_tokenize:
            from kvmesh.common.model_lookup import find_model_dir
            from kvmesh.common.tokenizer import KVMeshTokenizer
            from kvmesh.router.fast_tokenize import FastEncoder

            self.encoder = FastEncoder(
                KVMeshTokenizer(find_model_dir(args.tokenizer or args.model))
            )
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.lora = (
            StubAdapters(self.model, args.lora_modules, args.max_loras)
            if args.enable_lora or args.lora_modules
            else None
        )
        self.publisher = None
        if args.kv_events_endpoint:
            self.publisher = KVEventPublisher(
                args.kv_events_endpoint.replace("*", "0.0.0.0"), args.kv_events_replay_endpoint
            )
        self.start_time = time.time()
        self.running = 0
        self.queries = 0
        self.hits = 0
        self.cfg: dict[str, Any] = {
            "fail_status": 0,
            "fail_count": -1,
            "waiting": 0,
            "running_extra": 0,
            "token_delay": args.token_delay,
            "draining": False,
            "response_tokens": args.response_tokens,
            "kv_usage": None,
        }
        self.stats: dict[str, Any] = {
            "requests": 0,
            "cancelled": 0,
            "completed": 0,
            "request_ids": [],
            "last_body": None,
            "failed": 0,
            "rejected": 0,
            "max_admitted": 0,
        }
        # Admission (the engine's max_num_seqs running + max_waiting waiting); 0: unlimited.
        self.capacity = args.max_num_seqs + args.max_waiting if args.max_num_seqs > 0 else 0
        self.slots = asyncio.Semaphore(args.max_num_seqs) if args.max_num_seqs > 0 else None
        self.admitted = 0
        self.queued = 0

    # -- the prefix cache -------------------------------------------------------------------
    def admit(self, tokens: list[int], salt: str | None, adapter: StubAdapter | None = None) -> int:
        """Match, then insert, the prompt's full blocks; publish events. Returns cached tokens."""
        identity = self.lora.identity(adapter) if self.lora else self.model
        keys = block_keys(tokens, identity, self.block_size, cache_salt=salt)
        matched = 0
        for k in keys:
            if k not in self.cache:
                break
            matched += 1
        self.queries += len(tokens)
        self.hits += matched * self.block_size
        events: list[Any] = []
        new_from = None
        for i, k in enumerate(keys):
            if k in self.cache:
                self.cache.move_to_end(k)
            else:
                if new_from is None:
                    new_from = i
                self.cache[k] = None
        if new_from is not None:
            bs = self.block_size
            events.append(
                BlockStored(
                    keys[new_from:],
                    keys[new_from - 1] if new_from else None,
                    tokens[new_from * bs : len(keys) * bs],
                    bs,
                    adapter.int_id if adapter else None,
                    None,
                    adapter.name if adapter else None,
                )
            )
        evicted = []
        while len(self.cache) > self.num_blocks:
            evicted.append(self.cache.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(evicted, None))
        if events and self.publisher:
            self.publisher.publish(events)
        return matched * self.block_size

    def _token_delay(self) -> float:
        jitter = min(1.0, max(0.0, getattr(self.args, "token_jitter", 0.0)))
        delay = self.cfg["token_delay"]
        return delay * random.uniform(1 - jitter, 1 + jitter) if jitter else delay

    def reset_cache(self) -> None:
        self.cache.clear()
        if self.publisher:
            self.publisher.publish([AllBlocksCleared()])

    def metrics(self) -> str:
        usage = self.cfg["kv_usage"]
        if usage is None:
            usage = len(self.cache) / max(1, self.num_blocks)
        label = f'{{model_name="{self.model}"}}'
        return "\n".join(
            [
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{label} {usage}",
                f"vllm:num_requests_running{label} {self.running + self.cfg['running_extra']}",
                f"vllm:num_requests_waiting{label} {self.cfg['waiting'] + self.queued}",
                f"vllm:prefix_cache_queries_total{label} {self.queries}",
                f"vllm:prefix_cache_hits_total{label} {self.hits}",
                f'vllm:cache_config_info{{block_size="{self.block_size}",num_gpu_blocks="{self.num_blocks}"}} 1.0',
                f"process_start_time_seconds {self.start_time}",
                *([self.lora.metrics_line()] if self.lora else []),
                "",
            ]
        )

    # -- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self.publisher:
                        self.publisher.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if path == "/health":
            return await _json(send, 200, {"status": "ok"})
        if path == "/ready":
            if self.cfg["draining"]:
                return await _json(send, 503, {"status": "draining"})
            return await _json(send, 200, {"status": "ready"})
        if path == "/metrics":
            return await _send(send, 200, self.metrics().encode(), b"text/plain; version=0.0.4")
        if path == "/v1/models":
            return await _json(
                send,
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": self.model, "object": "model", "owned_by": "kvmesh"},
                        *(self.lora.cards() if self.lora else []),
                    ],
                },
            )
        if path == "/stub/stats":
            return await _json(
                send,
                200,
                {
                    **self.stats,
                    "cache_blocks": len(self.cache),
                    "running": self.running,
                    "pid": os.getpid(),
                },
            )
        if path == "/stub/config" and method == "POST":
            self.cfg.update(json.loads(body or b"{}"))
            return await _json(send, 200, self.cfg)
        if path == "/stub/reset_cache" and method == "POST":
            self.reset_cache()
            return await _json(send, 200, {"ok": True})
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and method == "POST":
            return await self.lora_admin(path, body, send)
        if path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
            return await self.generate(path, scope, body, receive, send)
        if path == "/tokenize" and method == "POST":
            try:  # what the engine cannot read or render is its 400
                req = json.loads(body or b"{}")
                tokens = (
                    self.chat_ids(req)
                    if req.get("messages") is not None
                    else self.encoder.encode(req.get("prompt") or "")
                )
            except Exception as exc:  # noqa: BLE001
                return await _json(send, 400, _error(f"cannot tokenize: {exc}", "prompt"))
            return await _json(
                send,
                200,
                {"count": len(tokens), "max_model_len": 8192, "tokens": tokens, "token_strs": None},
            )
        if path == "/detokenize" and method == "POST":
            try:
                tokens = json.loads(body)["tokens"]
                text = self.encoder.tok.decode([int(t) for t in tokens], skip_special_tokens=False)
            except Exception as exc:  # noqa: BLE001
                return await _json(send, 400, _error(f"cannot detokenize: {exc}", "tokens"))
            return await _json(send, 200, {"prompt": text})
        return await _json(send, 404, _error(f"no route {path}", None, "not_found"))

    async def lora_admin(self, path: str, body: bytes, send):
        """vLLM's dynamic adapters: load {lora_name, lora_path}, unload {lora_name}."""
        if self.lora is None:
            return await _json(send, 404, _error("LoRA is not enabled", None, "not_found"))
        try:
            req = json.loads(body or b"{}")
            name = req["lora_name"]
            if path.endswith("/load_lora_adapter"):
                self.lora.load(name, str(req["lora_path"]))
                return await _send(send, 200, f"Success: LoRA adapter '{name}' added.".encode())
        except (ValueError, KeyError, TypeError) as exc:
            return await _json(send, 400, _error(f"cannot load the adapter: {exc}", "lora_name"))
        if not self.lora.unload(name):
            msg = f"The lora adapter '{name}' cannot be found."
            return await _json(send, 404, _error(msg, "lora_name", None, "NotFoundError"))
        return await _send(send, 200, f"Success: LoRA adapter '{name}' removed.".encode())

    async def generate(self, path, scope, body, receive, send):
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if self.args.api_key and headers.get("authorization") != f"Bearer {self.args.api_key}":
            return await _json(
                send, 401, _error("bad api key", None, "invalid_api_key", "authentication_error")
            )
        self.stats["requests"] += 1
        rid = headers.get("x-request-id")
        self.stats["request_ids"] = (self.stats["request_ids"] + [rid])[-100:]
        fail = self.cfg["fail_status"]
        if fail and self.cfg["fail_count"] != 0:
            self.cfg["fail_count"] -= 1
            self.stats["failed"] += 1
            return await _json(
                send,
                fail,
                _error("stub failure", None, "stub_failure", "server_error"),
                [(b"retry-after", b"1")] if fail in (429, 503) else (),
            )
        if self.cfg["draining"]:
            return await _json(send, 503, _error("draining", None, None, "service_unavailable"))
        try:
            req = json.loads(body)
        except ValueError:
            return await _json(send, 400, _error("bad json", None, "invalid_json"))
        if not isinstance(req, dict):
            return await _json(send, 400, _error("request body must be a JSON object"))
        try:
            adapter = self.lora.resolve(req.get("model")) if self.lora else None
        except UnknownModel as exc:
            return await _json(send, 404, _error(str(exc), "model", None, "NotFoundError"))
        self.stats["last_body"] = req if len(body) < 20000 else {"truncated": True}
        if self.capacity and self.admitted >= self.capacity:
            self.stats["rejected"] += 1
            return await _json(
                send,
                429,
                {
                    "error": {
                        "message": f"the server is at capacity ({self.capacity} requests admitted: {self.args.max_num_seqs} "
                        f"running + {self.args.max_waiting} waiting); retry later",
                        "type": "rate_limit_error",
                        "param": None,
                        "code": "queue_full",
                    }
                },
                [(b"retry-after", b"1")],
            )
        self.admitted += 1
        self.stats["max_admitted"] = max(self.stats["max_admitted"], self.admitted)
        try:
            if self.slots is not None:
                self.queued += 1
                try:
                    await self.slots.acquire()
                finally:
                    self.queued -= 1
            try:
                await self._generate(path, req, rid, receive, send, adapter)
            finally:
                if self.slots is not None:
                    self.slots.release()
        finally:
            self.admitted -= 1

    def chat_ids(self, req: dict) -> list[int]:
        """A chat request's prompt ids, rendered as the engine renders it (tools included)."""
        messages, template_vars = chat_request_prompt(req, self.encoder.tok.chat_template)
        return self.encoder.encode_chat(
            messages,
            req.get("add_generation_prompt", True),
            bool(req.get("continue_final_message")),
            template_vars,
        )

    async def _generate(self, path, req, rid, receive, send, adapter=None):
        chat = path.endswith("chat/completions")
        tokens: list[int] = []
        try:  # the engine refuses what it cannot read (a message it cannot render): its 400
            if self.encoder is not None:
                if chat:
                    tokens = self.chat_ids(req)
                else:  # a batch: its first prompt (the one the router routes on)
                    prompt = prompt_batch(req.get("prompt") or "")[0]
                    tokens = (
                        [int(t) for t in prompt]
                        if isinstance(prompt, list)
                        else self.encoder.encode(prompt)
                    )
            n_out = int(req.get("max_tokens") or self.cfg["response_tokens"])
            try:
                salt = check_cache_salt(req.get("cache_salt"))
            except InvalidCacheSalt as exc:
                return await _json(send, 400, _error(str(exc), "cache_salt"))
        except Exception as exc:  # noqa: BLE001
            return await _json(
                send, 400, _error(f"invalid request: {exc}", "messages" if chat else "prompt")
            )
        cached = self.admit(tokens, salt, adapter) if tokens else 0
        served = adapter.name if adapter else self.model
        n_out = min(n_out, self.cfg["response_tokens"])
        resumed = (
            (req.get("resume") or {}).get("output_token_ids")
            if isinstance(req.get("resume"), dict)
            else None
        )
        first = (
            len(resumed) if isinstance(resumed, list) else 0
        )  # a continuation starts after what was sent
        if first >= n_out:
            return await _json(
                send, 400, _error("nothing left to generate", "resume.output_token_ids")
            )
        with_ids = req.get("return_token_ids") is True
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": n_out,
            "total_tokens": len(tokens) + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        created = int(time.time())
        cid = ("chatcmpl-" if chat else "cmpl-") + (rid or uuid.uuid4().hex)
        self.running += 1
        if self.lora:
            self.lora.started(adapter)
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            if req.get("stream"):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream"),
                            (b"cache-control", b"no-cache"),
                        ],
                    }
                )
                for i in range(first, n_out):
                    if watcher.done():
                        raise asyncio.CancelledError
                    if self.cfg["token_delay"]:
                        await asyncio.wait({watcher}, timeout=self._token_delay())
                        if watcher.done():
                            raise asyncio.CancelledError
                    text = f" tok{i}"
                    if chat:
                        chunk = {
                            "id": cid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": served,
                            "choices": [
                                {"index": 0, "delta": {"content": text}, "finish_reason": None}
                            ],
                        }
                    else:
                        chunk = {
                            "id": cid,
                            "object": "text_completion",
                            "created": created,
                            "model": served,
                            "choices": [{"index": 0, "text": text, "finish_reason": None}],
                        }
                    if with_ids:
                        chunk["choices"][0]["token_ids"] = [i]
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                            "more_body": True,
                        }
                    )
                final = {
                    "id": cid,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": served,
                    "choices": [
                        {
                            "index": 0,
                            **({"delta": {}} if chat else {"text": ""}),
                            "finish_reason": "length",
                        }
                    ],
                }
                options = req.get("stream_options")
                if isinstance(options, dict) and options.get("include_usage"):
                    final["usage"] = usage
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n",
                    }
                )
                await send({"type": "http.response.body", "body": b""})
            else:
                if self.cfg["token_delay"]:
                    await asyncio.wait({watcher}, timeout=self.cfg["token_delay"] * n_out)
                    if watcher.done():
                        raise asyncio.CancelledError
                text = "".join(f" tok{i}" for i in range(n_out))
                if chat:
                    choice = {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length",
                    }
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": text, "finish_reason": "length"}
                    obj = "text_completion"
                await _json(
                    send,
                    200,
                    {
                        "id": cid,
                        "object": obj,
                        "created": created,
                        "model": served,
                        "choices": [choice],
                        "usage": usage,
                    },
                )
            self.stats["completed"] += 1
        except (asyncio.CancelledError, OSError):
            self.stats["cancelled"] += 1
        finally:
            self.running -= 1
            if self.lora:
                self.lora.finished(adapter)
            watcher.cancel()


def _error(
    message: str,
    param: str | None = None,
    code: str | None = None,
    etype: str = "invalid_request_error",
) -> dict[str, Any]:
    """The engine's error body."""
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


async def _wait_disconnect(receive):
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _send(send, status: int, body: bytes, ctype: bytes = b"application/json", headers=()):
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _json(send, status: int, obj: Any, headers=()):
    await _send(send, status, json.dumps(obj).encode(), headers=headers)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="kvmesh-stub-engine", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--tokenizer", default=None, help="model dir for the tokenizer (default: from --model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--num-blocks", "--num-kv-blocks", dest="num_blocks", type=int, default=512)
    p.add_argument("--kv-events-endpoint", default=None)
    p.add_argument("--kv-events-replay-endpoint", default=None)
    p.add_argument("--response-tokens", type=int, default=8)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument(
        "--token-jitter",
        type=float,
        default=0.0,
        help="each streamed token's delay drawn from token-delay x [1-J, 1+J] (0: exact); as a "
        "real engine's, streams then end at scattered times rather than in lockstep",
    )
    p.add_argument("--api-key", default=os.environ.get("KVMESH_STUB_API_KEY"))
    p.add_argument(
        "--no-tokenize", action="store_true", help="skip tokenization and the prefix cache"
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=0,
        help="requests generated at once, as the engine's (0: unlimited, no admission limit)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=0,
        help="requests waiting for a slot; beyond max-num-seqs + max-waiting: 429 (as the engine)",
    )
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (as vLLM)")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters loaded at start (their digest: the directory's adapter files, else the name)",
    )
    p.add_argument("--max-loras", type=int, default=1, help="lora_requests_info's max_lora")
    p.add_argument("--max-lora-rank", type=int, default=16, help="accepted, as the engine's")
    # The KV tier flags, accepted as the engine's: the stub keeps no tier beyond its cache.
    p.add_argument("--kv-offloading-size", type=float, default=None, help="accepted, ignored")
    p.add_argument("--kv-shared-dir", default=None, help="accepted, ignored")
    p.add_argument("--kv-shared-size", type=float, default=None, help="accepted, ignored")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    engine = StubEngine(args)
    config = uvicorn.Config(
        engine, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    print(f"stub engine {engine.model} listening on {args.host}:{args.port}", flush=True)
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
