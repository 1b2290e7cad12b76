"""Default sampling parameters from the model's generation_config.json.

Model authors ship their recommended sampling there (Llama 3: temperature 0.6,
top_p 0.9). Like vLLM's ``--generation-config auto``, a request that leaves a
parameter out gets the model's value instead of the OpenAI default; ``vllm``
keeps the OpenAI defaults; a folder path reads that folder's file instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams

log = logging.getLogger("kvmesh.engine")

# generation_config.json key -> SamplingParams field (the keys vLLM takes over).
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def check_source(generation_config: str) -> None:
    if generation_config in ("auto", "vllm"):
        return
    if not (Path(generation_config) / "generation_config.json").is_file():
        raise ValueError(
            f"generation_config must be auto, vllm or a folder holding a generation_config.json; "
            f"{generation_config!r} holds none"
        )


def load_sampling_defaults(generation_config: str, model_dir: Path) -> dict[str, Any]:
    """The SamplingParams fields the model's generation config sets; {} for ``vllm``."""
    check_source(generation_config)
    if generation_config == "vllm":
        return {}
    path = (
        Path(model_dir) if generation_config == "auto" else Path(generation_config)
    ) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    defaults = {field: data[key] for key, field in _KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (InvalidParameter, TypeError) as exc:
        raise ValueError(f"{path}: invalid sampling default: {exc}") from exc
    if defaults:
        log.info(
            "default sampling parameters from %s: %s (requests may override them; "
            "--generation-config vllm turns this off)",
            path,
            defaults,
        )
    return defaults
