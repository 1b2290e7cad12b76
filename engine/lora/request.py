"""Which adapter a request or a load names, as vLLM's ``LoRARequest`` names it."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """An adapter to load (or that a request uses): its served name, a positive id, its directory.

    ``base_model_name`` is the model it was trained on (vLLM's ``--lora-modules`` JSON form);
    None: the served model.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None


class LoRAError(ValueError):
    """An adapter that cannot be loaded or used; the message names the adapter and the reason."""
