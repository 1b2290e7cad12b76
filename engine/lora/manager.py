"""The engine's loaded adapters: load, look up and unload by name, with an LRU bound and refcounts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from kvmesh.engine.lora.request import LoRAError, LoRARequest


def _default_loader(req: LoRARequest, model_config, max_rank: int):
    from kvmesh.engine.lora.adapter import load_adapter

    return load_adapter(req, model_config, max_rank)


def describe(adapter) -> dict[str, Any]:
    """An adapter as ``list_loras`` and ``add_lora`` report it."""
    return {
        "name": adapter.name,
        "id": adapter.int_id,
        "path": adapter.path,
        "digest": adapter.digest,
        "rank": adapter.rank,
        "base_model_name": adapter.base_model_name,
    }


class LoRAManager:
    """Adapters by served name, at most ``max_cpu_loras`` of them, least recently used first out.

    A request holds its adapter object from its arrival to its end (``acquire``/``release``): an
    adapter in use is never evicted, and when its name is unloaded or loaded again with new files,
    the running requests finish with the object they hold while new ones get the name's new
    meaning (or LoRAError once it is gone).
    """

    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int | None,
        max_rank: int,
        model_config,
        loader: Callable | None = None,
    ):
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(
                f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})"
            )
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be positive, got {max_rank}")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.model_config = model_config
        self._load = loader or _default_loader
        self._by_name: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        # id(adapter) -> (adapter, live requests using it); detached adapters stay until 0.
        self._refs: dict[int, list] = {}
        self._next_id = 1

    # -- the registry ------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str):
        """The adapter the name means now (marked as recently used); LoRAError if none."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        self._by_name.move_to_end(name)
        return adapter

    def list(self) -> list[dict[str, Any]]:
        return [describe(a) for a in self._by_name.values()]

    def load(self, req: LoRARequest):
        """Load ``req`` under its name and return the adapter. A name already loaded from the same
        files (same digest) keeps its adapter; new files replace it for requests to come."""
        name = req.lora_name
        if not name:
            raise LoRAError("a LoRA adapter needs a name")
        old = self._by_name.get(name)
        victim = None if old is not None else self._victim(name)
        req = self._with_id(req, old)
        adapter = self._load(req, self.model_config, self.max_rank)
        if old is not None and old.digest == adapter.digest and old.path == adapter.path:
            self._by_name.move_to_end(name)
            return old
        if victim is not None:
            del self._by_name[victim]
        self._by_name[name] = adapter
        self._by_name.move_to_end(name)
        return adapter

    def remove(self, name: str) -> bool:
        """Unload a name: new requests cannot use it; running ones finish with its adapter."""
        return self._by_name.pop(name, None) is not None

    def _victim(self, name: str) -> str | None:
        """The name to evict so that one more fits (None: there is room); LoRAError if every
        loaded adapter is in use."""
        if len(self._by_name) < self.max_cpu_loras:
            return None
        for loaded, adapter in self._by_name.items():
            if not self.in_use(adapter):
                return loaded
        raise LoRAError(
            f"cannot load LoRA adapter {name!r}: all {len(self._by_name)} loaded adapters "
            f"(max_cpu_loras) are in use"
        )

    def _with_id(self, req: LoRARequest, old) -> LoRARequest:
        """The request with its int id: the caller's (unique among the other names), the id of
        the adapter it replaces, or the next free one."""
        taken = {a.int_id: n for n, a in self._by_name.items() if n != req.lora_name}
        if req.lora_int_id > 0:
            if req.lora_int_id in taken:
                raise LoRAError(
                    f"cannot load LoRA adapter {req.lora_name!r}: id {req.lora_int_id} "
                    f"is used by adapter {taken[req.lora_int_id]!r}"
                )
            return req
        if old is not None:
            return msgspec.structs.replace(req, lora_int_id=old.int_id)
        while self._next_id in taken:
            self._next_id += 1
        self._next_id += 1
        return msgspec.structs.replace(req, lora_int_id=self._next_id - 1)

    # -- requests ----------------------------------------------------------------------------
    def acquire(self, adapter) -> None:
        """A new request runs with the adapter (from ``get``): in use until ``release``."""
        entry = self._refs.setdefault(id(adapter), [adapter, 0])
        entry[1] += 1

    def release(self, adapter) -> None:
        entry = self._refs.get(id(adapter))
        if entry is None or entry[0] is not adapter:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._refs[id(adapter)]

    def in_use(self, adapter) -> bool:
        entry = self._refs.get(id(adapter))
        return entry is not None and entry[0] is adapter

    def refcount(self, adapter) -> int:
        entry = self._refs.get(id(adapter))
        return entry[1] if entry is not None and entry[0] is adapter else 0
