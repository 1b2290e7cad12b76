"""The router's drain: the requests inside it, and the two phases of a shutdown (draining, then cutting what is left)."""

from __future__ import annotations

import asyncio
import time


class Drain:
    def __init__(self):
        self.draining = False  # SIGTERM: every response from now on closes its connection
        self.cutting = False  # the drain timed out: the engines' responses still open are being cut
        self.active: dict[object, tuple[str, float]] = {}  # requests inside the app: (route, start)

    async def wait_drained(self, timeout: float, stop=lambda: False) -> bool:
        """Wait up to `timeout` until no request is inside the router; `stop()` true ends the
        wait early (a second signal). Returns whether it drained."""
        deadline = time.monotonic() + timeout
        while self.active and not stop():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return not self.active

    def describe_active(self, limit: int = 10) -> str:
        now = time.monotonic()
        oldest = sorted(self.active.values(), key=lambda a: a[1])[:limit]
        return ", ".join(f"{path} for {now - t0:.1f}s" for path, t0 in oldest) or "none"
