"""A process's own small thread pool for CPU work that must not hold up its event loop."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerPool:
    """A thread pool created on first use (a process that never needs it starts no threads)."""

    def __init__(self, workers: int, thread_name_prefix: str):
        self.workers = workers
        self.thread_name_prefix = thread_name_prefix
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.workers, thread_name_prefix=self.thread_name_prefix
                )
            return self._executor

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the pool, in a copy of the caller's context (its context variables)."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self.executor(), functools.partial(ctx.run, fn, *args)
        )
