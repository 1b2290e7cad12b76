"""The events thread: the engine's KV events, received by a KVEventSubscriber, handed to the index writer.

The subscriber (kvmesh/common/kv_events.py) owns the ZMQ SUB and replay sockets: it counts every
sequence gap and heals it by a replay, or from the engine's block-set snapshot when the replay
buffer no longer has it, and resets and replays from 0 when the engine restarts. A batch that does
not decode (or that is not valid for ``--engine-format``) is counted and resynced there.

Nothing in an event can stop this thread: any other failure of an iteration is counted, logged and
followed by a reset and a replay from 0, with a backoff. ``problem()`` says why the index cannot be
trusted: the loop is dead, or has not completed an iteration for ``events_stale_after`` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from kvmesh.common.kv_events import KVEventSubscriber
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.index_writer import IndexWriter, validate_kvmesh_batch

log = logging.getLogger("kvmesh.sidecar")


class EventsLoop:
    """The thread that polls the subscriber and writes each poll through the index writer."""

    def __init__(self, cfg: SidecarConfig, writer: IndexWriter, stats: Counter):
        self.cfg = cfg
        self.writer = writer
        self.stats = stats
        self.subscriber: KVEventSubscriber | None = None
        self.thread: threading.Thread | None = None
        self.started_at = time.monotonic()
        self.last_ok: float | None = None  # monotonic time of the last completed iteration
        self.error: str | None = None  # the last failure
        self._stop = threading.Event()

    def start(self) -> None:
        validate = validate_kvmesh_batch if self.cfg.engine_format == "kvmesh" else None
        self.subscriber = KVEventSubscriber(
            self.cfg.kv_events_endpoint, self.cfg.kv_events_replay_endpoint, validate=validate
        )
        self.thread = threading.Thread(target=self._run, name="sidecar-events", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()

    @property
    def caught_up(self) -> bool:
        """The first catch-up (a replay from 0) has run."""
        return self.subscriber is not None and self.subscriber.caught_up

    def request_resync(self, reason: str) -> None:
        """Reset, then replay from 0 (or a snapshot): e.g. the engine restarted."""
        if self.subscriber is not None:
            self.subscriber.request_resync(reason)

    def problem(self) -> str | None:
        """Why the block index cannot be trusted now (None: the loop is alive and current)."""
        t = self.thread
        if t is None:
            return "not started"
        if not t.is_alive():
            return "events loop dead" + (f" ({self.error})" if self.error else "")
        last = self.last_ok if self.last_ok is not None else self.started_at
        age = time.monotonic() - last
        if age > self.cfg.events_stale_after:
            why = f" (last error: {self.error})" if self.error else ""
            return f"events loop stale: no completed iteration for {age:.1f}s{why}"
        return None

    def iteration(self) -> None:
        deliveries = self.subscriber.poll(100)
        self.writer.write(deliveries, self.subscriber.next_seq)

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    self.iteration()
                except Exception as exc:  # noqa: BLE001 - nothing may end this thread
                    failures += 1
                    self.stats["events_loop_errors"] += 1
                    self.error = f"{type(exc).__name__}: {exc}"[:300]
                    if failures <= 3 or failures % 100 == 0:
                        log.exception("KV-event loop failed (%d in a row); resyncing", failures)
                    # Whatever the failure left half-applied is dropped: reset and replay from 0.
                    self.writer.reset()
                    self.subscriber.request_resync(f"events loop failed: {self.error}")
                    self._stop.wait(min(0.1 * 2 ** min(failures, 6), self.cfg.max_backoff))
                    continue
                failures = 0
                self.last_ok = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - e.g. SystemExit from a library: say why the loop is gone
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            log.critical(
                "KV-event loop ended: %s; /health and /ready now fail, the block set is withdrawn",
                self.error,
            )
