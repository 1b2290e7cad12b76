"""The shared tier's file format: one block's payload behind a header that proves what it is."""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"KVMB"
VERSION = 1
# magic, version, fingerprint (16 raw bytes), key (uint64), payload length, blake2b-16 of the payload
HEADER = struct.Struct("<4sH16sQQ16s")


def digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode(fingerprint: bytes, key: int, payload: bytes) -> bytes:
    """The whole file: header then payload."""
    head = HEADER.pack(MAGIC, VERSION, fingerprint, key, len(payload), digest(payload))
    return head + payload


def decode(data: bytes, fingerprint: bytes, key: int, payload_len: int) -> bytes | None:
    """The payload if ``data`` is a whole, intact entry of this key and fingerprint; else None
    (torn, truncated, corrupt, another store's or another key's file)."""
    if len(data) != HEADER.size + payload_len:
        return None
    magic, version, fp, k, length, checksum = HEADER.unpack_from(data)
    if (magic, version, fp, k, length) != (MAGIC, VERSION, fingerprint, key, payload_len):
        return None
    payload = memoryview(data)[HEADER.size :]
    if digest(payload) != checksum:
        return None
    return bytes(payload)
