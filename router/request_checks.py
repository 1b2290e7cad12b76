"""Admission checks on a request's body: the fields the router reads, checked as the engine checks them, and its token estimate.

A check that fails raises :class:`BadRequest` (a 400 naming the field); :class:`Refused` is any
answer the router gives itself. The bounds are the request models' (kvmesh.common.protocol, read
into :data:`INT_FIELDS`), the limits the engine's (kvmesh/common/request_limits.py).
"""

from __future__ import annotations

import math
from typing import Any

from kvmesh.common import protocol
from kvmesh.common.cache_salt import InvalidCacheSalt, check_cache_salt
from kvmesh.common.chat_prompt import tools_chars
from kvmesh.common.prompts import prompt_batch
from kvmesh.common.request_limits import MAX_N, MAX_PROMPTS, MAX_TOKENS_ESTIMATE, lax_int


class Refused(Exception):
    """A request the router answers itself: `status` with an OpenAI error body (and `headers`)."""

    def __init__(
        self,
        status: int,
        message: str,
        etype: str,
        param: str | None = None,
        code: str | None = None,
        headers=(),
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype
        self.param = param
        self.code = code
        self.headers = headers


class BadRequest(Refused):
    """A request the router refuses itself: 400 (or `status`) with an OpenAI error naming `param`."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(status, message, "invalid_request_error", param, code)


CHAT = "/v1/chat/completions"


# The integer fields the router reads, by endpoint: name -> the request model's [lo, hi] (hi None:
# unbounded).
_READS = {
    "/v1/completions": (protocol.CompletionRequest, ("n", "max_tokens")),
    CHAT: (protocol.ChatCompletionRequest, ("n", "max_tokens", "max_completion_tokens")),
}
INT_FIELDS: dict[str, dict[str, tuple[int, int | None]]] = {
    path: {name: protocol.field_bounds(model, name) for name in names}
    for path, (model, names) in _READS.items()
}


def estimate_tokens(path: str, req: dict[str, Any], prompt_tokens: int) -> int:
    """Tokens a request will use, charged to the rate limit up front (settled with its usage):
    every prompt of a batch (sized like the first) and n completions of each. Malformed or
    absurd values are bounded (the limiter charges at most a minute's budget anyway). Chat's
    max_completion_tokens overrides max_tokens; a completion has none (as vLLM's)."""
    n = min(max(1, lax_int(req.get("n"), 1)), MAX_N)
    mt = req.get("max_completion_tokens") if path == CHAT else None
    if mt is None:
        mt = req.get("max_tokens")
    max_tokens = min(max(0, lax_int(mt, 0)), MAX_TOKENS_ESTIMATE)
    prompts = min(len(prompt_batch(req.get("prompt"))), MAX_PROMPTS)
    return prompts * (max(0, prompt_tokens) + n * max_tokens)


def prompt_chars(path: str, req: dict[str, Any]) -> int:
    """The size of the prompt the router tokenises (characters, or token ids), read cheaply:
    1/4 of it estimates its tokens before tokenising, and a long one is tokenised off the loop."""
    if path == CHAT:
        total = 0
        for msg in req.get("messages") or ():
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(
                    len(p.get("text") or "")
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            total += 16  # role and template markup
        return total + tools_chars(req.get("tools"))  # the tools are rendered into the prompt too
    first = prompt_batch(req.get("prompt"))[0]
    if isinstance(first, list):
        return 4 * len(first)  # token ids: exact after the division by 4
    return len(first) if isinstance(first, str) else 0


def _int_param(req: dict[str, Any], name: str, lo: int, hi: int | None = None) -> None:
    """An integer field as the engine's request model accepts it (an int, an integral float, a
    numeric string), within [lo, hi]; anything else is a 400 naming the field."""
    v = req.get(name)
    if v is None:
        return
    if isinstance(v, float):
        if not math.isfinite(v):
            raise BadRequest(f"{name} must be a finite integer, got {v}", name)
        if not v.is_integer():
            raise BadRequest(f"{name} must be an integer, got {v}", name)
        v = int(v)
    elif isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            raise BadRequest(f"{name} must be an integer, got {v[:50]!r}", name) from None
    elif not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer, got {type(v).__name__}", name)
    if v < lo or (hi is not None and v > hi):
        raise BadRequest(
            f"{name} must be between {lo} and {hi}, got {v}"
            if hi is not None
            else f"{name} must be at least {lo}, got {v}",
            name,
        )


def _token_ids(ids: list, vocab: int) -> None:
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab:
        return  # all fine, found at C speed (a 4 MB prompt has a million ids); else find the culprit
    for t in ids:
        if type(t) is not int:
            if isinstance(t, bool) or not (
                isinstance(t, (int, float)) and math.isfinite(t) and float(t).is_integer()
            ):
                raise BadRequest(
                    f"prompt: token ids must be integers, got {str(t)[:50]!r}", "prompt"
                )
            t = int(t)
        if not 0 <= t < vocab:
            raise BadRequest(
                f"token id {t} is outside the vocabulary [0, {vocab})", "prompt"
            )  # as the engine


def check_request(path: str, req: dict[str, Any], vocab: int) -> None:
    """The fields the router itself reads, checked as the engine checks them (so the router never
    fails on them and refuses exactly what an engine would): a 400 naming the field. The rest of
    the request is the engine's to validate."""
    try:  # first, as the engine checks it: the block keys' root is made from it
        check_cache_salt(req.get("cache_salt"))
    except InvalidCacheSalt as exc:
        raise BadRequest(str(exc), exc.param, code=exc.code) from None
    for name, (lo, hi) in INT_FIELDS[path].items():
        _int_param(req, name, lo, hi)
    if path == CHAT:
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages must be a non-empty list of messages", "messages")
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict):
                raise BadRequest(
                    f"messages.{i} must be an object with a role and a content", f"messages.{i}"
                )
        return
    prompt = req.get("prompt")
    if prompt is None:
        raise BadRequest("prompt is required", "prompt")
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise BadRequest(
            "prompt must be a string, a list of token ids, or a list of either", "prompt"
        )
    if not prompt:
        raise BadRequest("prompt is empty: it must contain at least one token", "prompt")
    batch = prompt_batch(prompt)
    if len(batch) > MAX_PROMPTS:
        raise BadRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", "prompt")
    if batch is not prompt:  # one list of token ids
        _token_ids(prompt, vocab)
        return
    for one in batch:
        if isinstance(one, str):
            continue
        if not isinstance(one, list) or not one:
            raise BadRequest(
                "each prompt of a batch must be a string or a non-empty list of token ids", "prompt"
            )
        _token_ids(one, vocab)
