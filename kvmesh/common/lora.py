"""LoRA adapter identity: the digest of an adapter's files and the model identity its block keys chain from.

Contract 1 keys a request's blocks from a root derived from its model identity. For a request
served through a LoRA adapter on a kvmesh engine that identity is ``adapter_identity(base,
name, digest)``: the base model, the adapter's name and a digest of its files, so a same-name
reload with new weights never hits the old blocks, and two replicas that load the same files
agree on keys. The engine's prefix cache, the sidecar and the router all call these functions.

Real vLLM engines publish no digest: their blocks chain from ``root_key(lora_name)`` (what the
sidecar indexes from vLLM's ``BlockStored.lora_name``), see ``vllm_adapter_identity``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

# The files of a PEFT adapter directory that define it, in the order they are digested.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_DIGEST_DOMAIN = b"kvmesh-lora-digest-v1"

# The extra field of an adapter's entry in an engine's /v1/models (kvmesh engines only).
MODEL_CARD_DIGEST = "adapter_digest"


def adapter_digest(path: str | os.PathLike) -> str:
    """16 hex digits over the adapter's config and weight files (name, length and bytes of each).

    Raises FileNotFoundError when the directory has no config or no weight file.
    """
    root = os.fspath(path)
    names = [ADAPTER_CONFIG]
    weights = [n for n in ADAPTER_WEIGHT_FILES if os.path.isfile(os.path.join(root, n))]
    if not os.path.isfile(os.path.join(root, ADAPTER_CONFIG)) or not weights:
        raise FileNotFoundError(
            f"{root}: no {ADAPTER_CONFIG} with {' or '.join(ADAPTER_WEIGHT_FILES)}"
        )
    names.append(weights[0])
    h = hashlib.sha256(_DIGEST_DOMAIN)
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def adapter_identity(base_model: str, name: str, digest: str) -> str:
    """The model identity (``root_key``'s first argument) of a kvmesh engine's adapter."""
    return f"{base_model}\0lora\0{name}\0{digest}"


def vllm_adapter_identity(name: str) -> str:
    """The model identity of a real vLLM engine's adapter: its name (vLLM publishes no digest)."""
    return name


def encode_adapters(adapters: Mapping[str, str]) -> str:
    """A heartbeat's ``adapters`` field: JSON object name -> digest ("" where unknown), sorted."""
    return json.dumps(dict(sorted(adapters.items())), separators=(",", ":"))


def decode_adapters(text: str | None, limit: int = 1024) -> dict[str, str]:
    """The inverse of ``encode_adapters``; anything malformed (it crosses Redis) reads as none."""
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, str] = {}
    for name, digest in data.items():
        if len(out) >= limit:
            break
        if (
            isinstance(name, str)
            and name
            and len(name) <= 256
            and isinstance(digest, str)
            and len(digest) <= 64
        ):
            out[name] = digest
    return out
