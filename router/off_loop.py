"""The router's one worker thread, for a large request's JSON, checks, tokens and block keys.

That work is mostly Python, which cannot run two threads at once anyway; and each more thread
contending for the GIL makes the event loop wait longer to get it back after every poll (the
convoy effect): under four 4 MB prompts, /health's p99 was 180-340 ms with asyncio's default
pool, 50 ms with one thread.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

OFF_LOOP_CHARS = 16384  # prompts this long are tokenised in the worker thread
OFF_LOOP_BODY_BYTES = 64 * 1024  # bodies this large are parsed and checked in it

_work_pool: ThreadPoolExecutor | None = None


async def off_loop(fn, *args):
    """``fn(*args)`` in the router's worker thread, while the event loop serves everything else."""
    global _work_pool
    if _work_pool is None:
        _work_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-router-work")
    return await asyncio.get_running_loop().run_in_executor(_work_pool, functools.partial(fn, *args))
