"""engine/server/off_loop.py: small work stays on the event loop, large work runs in the request
pool (its two threads), and what it raises reaches the awaiting handler unchanged."""

import asyncio
import threading

import pytest

from kvmesh.engine.server import off_loop
from kvmesh.engine.server.errors import APIError, bad_request


def test_small_inline_large_in_the_pool():
    async def main():
        here = threading.current_thread().name
        small = await off_loop.off_loop(10, lambda: threading.current_thread().name)
        large = await off_loop.off_loop(
            off_loop.LARGE_CHARS, lambda: threading.current_thread().name
        )
        return here, small, large

    here, small, large = asyncio.run(main())
    assert small == here and large.startswith("kvmesh-request")
    assert off_loop.request_pool()._max_workers == off_loop.POOL_SIZE == 2


def test_an_error_in_the_pool_reaches_the_handler():
    def refuse():
        raise bad_request("cache_salt must be a non-empty string", param="cache_salt")

    with pytest.raises(APIError) as info:
        asyncio.run(off_loop.off_loop(1 << 20, refuse))
    assert (info.value.status, info.value.param) == (400, "cache_salt")


def test_large_bodies_are_decoded_as_small_ones():
    """decode_body in the pool: the same model, or the same 400, as inline."""
    from kvmesh.engine.server.protocol import CompletionRequest
    from kvmesh.engine.server.request_body import decode_body

    pad = " " * off_loop.LARGE_BODY_BYTES
    good = b'{"prompt": [1, 2, 3], "cache_salt": "t"}'
    assert decode_body(good[:-1] + pad.encode() + b"}", CompletionRequest) == decode_body(
        good, CompletionRequest
    )
    for bad, param in (
        (b'{"prompt": "x", "cache_salt": "\\ud800"}', "cache_salt"),
        (b'{"prompt": "x", "n": NaN}', "n"),
        (b'{"prompt": [true]}', "prompt"),
    ):
        errors = []
        for body in (bad, bad[:-1] + pad.encode() + b"}"):
            with pytest.raises(APIError) as info:
                decode_body(body, CompletionRequest)
            errors.append((info.value.status, info.value.param, info.value.message))
        assert errors[0] == errors[1], errors
        assert errors[0][1] == param
