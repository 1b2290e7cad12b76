"""Per-request CPU work off the event loop.

The API server's event loop also answers ``/health``, ``/ready`` and ``/metrics``, which the
sidecar and the platform poll with short timeouts: a loop busy for seconds with one request's
JSON, validation, chat template or tokenisation gets the pod marked dead. So the work of a
large request (a body, a text, a token list past a threshold) runs in a small thread pool of
its own, as vLLM's AsyncMicrobatchTokenizer and ``run_in_executor`` do. The tokenizer's long
texts run without the GIL (``KVMeshTokenizer``), so those threads truly run beside the loop;
Python work there (the chat template, validation) still yields the GIL to the loop every few
milliseconds. Small requests stay on the loop: a thread hop would cost them more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvmesh.common.worker_pool import WorkerPool

T = TypeVar("T")

LARGE_CHARS = 8192  # a text or token list this long (or longer) goes to the pool
LARGE_BODY_BYTES = 64 * 1024  # a request body this large is decoded and validated there

# Two workers: one huge prompt does not queue the next one behind it, and the CPUs stay with the
# engine core (GIL-free tokenisation uses a whole CPU each). More threads would not speed up the
# Python part of the work (the GIL) and would make the loop wait longer for the GIL after every
# poll (the convoy effect).
POOL_SIZE = 2

_pool = WorkerPool(POOL_SIZE, "kvmesh-request")


def request_pool() -> ThreadPoolExecutor:
    """The process's pool for per-request CPU work (created on first use)."""
    return _pool.executor()


async def off_loop(size: int, fn: Callable[..., T], *args: Any, threshold: int = LARGE_CHARS) -> T:
    """``fn(*args)``: inline when ``size`` (characters, tokens or bytes of its input) is below
    ``threshold``, else in the request pool while the event loop serves everything else."""
    if size < threshold:
        return fn(*args)
    return await _pool.run(fn, *args)
