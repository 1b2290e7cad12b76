"""The request limits the engine enforces and the router checks before forwarding, kept in one place.

The request models (kvmesh/common/protocol.py) refuse past these; the router
refuses exactly the same requests and never charges a rate limit for more than an engine would run.
"""

from __future__ import annotations

from typing import Any

MAX_N = 128  # choices per prompt
MAX_PROMPTS = 256  # prompts in one completion request
MAX_TOKENS_ESTIMATE = 1 << 31  # a max_tokens above this is charged as this
MAX_LOGPROBS = 20  # top-N logprobs per token
INT64_MAX = 2**63 - 1  # integers go into int64 tensors
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


def lax_int(value: Any, default: int) -> int:
    """`value` as an int where it reads as one, else `default`: for estimates made before (or
    without) validation, where a malformed field must not raise."""
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError, OverflowError):
        return default
