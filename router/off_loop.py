"""The router's one worker thread, for a large request's JSON, checks, tokens and block keys.

That work is mostly Python, which cannot run two threads at once anyway; and each more thread
contending for the GIL makes the event loop wait longer to get it back after every poll (the
convoy effect): under four 4 MB prompts, /health's p99 was 180-340 ms with asyncio's default
pool, 50 ms with one thread.
"""

from __future__ import annotations

from kvmesh.common.worker_pool import WorkerPool

OFF_LOOP_CHARS = 16384  # prompts this long are tokenised in the worker thread
OFF_LOOP_BODY_BYTES = 64 * 1024  # bodies this large are parsed and checked in it

_work_pool = WorkerPool(1, "kvmesh-router-work")


async def off_loop(fn, *args):
    """``fn(*args)`` in the router's worker thread, while the event loop serves everything else."""
    return await _work_pool.run(fn, *args)
