"""vLLM's runtime adapter routes, ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(present only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true): a plain-text success line, or an
OpenAI error with vLLM's status and message."""

from __future__ import annotations

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kvmesh.engine.server.request_body import RequestHandler


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # replace an adapter of that name (its new files, its same id)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_int_id: int | None = None  # accepted, as vLLM's; the name decides


class LoRAHandler(RequestHandler):
    """One load or unload; the server's adapters (``engine.adapters``) do the work."""

    async def load(self) -> PlainTextResponse:
        body = await self.parse(LoadLoRAAdapterRequest)
        served = self.state.config.served_model_name
        text = await self.engine.adapters.load(
            self.engine, body.lora_name, body.lora_path, body.load_inplace, served
        )
        return PlainTextResponse(text)

    async def unload(self) -> PlainTextResponse:
        body = await self.parse(UnloadLoRAAdapterRequest)
        return PlainTextResponse(await self.engine.adapters.unload(self.engine, body.lora_name))
