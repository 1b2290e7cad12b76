"""The offline API's ``lora_request``: one adapter per prompt, loaded on first use as vLLM's LLM does."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.engine.lora.request import LoRAError, LoRARequest


def adapter_names(
    core, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[str | None]:
    """The adapter name each prompt runs with (None: the base), every one loaded.

    An adapter not loaded yet, or loaded under its name from another path or with another id, is
    loaded (``core.add_lora``). Raises ValueError (LoRAError for an adapter that cannot be loaded)
    before any request is queued."""
    if lora_request is None:
        return [None] * num_prompts
    reqs = (
        [lora_request] * num_prompts
        if isinstance(lora_request, LoRARequest)
        else list(lora_request)
    )
    if len(reqs) != num_prompts:
        raise ValueError(f"{len(reqs)} lora requests for {num_prompts} prompts")
    distinct: dict[str, LoRARequest] = {}
    for req in reqs:
        if req is None:
            continue
        if distinct.setdefault(req.lora_name, req) != req:
            raise ValueError(f"two different LoRA requests name the adapter {req.lora_name!r}")
    if not distinct:
        return [None] * num_prompts
    if core.loras is None:
        raise LoRAError("LoRA is not enabled on this engine (enable_lora)")
    if len(distinct) > core.loras.max_cpu_loras:
        raise ValueError(
            f"{len(distinct)} distinct LoRA adapters in one call; max_cpu_loras is "
            f"{core.loras.max_cpu_loras}"
        )
    # Each is touched (or loaded) in turn: with at most max_cpu_loras of them, a load never
    # evicts one that this call uses.
    for req in distinct.values():
        if not _loaded_as(core, req):
            core.add_lora(req)
    return [None if req is None else req.lora_name for req in reqs]


def _loaded_as(core, req: LoRARequest) -> bool:
    """Whether the name is loaded from this path (with this id, when one is given)."""
    if req.lora_name not in core.loras:
        return False
    adapter = core.lora_adapter(req.lora_name)
    return adapter.path == req.lora_path and (
        req.lora_int_id <= 0 or req.lora_int_id == adapter.int_id
    )
