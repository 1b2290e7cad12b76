"""Structured outputs online: the same JSON requests against any OpenAI-compatible servers.

Chat completions at concurrency 16, streamed, greedy, a fixed max_tokens. Every prompt asks for a
JSON document and is sent twice: once with `response_format: {"type": "json_schema", ...}` on its
schema, once unconstrained. The schemas are bench/structured_backends.py's (`flat`, `nested`,
`anyof_ref`) plus two here (`order`, `event`: nested objects, enums, bounded arrays, required fields).

Per server: output tok/s of the whole run; the constrained requests' schema-valid share (the reply
parsed as JSON and validated with jsonschema; a reply cut by max_tokens before its document closes
counts as invalid and is also shown on its own; a request the server refuses is counted, not fatal);
p50 TTFT and latency of the constrained and the unconstrained requests. With two servers or more, the
first one's figures over each other's. Servers are benchmarked one after another; to run one at a
time (the other stopped), save each run with --results FILE: the ratios then cover every server saved
there with the same workload, the first saved one over the others (a name run again keeps its place).

    python -P bench/structured_online.py --url kvmesh=http://127.0.0.1:8000 --url vllm=http://127.0.0.1:8001 \\
        [--model smollm2-135m-instruct] [--requests 64] [--max-tokens 128] [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.structured_backends

from bench.structured_backends import SCHEMAS as COMPILE_SCHEMAS  # noqa: E402

CONCURRENCY = 16
SCHEMAS = {
    **COMPILE_SCHEMAS,
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "country": {"enum": ["FR", "DE", "US", "JP", "BR"]},
                },
                "required": ["name", "country"],
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                    },
                    "required": ["product", "quantity"],
                },
            },
            "status": {"enum": ["pending", "shipped", "delivered"]},
        },
        "required": ["order_id", "customer", "items", "status"],
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
            "attendees": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": 2,
                "maxItems": 4,
            },
            "online": {"type": "boolean"},
        },
        "required": ["title", "day", "attendees", "online"],
    },
}
# What each schema's prompt asks for, with a subject that varies per request.
ASKS = {
    "flat": "Give a person named after {subject} as a JSON object with a string field name and an integer field age.",
    "nested": "Describe a user of a {subject} forum as a JSON object: a user object with an integer id, a list of "
    "tags and a kind (a, b or c), and a non-negative score.",
    "anyof_ref": "Give a JSON object about {subject}: field v is a lowercase word, an integer or null, and field "
    "items is a list of one to four objects with a number x.",
    "order": "Write a customer order for {subject} as JSON: order_id, customer (name and country, one of FR, DE, "
    "US, JP, BR), one to three items with product and quantity, and status (pending, shipped or delivered).",
    "event": "Plan a meeting about {subject} as JSON: title, day (mon to sun), two to four attendee names, and "
    "whether it is online.",
}
SUBJECTS = [
    "Paris",
    "gardening",
    "chess",
    "a bakery",
    "jazz",
    "the ocean",
    "robots",
    "winter",
    "football",
    "coffee",
    "a library",
    "volcanoes",
    "trains",
    "tea",
    "mountains",
    "a museum",
]


@dataclass
class Request:
    schema_name: str
    prompt: str
    constrained: bool


@dataclass
class Reply:
    request: Request
    refused: str = ""  # the server's error, when it did not run the request
    text: str = ""
    finish_reason: str | None = None
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0


def workload(num_requests: int) -> list[Request]:
    """Pairs of one prompt, unconstrained then constrained, cycling through the schemas."""
    names = list(SCHEMAS)
    reqs = []
    for i in range(num_requests):
        pair = i // 2
        name = names[pair % len(names)]
        subject = SUBJECTS[(pair // len(names)) % len(SUBJECTS)]
        reqs.append(
            Request(
                name, ASKS[name].format(subject=subject) + " Reply with the JSON only.", i % 2 == 1
            )
        )
    return reqs


def request_body(req: Request, model: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": req.prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": req.schema_name,
                "schema": SCHEMAS[req.schema_name],
                "strict": True,
            },
        }
    return body


def verdict(reply: Reply) -> str:
    """refused | valid | cut (finish_reason length before the document closed) | invalid."""
    if reply.refused:
        return "refused"
    try:
        doc = json.loads(reply.text)
    except json.JSONDecodeError:
        return "cut" if reply.finish_reason == "length" else "invalid"
    try:
        jsonschema.validate(doc, SCHEMAS[reply.request.schema_name])
    except jsonschema.ValidationError:
        return "invalid"
    return "valid"


async def send(session: aiohttp.ClientSession, url: str, body: dict, req: Request) -> Reply:
    reply = Reply(req)
    start = time.perf_counter()
    parts = []
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            reply.refused = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return reply
        async for raw in resp.content:  # one SSE line at a time
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                reply.refused = f"stream error: {str(chunk['error'])[:300]}"
                return reply
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if not parts:
                        reply.ttft = time.perf_counter() - start
                    parts.append(content)
                reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
            if chunk.get("usage"):
                reply.output_tokens = chunk["usage"]["completion_tokens"]
    reply.latency = time.perf_counter() - start
    reply.text = "".join(parts)
    return reply


async def run(
    url: str, model: str, reqs: list[Request], max_tokens: int, concurrency: int
) -> tuple[list[Reply], float]:
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def limited(req: Request) -> Reply:
            async with sem:
                return await send(session, url, request_body(req, model, max_tokens), req)

        start = time.perf_counter()
        replies = await asyncio.gather(*(limited(r) for r in reqs))
        return list(replies), time.perf_counter() - start


async def wait_ready(url: str, timeout: float) -> None:
    """Until GET /v1/models answers 200: a server still starting refuses connections or answers 503."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.get(url + "/v1/models") as resp:
                    if resp.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready after {timeout:.0f} s")
            await asyncio.sleep(1)


