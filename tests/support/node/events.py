"""Pod events as the kubelet records them (Started, Killing, Unhealthy, BackOff, Failed,
FailedMount), so ``kubectl describe pod`` and ``kubectl get events`` tell what happened. Posted
from a background thread; a repeat of the same event within a short window is dropped."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from kvmesh_testing.node.api import Api
from kvmesh_testing.node.status import now

log = logging.getLogger(__name__)
REPEAT_WINDOW = 10.0


class EventRecorder:
    def __init__(self, api: Api, node_name: str) -> None:
        self.api, self.node_name = api, node_name
        self.queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.recent: dict[tuple[str, str, str], float] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="events", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)

    def record(
        self,
        pod: dict[str, Any],
        reason: str,
        message: str,
        *,
        warning: bool = False,
        container: str | None = None,
    ) -> None:
        meta = pod["metadata"]
        key = (meta["uid"], reason, message)
        with self.lock:
            t = time.monotonic()
            if t - self.recent.get(key, -REPEAT_WINDOW) < REPEAT_WINDOW:
                return
            self.recent[key] = t
            if len(self.recent) > 5000:
                self.recent = {k: v for k, v in self.recent.items() if t - v < REPEAT_WINDOW}
        involved = {
            "kind": "Pod",
            "apiVersion": "v1",
            "namespace": meta["namespace"],
            "name": meta["name"],
            "uid": meta["uid"],
        }
        if container:
            involved["fieldPath"] = f"spec.containers{{{container}}}"
        stamp = now()
        self.queue.put(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": involved,
                "reason": reason,
                "message": message,
                "type": "Warning" if warning else "Normal",
                "count": 1,
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "source": {"component": "kubelet", "host": self.node_name},
                "reportingComponent": "kubelet",
                "reportingInstance": self.node_name,
            }
        )

    def _run(self) -> None:
        while (event := self.queue.get()) is not None:
            try:
                self.api.create(
                    f"/api/v1/namespaces/{event['metadata']['namespace']}/events", event
                )
            except Exception as exc:  # a namespace being deleted, the API server restarting
                log.debug("event not recorded: %s", exc)
