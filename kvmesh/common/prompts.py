"""OpenAI's completion `prompt` field, shaped the same way by the router and the engine server."""

from __future__ import annotations

from typing import Any


def prompt_batch(prompt: Any) -> list:
    """The prompts of a completion request: a batch (a list of texts or of token-id lists) as it
    is; one text or one token-id list as a batch of one."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def chat_template_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as the engine hands them to the chat template (its ChatMessage.as_template_dict):
    text content parts joined into one string, a missing or null content as "". Raises ValueError
    for what the engine refuses (a message that is not an object, a part that is not text)."""
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages.{i} must be an object")
        d = {k: v for k, v in msg.items() if v is not None}
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text", ""), str):
                    raise ValueError(f"messages.{i}: only text content parts are supported")
                texts.append(part.get("text", ""))
            content = "".join(texts)
        d["content"] = content or ""
        out.append(d)
    return out
