"""The router's own ASGI answers: JSON bodies, OpenAI-style errors, the drain's shutdown refusal."""

from __future__ import annotations

import json
from typing import Any

from kvmesh.router.request_checks import Refused

# What a request the drain's timeout cuts gets: a stream, an error event; anything else, a 503.
SHUTDOWN_MSG = (
    "the router is shutting down (its drain timed out); the response is incomplete: retry"
)
SHUTDOWN_REFUSED_MSG = "the router is shutting down; retry"
SHUTDOWN_RETRY_AFTER = (b"retry-after", b"1")


async def send_body(send, status: int, body: bytes, ctype: bytes = b"application/json", extra=()):
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", ctype),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, obj: Any, extra=()):
    await send_body(send, status, json.dumps(obj).encode(), extra=extra)


async def send_error(
    send,
    status: int,
    message: str,
    etype: str,
    extra=(),
    param: str | None = None,
    code: str | None = None,
):
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    await send_json(
        send,
        status,
        {"error": {"message": message, "type": etype, "param": param, "code": code}},
        extra,
    )


async def send_refused(send, refused, extra=()) -> None:
    """A :class:`~kvmesh.router.request_checks.Refused` as its OpenAI error (its own headers added)."""
    await send_error(
        send,
        refused.status,
        refused.message,
        refused.etype,
        list(extra) + list(refused.headers),
        param=refused.param,
        code=refused.code,
    )


def shutdown_refused() -> Refused:
    """What a request the drain stops before it reached an engine (held or queued) gets: a 503
    it may retry elsewhere."""
    return Refused(
        503,
        SHUTDOWN_REFUSED_MSG,
        "service_unavailable",
        code="router_shutdown",
        headers=[SHUTDOWN_RETRY_AFTER],
    )


async def refuse_shutdown(send, headers: list) -> None:
    """The drain's cut, before anything went back to the client: a 503 it may retry."""
    await send_error(
        send,
        503,
        SHUTDOWN_REFUSED_MSG,
        "service_unavailable",
        headers + [SHUTDOWN_RETRY_AFTER],
        code="router_shutdown",
    )


def header(scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def wait_disconnect(receive):
    """Returns when the client has gone (its ASGI receive says http.disconnect)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
