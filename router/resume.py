"""What a request sent again after its engine failed carries: the continuation's body, and which requests may be resumed.

A stream goes on from the ids the client has received: the original body, unchanged, with
`return_token_ids` and `resume.output_token_ids` (the engine re-prefills prompt + those ids and
counts them as output already generated: max_tokens, min_tokens, stop strings over the whole
output, usage once); a stream of several choices (n > 1, a batch of prompts) lists the choices
still running, each with its ids, in `resume.choices` (the finished ones are not run again). A stream that failed before its first token, and a non-streamed request,
are sent again as they were. docs/router.md, "Streams survive their replica".
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.common.prompts import prompt_batch
from kvmesh.router.request_state import Call


def resumable(call: Call, max_resumes: int) -> bool:
    """A generation whose choices the router can count (best_of picks among hidden samples: not resumed)."""
    if max_resumes <= 0 or not call.generate:
        return False
    return call.req.get("best_of") in (None, 1) and choices(call) is not None


def choices(call: Call) -> tuple[int, int] | None:
    """(prompts x n, n) of a generation: choice index = prompt index * n + j; None when malformed
    (the engine answers it)."""
    req = call.req
    n = req.get("n")
    n = 1 if n is None else n  # absent or null: the default
    if type(n) is not int or n < 1:
        return None
    if call.path != "/v1/completions":
        return n, n
    return len(prompt_batch(req.get("prompt"))) * n, n  # anything not a batch is one prompt


def wants_ids(req: dict[str, Any]) -> bool:
    """The client asked for the token ids itself (then they are passed on)."""
    return req.get("return_token_ids") is True


def stream_body(body: bytes, req: dict[str, Any]) -> bytes:
    """The body of a stream the router may resume: `return_token_ids` on. Inserted as the first
    key of the body as it came (no re-encoding of a large prompt) when the client did not send
    the field; re-encoded when the client sent another value."""
    if wants_ids(req):
        return body
    if "return_token_ids" not in req:
        head = body.lstrip()
        if head.startswith(b"{"):
            rest = head[1:]
            sep = b"" if rest.lstrip().startswith(b"}") else b","
            return b'{"return_token_ids":true' + sep + rest
    return json.dumps({**req, "return_token_ids": True}).encode()


def continuation_body(req: dict[str, Any], resume: dict[str, Any]) -> bytes:
    """The original request, going on from the ids the client has received (`resume`:
    ClientStream.continuation())."""
    return json.dumps({**req, "return_token_ids": True, "resume": resume}).encode()


def max_tokens(req: dict[str, Any], chat: bool) -> int | None:
    """The request's output budget, if it names one."""
    value = req.get("max_completion_tokens") if chat else None
    if value is None:
        value = req.get("max_tokens")
    return value if type(value) is int else None


def include_usage(req: dict[str, Any]) -> bool:
    opts = req.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))
