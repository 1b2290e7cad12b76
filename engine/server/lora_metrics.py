"""vLLM's ``vllm:lora_requests_info`` gauge: the adapters of the running and the waiting requests.

As vLLM's: labels ``max_lora``, ``waiting_lora_adapters``, ``running_lora_adapters`` (names joined
by commas) and, as the value, the time (Unix seconds) that label set became current, so a reader
takes the newest sample. Only the current label set is exported (vLLM keeps every one it saw).
"""

from __future__ import annotations

import threading
import time

from prometheus_client.core import GaugeMetricFamily

NAME = "vllm:lora_requests_info"
LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]


class LoraRequestsInfo:
    """The current label set and when it became current; ``observe`` runs with each stats update."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._lock = threading.Lock()  # the engine thread observes, the event loop scrapes
        self._labels = [str(max_loras), "", ""]
        self._since = time.time()

    def observe(self, stats) -> None:
        if stats is None:
            return
        labels = [
            str(self.max_loras),
            ",".join(stats.waiting_lora_adapters),
            ",".join(stats.running_lora_adapters),
        ]
        with self._lock:
            if labels != self._labels:
                self._labels, self._since = labels, time.time()

    def family(self) -> GaugeMetricFamily:
        g = GaugeMetricFamily(NAME, "Running stats on lora requests.", labels=LABELS)
        with self._lock:
            g.add_metric(list(self._labels), self._since)
        return g
