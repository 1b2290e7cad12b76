"""The messages that enter the engine core: one typed struct per kind, the same in both modes.

The in-thread engine (engine/server/async_engine.py) puts them on its command queue as objects;
the API process (engine/server/core_client.py) sends them to the core process msgpack-encoded
(engine/core_proc.py). ``CoreLoop`` applies them either way.
"""

from __future__ import annotations

import msgspec

from kvmesh.engine.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float | None = None
    resumed_token_ids: list[int] = []  # a continuation: output generated elsewhere (Request)
    lora_name: str | None = None  # the adapter the request runs with (loaded); None: the base
    priority: int = 0  # lower first, under the priority scheduling policy


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]
