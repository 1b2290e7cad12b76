"""The adapters a server serves (vLLM's ``OpenAIServingModels``): a request's ``model`` resolved to
the base or a loaded adapter, their /v1/models cards, and runtime loads and unloads through the core.

The core (``EngineCore.add_lora`` and co., run between steps as utility calls) is the truth; this
is the API process's copy, refreshed from the core's listing after each load or unload (a load may
unload the least recently used adapter) and kept in load order.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvmesh.common.lora import MODEL_CARD_DIGEST
from kvmesh.engine.lora.cli_args import LORA_NOT_ENABLED
from kvmesh.engine.lora.request import LoRAError, LoRARequest
from kvmesh.engine.server.errors import APIError, bad_request


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist. This server serves `{served}`.",
        param="model",
        code="model_not_found",
    )


class ServedAdapters:
    """Loaded adapters by name: the core's ``list_loras`` entries, in load order."""

    def __init__(self) -> None:
        self.loaded: dict[str, dict[str, Any]] = {}
        self._lock: asyncio.Lock | None = None  # loads and unloads, one at a time
        self._next_id = 1

    def sync(self, listing: list[dict[str, Any]]) -> None:
        """Take the core's listing: gone names dropped, new ones appended, the rest updated."""
        by_name = {d["name"]: d for d in listing}
        merged = {n: by_name[n] for n in self.loaded if n in by_name}
        merged.update((n, d) for n, d in by_name.items() if n not in merged)
        self.loaded = merged
        self._next_id = max([self._next_id, *(int(d["id"]) + 1 for d in listing)])

    def resolve(self, model: str | None, served: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base); 404 for an unknown name."""
        if model is None or model == served:
            return None
        if model in self.loaded:
            return model
        raise model_not_found(model, served)

    def cards(self, served: str, created: int) -> list[dict[str, Any]]:
        """The adapters' /v1/models entries (vLLM's fields, plus the digest of the files)."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kvmesh",
                "root": d["path"],
                "parent": served,
                "max_model_len": None,
                MODEL_CARD_DIGEST: d["digest"],
            }
            for name, d in self.loaded.items()
        ]

    # -- runtime loads and unloads -------------------------------------------------------------
    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def load(self, engine, name: str, path: str, inplace: bool, served: str) -> str:
        """vLLM's /v1/load_lora_adapter: checks, then the core loads it between steps."""
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if not engine.engine_args.enable_lora:
            raise bad_request(LORA_NOT_ENABLED)
        if name == served:
            raise bad_request(
                f"The lora adapter name '{name}' conflicts with a served base model.",
                param="lora_name",
            )
        async with self._locked():
            if name in self.loaded and not inplace:
                raise bad_request(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.",
                    param="lora_name",
                )
            old = self.loaded.get(name)
            lora_id = int(old["id"]) if old is not None else self._next_id
            self._next_id = max(self._next_id, lora_id + 1)
            await _call(engine, "add_lora", LoRARequest(name, lora_id, path))
            self.sync(await _call(engine, "list_loras"))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, engine, name: str) -> str:
        """vLLM's /v1/unload_lora_adapter: requests running with it finish with it."""
        if not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._locked():
            if name not in self.loaded:
                raise APIError(
                    404, f"The lora adapter '{name}' cannot be found.", param="lora_name"
                )
            self.loaded.pop(name)  # new requests naming it: 404 from now on
            await _call(engine, "remove_lora", name)
            self.sync(await _call(engine, "list_loras"))
        return f"Success: LoRA adapter '{name}' removed successfully."


async def _call(engine, name: str, *args):
    """A utility call on the core; its refusal of an adapter is a 400 naming it."""
    from kvmesh.engine.server.async_engine import EngineDeadError  # it holds a ServedAdapters

    try:
        return await engine.utility(name, *args)
    except LoRAError as exc:
        raise bad_request(str(exc), param="lora_path") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
