"""The stub engine's LoRA adapters, as a kvmesh engine serves them: the adapter a request names by
its ``model``, the identity its blocks chain from, its ``/v1/models`` entries (parent, digest),
``vllm:lora_requests_info`` and vLLM's ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``.

An adapter's digest is its directory's (``adapter_digest``) when the directory has adapter files,
else one made from its name, so tests route adapters without any weights.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass

from kvmesh.common.lora import MODEL_CARD_DIGEST, adapter_digest, adapter_identity


@dataclass(frozen=True)
class StubAdapter:
    name: str
    int_id: int
    path: str
    digest: str


def stub_digest(name: str, path: str) -> str:
    """The directory's digest, or (no adapter files there) one made from the name."""
    try:
        return adapter_digest(path)
    except (FileNotFoundError, NotADirectoryError):
        return hashlib.sha256(b"kvmesh-stub-adapter\0" + name.encode()).hexdigest()[:16]


class UnknownModel(LookupError):
    """A request naming neither the served model nor a loaded adapter (the engine's 404)."""


class StubAdapters:
    def __init__(self, base: str, modules: list[tuple[str, str]], max_loras: int):
        self.base = base
        self.max_loras = max_loras
        self.loaded: dict[str, StubAdapter] = {}
        self.running: Counter[str] = Counter()  # requests generating, by adapter
        self.changed = time.time()  # vLLM's lora_requests_info value: when its labels changed
        self._next_id = 1
        for name, path in modules:
            self.load(name, path)

    def load(self, name: str, path: str) -> StubAdapter:
        """Load `name` from `path` (ValueError if that name is loaded already)."""
        if name in self.loaded or name == self.base:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        adapter = StubAdapter(name, self._next_id, path, stub_digest(name, path))
        self._next_id += 1
        self.loaded[name] = adapter
        return adapter

    def unload(self, name: str) -> bool:
        return self.loaded.pop(name, None) is not None

    def resolve(self, model: object) -> StubAdapter | None:
        """The adapter a request's ``model`` names (None: the base); UnknownModel otherwise."""
        if model in (None, "", self.base):
            return None
        adapter = self.loaded.get(model) if isinstance(model, str) else None
        if adapter is None:
            raise UnknownModel(f"The model `{model}` does not exist.")
        return adapter

    def identity(self, adapter: StubAdapter | None) -> str:
        """The model identity the request's block keys chain from."""
        if adapter is None:
            return self.base
        return adapter_identity(self.base, adapter.name, adapter.digest)

    def started(self, adapter: StubAdapter | None) -> None:
        if adapter is not None:
            self.running[adapter.name] += 1
            self.changed = time.time()

    def finished(self, adapter: StubAdapter | None) -> None:
        if adapter is not None:
            self.running[adapter.name] -= 1
            if self.running[adapter.name] <= 0:
                del self.running[adapter.name]
            self.changed = time.time()

    def cards(self) -> list[dict]:
        """The adapters' ``/v1/models`` entries."""
        return [
            {
                "id": a.name,
                "object": "model",
                "owned_by": "kvmesh",
                "root": a.path,
                "parent": self.base,
                MODEL_CARD_DIGEST: a.digest,
            }
            for a in self.loaded.values()
        ]

    def metrics_line(self) -> str:
        """``vllm:lora_requests_info``: the slots per step and the adapters running now."""
        running = ",".join(sorted(self.running))
        return (
            f'vllm:lora_requests_info{{max_lora="{self.max_loras}",'
            f'running_lora_adapters="{running}",waiting_lora_adapters=""}} {self.changed}'
        )
