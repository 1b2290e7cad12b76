"""Going on with a stream on another vLLM replica: vLLM's completions API, prompted with token ids.

vLLM has no `resume` field (our engine's): the continuation is a `/v1/completions` request whose
prompt is the original prompt's token ids followed by the ids the client has received, with the
budget that is left, greedy as the original. Its text_completion events reach the client as the
original's kind (ClientStream turns them into chat chunks for a chat stream). Only a generation
vLLM would produce identically that way goes on: greedy (temperature 0), one choice, and nothing
whose state lives in the engine's output so far (structured output, tools, stop strings,
frequency or presence penalties, logprobs). Seeded sampling on vLLM is not resumable either (its
generator restarts with the continuation). Anything else is sent again whole when the client has
received nothing yet, and otherwise ends with the error event. docs/vllm.md, "Failover".
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.router.resume import max_tokens

# Fields whose effect depends on what was generated before the break.
_STATEFUL = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "stop",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "suffix",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "best_of",
)
# Sampling and output fields passed on to the continuation as they were.
_KEPT = (
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "repetition_penalty",
    "stream_options",
    "user",
    "priority",
)


def inexact(req: dict[str, Any], num_choices: int) -> str | None:
    """Why vLLM could not go on with this generation token for token (None: it can)."""
    if num_choices != 1:
        return "several choices"
    temperature = req.get("temperature")
    if not (temperature == 0 or req.get("top_k") == 1):
        return "sampled (only a greedy generation resumes exactly on vLLM)"
    for name in _STATEFUL:
        if req.get(name) not in (None, False, 0, [], ""):
            return f"`{name}`"
    return None


def continuation_body(
    req: dict[str, Any], chat: bool, prompt_ids: list[int], output_ids: list[int]
) -> bytes:
    """The `/v1/completions` request that goes on after `output_ids`."""
    body: dict[str, Any] = {
        "model": req.get("model"),
        "prompt": list(prompt_ids) + list(output_ids),
        "stream": True,
        "return_token_ids": True,
        "temperature": 0,
        **{k: req[k] for k in _KEPT if k in req},
    }
    budget = max_tokens(req, chat)
    if budget is not None:
        body["max_tokens"] = max(budget - len(output_ids), 1)
    if type(req.get("min_tokens")) is int:
        body["min_tokens"] = max(req["min_tokens"] - len(output_ids), 0)
    return json.dumps(body).encode()


def as_chat_chunk(obj: dict[str, Any]) -> None:
    """A text_completion event made the chat.completion.chunk it continues (in place)."""
    obj["object"] = "chat.completion.chunk"
    for choice in obj.get("choices") or ():
        text = choice.pop("text", None)
        choice["delta"] = {"content": text} if text else {}
