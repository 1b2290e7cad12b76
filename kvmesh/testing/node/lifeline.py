"""Stop a harness process when the process that started it is gone (killed without a chance
to stop its children): the parent's pid is polled, as PR_SET_PDEATHSIG would follow only the
thread that forked us, and a cluster may be started from a thread that ends."""

from __future__ import annotations

import os
import threading
from typing import Callable


def watch_parent(on_orphaned: Callable[[], None], interval: float = 1.0) -> threading.Thread:
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            threading.Event().wait(interval)
        on_orphaned()

    thread = threading.Thread(target=run, name="lifeline", daemon=True)
    thread.start()
    return thread