def _p50_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 1) if values else None


def summarize(replies: list[Reply], seconds: float) -> dict:
    """The run's figures (a JSON-ready dict)."""
    out = {
        "seconds": round(seconds, 2),
        "output_tok_s": round(sum(r.output_tokens for r in replies) / seconds, 1),
    }
    for side, constrained in (("constrained", True), ("unconstrained", False)):
        group = [r for r in replies if r.request.constrained == constrained]
        counts = {v: 0 for v in ("valid", "invalid", "cut", "refused")}
        for r in group:
            counts[verdict(r)] += 1
        ran = [r for r in group if not r.refused]
        out[side] = {
            "requests": len(group),
            **counts,
            "valid_share": round(counts["valid"] / max(len(group), 1), 3),
            "ttft_p50_ms": _p50_ms([r.ttft for r in ran if r.ttft]),
            "latency_p50_ms": _p50_ms([r.latency for r in ran]),
        }
        refusals = [r.refused for r in group if r.refused]
        if refusals:
            out[side]["first_refusal"] = refusals[0]
    return out


def report_lines(name: str, s: dict) -> list[str]:
    lines = [f"{name}: {s['output_tok_s']} output tok/s ({s['seconds']} s)"]
    for side in ("constrained", "unconstrained"):
        g = s[side]
        lines.append(
            f"  {side:13s} schema-valid {g['valid']}/{g['requests']} ({g['valid_share']:.0%}); "
            f"cut by max_tokens {g['cut']}, invalid {g['invalid']}, refused {g['refused']}; "
            f"p50 TTFT {g['ttft_p50_ms']} ms, latency {g['latency_p50_ms']} ms"
        )
        if g.get("first_refusal"):
            lines.append(f"  {'':13s} first refusal: {g['first_refusal']}")
    return lines


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def ratio_lines(first: str, other: str, runs: dict) -> list[str]:
    a, b = runs[first], runs[other]
    parts = [f"output tok/s {_ratio(a['output_tok_s'], b['output_tok_s'])}"]
    for side in ("constrained", "unconstrained"):
        for metric in ("ttft_p50_ms", "latency_p50_ms"):
            parts.append(
                f"{side} {metric.removesuffix('_ms').replace('_', ' ')} "
                f"{_ratio(a[side][metric], b[side][metric])}"
            )
    return [
        f"ratio {first}/{other}: " + ", ".join(parts),
        f"schema-valid share {first} {a['constrained']['valid_share']:.0%}, "
        f"{other} {b['constrained']['valid_share']:.0%}",
    ]


def parse_urls(values: list[str]) -> dict[str, str]:
    urls = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--url {value!r}: expected NAME=http://host:port")
        if name in urls:
            raise ValueError(f"--url {value!r}: the name {name!r} is given twice")
        urls[name] = url.rstrip("/")
    return urls


def load_results(path: Path | None, settings: dict) -> dict:
    """The runs saved in path with the same workload settings (a file of others is an error)."""
    if path is None or not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved.get("settings") != settings:
        raise ValueError(
            f"--results {path}: saved with {saved.get('settings')}, this run is {settings}"
        )
    return saved["runs"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--url",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="a server to benchmark (repeat; run in this order; the first is the ratios' numerator)",
    )
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the served model name")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY)
    ap.add_argument(
        "--warmup", type=int, default=2, help="requests sent (unmeasured) before each server's run"
    )
    ap.add_argument(
        "--ready-timeout",
        type=float,
        default=900,
        help="seconds to wait for each server to be ready",
    )
    ap.add_argument(
        "--results",
        type=Path,
        help="JSON file: this run's figures are added to the runs saved there",
    )
    args = ap.parse_args(argv)
    for flag in ("requests", "max_tokens", "concurrency"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        urls = parse_urls(args.url)
        settings = {
            "model": args.model,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
        }
        runs = load_results(args.results, settings)
    except ValueError as exc:
        ap.error(str(exc))

    reqs = workload(args.requests)
    print(
        f"{len(reqs)} chat requests ({sum(r.constrained for r in reqs)} json_schema-constrained, "
        f"schemas {', '.join(SCHEMAS)}), max_tokens {args.max_tokens}, concurrency {args.concurrency}, greedy"
    )
    for name, url in urls.items():
        asyncio.run(wait_ready(url, args.ready_timeout))
        if args.warmup:
            asyncio.run(
                run(url, args.model, workload(args.warmup), args.max_tokens, args.concurrency)
            )
        replies, seconds = asyncio.run(
            run(url, args.model, reqs, args.max_tokens, args.concurrency)
        )
        runs[name] = summarize(replies, seconds)
        print("\n".join(report_lines(name, runs[name])), flush=True)
    if args.results:
        args.results.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1) + "\n")
    first = next(iter(runs))  # the first saved, else the first --url
    for other in runs:
        if other != first:
            print("\n".join(ratio_lines(first, other, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
