"""One HTTP request's body: read within the size limit, decoded and validated into its request model,
for the served model."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvmesh.common.cache_salt import InvalidCacheSalt, check_cache_salt
from kvmesh.common.json_body import load_json
from kvmesh.engine.server.errors import APIError, bad_request
from kvmesh.engine.server.off_loop import LARGE_BODY_BYTES, off_loop
from kvmesh.engine.server.protocol import first_error_param, invalid_text_field
from kvmesh.engine.server.server_state import ServerState


def decode_body(raw: bytes, model_cls: type[BaseModel]):
    """The request model of a JSON body, or the 400 (APIError) that names what is wrong."""
    try:
        data = load_json(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    if "cache_salt" in model_cls.model_fields:  # the router's check too: the same 400
        try:
            check_cache_salt(data.get("cache_salt"))
        except InvalidCacheSalt as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None
    bad_text = invalid_text_field(raw, data)
    if bad_text is not None:  # every string field: prompt, messages, stop, model, ...
        raise bad_request(
            f"{bad_text} is not valid Unicode text (a lone surrogate such as \\ud800)",
            param=bad_text,
            code="invalid_text",
        )
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        param, message = first_error_param(exc, model_cls)
        raise bad_request(message, param=param)


class RequestHandler:
    """One HTTP request: read and validate its body, check its model."""

    def __init__(self, state: ServerState, request: Request):
        self.state = state
        self.engine = state.engine
        self.request = request
        self.created = int(time.time())
        self.request_id = (request.headers.get("x-request-id") or "")[:128] or uuid.uuid4().hex
        self.headers = {"X-Request-Id": self.request_id}
        self.lora_name: str | None = None  # the adapter the body's model names (None: the base)

    async def parse(self, model_cls: type[BaseModel]):
        cfg = self.state.config
        length = self.request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            self.state.metrics.reject("body_too_large")
            raise APIError(
                413,
                f"request body is {length} bytes; the limit is {cfg.max_body_bytes}",
                code="body_too_large",
            )
        chunks, size = [], 0
        async for chunk in self.request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                self.state.metrics.reject("body_too_large")
                raise APIError(
                    413,
                    f"request body exceeds the limit of {cfg.max_body_bytes} bytes",
                    code="body_too_large",
                )
            chunks.append(chunk)
        raw = b"".join(chunks)
        # a large body is decoded and validated in the request pool: the loop keeps answering
        return await off_loop(len(raw), decode_body, raw, model_cls, threshold=LARGE_BODY_BYTES)

    def check_model(self, model: str | None) -> None:
        """The served model or a loaded adapter (``lora_name``); any other name is a 404."""
        self.lora_name = self.engine.adapters.resolve(model, self.state.config.served_model_name)

    @property
    def model_name(self) -> str:
        """The name responses carry: the adapter's, else the served model's (as vLLM)."""
        return self.lora_name or self.state.config.served_model_name

    async def read_body(self, model_cls: type[BaseModel]):
        """The validated body, for the served model."""
        body = await self.parse(model_cls)
        self.check_model(body.model)
        return body
