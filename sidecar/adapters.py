"""The LoRA adapters an engine serves, read from its ``/v1/models`` (bounded per heartbeat).

An adapter's entry has ``parent`` = the base model; a kvmesh engine adds its digest
(``kvmesh.common.lora.MODEL_CARD_DIGEST``), vLLM publishes none ("").
"""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.common.lora import MODEL_CARD_DIGEST

log = logging.getLogger("kvmesh.sidecar")

# Adapters kept per heartbeat (what kvmesh.common.lora.decode_adapters reads back): an engine
# listing more has the rest left out, and said once.
MAX_ADAPTERS = 1024
MAX_NAME = 256  # the longest adapter name and digest a heartbeat carries (decode_adapters')
MAX_DIGEST = 64


class AdapterList:
    """Reads the adapter entries of a ``/v1/models`` body; warns once per engine that lists too many."""

    def __init__(self, base_model: str, limit: int = MAX_ADAPTERS):
        self.base_model = base_model
        self.limit = limit
        self.warned = False

    def read(self, entries: Any) -> dict[str, str]:
        """name -> digest of the entries whose parent is the base model (at most `limit`)."""
        out: dict[str, str] = {}
        if not isinstance(entries, list):
            return out
        for entry in entries:
            if not isinstance(entry, dict) or entry.get("parent") != self.base_model:
                continue
            name, digest = entry.get("id"), entry.get(MODEL_CARD_DIGEST)
            if not isinstance(name, str) or not name or len(name) > MAX_NAME:
                continue
            if len(out) >= self.limit:
                self._too_many(len(entries))
                break
            ok = isinstance(digest, str) and len(digest) <= MAX_DIGEST
            out[name] = digest if ok else ""
        return out

    def _too_many(self, listed: int) -> None:
        if not self.warned:
            self.warned = True
            log.warning(
                "the engine lists %d models; heartbeats carry its first %d adapters",
                listed,
                self.limit,
            )
