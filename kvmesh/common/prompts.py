"""OpenAI's completion `prompt` field, shaped the same way by the router and the engine server.
(A chat request's messages and tools: kvmesh/common/chat_prompt.py.)"""

from __future__ import annotations

from typing import Any


def prompt_batch(prompt: Any) -> list:
    """The prompts of a completion request: a batch (a list of texts or of token-id lists) as it
    is; one text or one token-id list as a batch of one."""
    return (
        prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        else [prompt]
    )
