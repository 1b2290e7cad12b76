"""Admission: who is asking (API key), the body (size-limited), its checks, and the rate limit's charge.

Each stage either fills in its part of the request's :class:`Call` or raises :class:`Refused`.
Authentication comes before the body is read, and every cheap check before the tokenizer runs:
a client that fails one costs no tokenization. The rate limit is charged a bounded estimate at
admission, corrected with the real prompt length once tokenized, and settled with the engine's
usage (router/settle.py), or refunded when no engine ran the request.
"""

from __future__ import annotations

import re
import time
import uuid

from kvmesh.common.json_body import load_json
from kvmesh.router.auth import ApiKeys, RateLimiter
from kvmesh.router.metrics import RouterMetrics, route_label
from kvmesh.router.request_checks import Refused, check_request, estimate_tokens, prompt_chars
from kvmesh.router.request_state import Call

GENERATE = ("/v1/completions", "/v1/chat/completions")
_RID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class Admission:
    def __init__(
        self,
        keys: ApiKeys,
        limiter: RateLimiter,
        metrics: RouterMetrics,
        max_body_bytes: int,
        vocab_size: int,
    ):
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.vocab_size = vocab_size

    def begin(self, scope) -> Call:
        """The request's state: its start time, headers, request id (the client's if it is safe)."""
        t0 = time.perf_counter()
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id")
        if not rid or not _RID_OK.match(rid):
            rid = uuid.uuid4().hex
        return Call(
            t0=t0,
            path=path,
            route=route_label(path),
            headers=headers,
            rid=rid,
            extra=[(b"x-request-id", rid.encode())],
            client_id="ip:" + ((scope.get("client") or ("?",))[0]),
            query=scope.get("query_string") or b"",
        )

    def authenticate(self, call: Call) -> None:
        """With API keys on: the key's limits and id (the rate-limit client); else a 401."""
        if not self.keys.enabled:
            return
        info = self.keys.check(call.headers.get("authorization"))
        if info is None:
            self.metrics.auth_failures.inc()
            raise Refused(
                401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
            )
        call.key_info, call.client_id = info, info.key_id

    async def read_body(self, call: Call, receive) -> bool:
        """The body, at most max_body_bytes (413 beyond, declared or sent); False if the client left."""
        limit = self.max_body_bytes
        try:
            declared = int(call.headers.get("content-length") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            raise Refused(
                413,
                f"request body is {declared} bytes; the limit is {limit}",
                "invalid_request_error",
                code="body_too_large",
            )
        chunks = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return False
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                raise Refused(
                    413,
                    f"request body exceeds the limit of {limit} bytes",
                    "invalid_request_error",
                    code="body_too_large",
                )
            chunks.append(part)
            if not msg.get("more_body"):
                break
        call.body = b"".join(chunks)
        return True

    def parse(self, call: Call) -> None:
        """A JSON object; for a generation, the fields the router reads checked as the engine would."""
        try:
            req = load_json(call.body)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
            raise Refused(
                400,
                f"request body is not valid JSON: {str(exc)[:200]}",
                "invalid_request_error",
                code="invalid_json",
            ) from None
        if not isinstance(req, dict):
            raise Refused(400, "request body must be a JSON object", "invalid_request_error")
        call.req = req
        call.generate = call.path in GENERATE
        if call.generate:
            check_request(call.path, req, self.vocab_size)  # raises BadRequest (a Refused)

    def admit(self, call: Call) -> None:
        """The rate limit, charged a bounded estimate before the tokenizer runs (a client over its
        limit costs no tokenization)."""
        req, info = call.req, call.key_info
        call.chars = prompt_chars(call.path, req) if call.generate else 0
        ok, retry_after, which, charged = self.limiter.admit_charge(
            call.client_id,
            estimate_tokens(call.path, req, call.chars // 4 + 1) if call.generate else 0,
            info.rpm if info else None,
            call.tpm,
        )
        if not ok:
            self.metrics.rate_limited.labels(which).inc()
            raise Refused(
                429,
                f"rate limit exceeded ({which} per minute)",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers=[(b"retry-after", str(retry_after).encode())],
            )
        call.charged = charged

    def correct(self, call: Call) -> None:
        """The charge corrected with the real prompt length, once tokenized."""
        if call.tokens and call.charged:
            call.charged += self.limiter.adjust(
                call.client_id,
                estimate_tokens(call.path, call.req, len(call.tokens)) - call.charged,
                call.tpm,
            )

    def refund(self, call: Call) -> None:
        """No engine ran the request: its charge goes back."""
        self.limiter.adjust(call.client_id, -call.charged, call.tpm)
