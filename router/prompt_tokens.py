"""A prompt's token ids exactly as the engine will see them, and its contract-1 block keys."""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.common.block_keys import block_keys
from kvmesh.common.chat_prompt import DEFAULT_TOOL_PROMPT, ToolPrompt, chat_request_prompt
from kvmesh.common.lora import adapter_identity, vllm_adapter_identity
from kvmesh.common.prompts import prompt_batch

log = logging.getLogger("kvmesh.router")


class PromptTokens:
    def __init__(
        self,
        encoder,
        model: str,
        block_size: int,
        tool_format: type[ToolPrompt] = DEFAULT_TOOL_PROMPT,
        engine: str = "kvmesh",
    ):
        """``tool_format``: how the engines describe tools to a template that does not read them (their
        ``--tool-call-parser``'s format; Hermes, the engine's default). ``engine``: how the
        engines key an adapter's blocks: kvmesh's from the adapter's name and digest
        (``adapter_identity``), vLLM's from its name (``vllm_adapter_identity``)."""
        self.encoder = encoder
        self.model = model
        self.block_size = block_size
        self.tool_format = tool_format
        self.vllm = engine == "vllm"

    def tokens_and_keys(
        self,
        path: str,
        req: dict[str, Any],
        scores_prompt: bool,
        large: bool,
        identity: str | None = None,
    ) -> tuple[list[int], list[int]]:
        """The prompt's ids and block keys, chained from `identity` (default: ``identity(req)``)."""
        tokens = self.tokens(path, req, large)
        # A request scoring its prompt (prompt logprobs, or echo with logprobs) computes every
        # position and reads nothing from the cache: no prefix to match, it goes by load.
        keys = (
            self.keys(tokens, req, identity or self.identity(req))
            if tokens and not scores_prompt
            else []
        )
        return tokens, keys

    def keys(self, tokens: list[int], req: dict[str, Any], identity: str) -> list[int]:
        """The block keys of `tokens` chained from `identity` (and the request's cache salt)."""
        return block_keys(tokens, identity, self.block_size, cache_salt=req.get("cache_salt"))

    def adapter(self, req: dict[str, Any]) -> str | None:
        """The LoRA adapter a request names by its ``model`` (None: the served model)."""
        named = req.get("model")
        return named if isinstance(named, str) and named and named != self.model else None

    def identity(self, req: dict[str, Any], digest: str = "") -> str:
        """The block keys' model identity: the served model's, or that of the adapter the request
        names (on a kvmesh engine, with the `digest` of its files the replica lists)."""
        name = self.adapter(req)
        if name is None:
            return self.model
        return (
            vllm_adapter_identity(name) if self.vllm else adapter_identity(self.model, name, digest)
        )

    def tokens(self, path: str, req: dict[str, Any], large: bool = False) -> list[int]:
        """The prompt's ids ([] when the body is malformed: the engine will answer it)."""
        try:
            if path == "/v1/chat/completions":
                return self._chat(req, large)
            if path == "/v1/completions":
                return self._completion(req, large)
        except Exception as exc:  # noqa: BLE001 - the engine will answer the malformed request
            log.debug("could not tokenize: %s", exc)
        return []

    def _chat(self, req: dict[str, Any], large: bool) -> list[int]:
        # as the engine renders it: text parts joined, a null content as "", earlier calls' arguments
        # decoded, and the tools (the engine's default format for a template that does not read them)
        messages, template_vars = chat_request_prompt(req, self.chat_template, self.tool_format)
        kw = {"large": True} if large else {}
        return self.encoder.encode_chat(
            messages,
            add_generation_prompt=req.get("add_generation_prompt", True),
            continue_final_message=bool(req.get("continue_final_message")),
            template_kwargs=template_vars,
            **kw,
        )

    @property
    def chat_template(self) -> str | None:
        """The encoder's chat template (a FastEncoder's is its tokenizer's)."""
        template = getattr(self.encoder, "chat_template", None)
        return (
            template
            if template is not None
            else getattr(getattr(self.encoder, "tok", None), "chat_template", None)
        )

    def _completion(self, req: dict[str, Any], large: bool) -> list[int]:
        prompt = prompt_batch(req.get("prompt"))[0]  # a batch routes on its first prompt
        if isinstance(prompt, str):
            if large and hasattr(self.encoder, "encode_large"):
                return self.encoder.encode_large(prompt)
            return self.encoder.encode(prompt)
        if isinstance(prompt, list) and prompt:
            if all(type(t) is int for t in prompt):
                return prompt
            if all(isinstance(t, (int, float)) and float(t).is_integer() for t in prompt):
                return [int(t) for t in prompt]
        return []
