"""Contract 1: chained block keys.

key(block i) = H(key(block i-1) || token ids of block i), where H is the first
8 bytes of SHA-256 read as an unsigned little-endian 64-bit integer, and the
byte encoding is: parent key as 8 bytes little-endian, then each token id as 4
bytes little-endian (unsigned). The first block chains from a root key derived
from the model identity and an optional per-request cache salt, so two models
(or two tenants with different salts) never share keys.

Only full blocks have keys. The engine's prefix cache, the sidecar and the
router all call this one function; tests/test_block_keys.py pins test vectors.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16
_ROOT_DOMAIN = b"kvmesh-block-key-v1"


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def root_key(model_id: str, cache_salt: str | None = None) -> int:
    """Key that block 0 chains from: model identity plus optional cache salt."""
    salt = (cache_salt or "").encode()
    return _h64(_ROOT_DOMAIN + b"\0" + model_id.encode() + b"\0" + salt)


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """Key of one full block, chained from its parent's key."""
    return _h64(struct.pack(f"<Q{len(tokens)}I", parent, *tokens))


def block_keys(
    token_ids: Sequence[int],
    model_id: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    cache_salt: str | None = None,
    parent: int | None = None,
) -> list[int]:
    """Keys of every full block of `token_ids` (a trailing partial block has none).

    `parent` continues a chain (the key of the block before token_ids[0]);
    by default the chain starts at the model's root key.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    key = root_key(model_id, cache_salt) if parent is None else parent
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = block_key(key, token_ids[start : start + block_size])
        keys.append(key)
    return keys


def key_hex(key: int) -> str:
    """Canonical text form of a key (Redis set members, logs): 16 lower-case hex digits."""
    return f"{key:016x}"
