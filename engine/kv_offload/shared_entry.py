"""The shared tier's file format: one block's payload behind a header that proves what it is.

The checksum is CRC-32: it catches torn, truncated and damaged files (the faults a shared
volume has) at a fifth of a cryptographic hash's cost, paid for every block written through. It
authenticates nothing: whoever may write the volume may write any entry (the replicas of one
deployment trust each other's files as they trust each other's KV events)."""

from __future__ import annotations

import struct
import zlib

MAGIC = b"KVMB"
VERSION = 2
# magic, version, fingerprint (16 raw bytes), key (uint64), payload length, CRC-32 of the payload
HEADER = struct.Struct("<4sH16sQQI")


def checksum(payload) -> int:
    return zlib.crc32(payload)


def header(fingerprint: bytes, key: int, payload) -> bytes:
    """The header of ``payload`` (any bytes-like object): written before it."""
    return HEADER.pack(MAGIC, VERSION, fingerprint, key, len(payload), checksum(payload))


def encode(fingerprint: bytes, key: int, payload) -> bytes:
    """The whole file: header then payload."""
    return header(fingerprint, key, payload) + bytes(payload)


def decode(data: bytes, fingerprint: bytes, key: int, payload_len: int) -> bytes | None:
    """The payload if ``data`` is a whole, intact entry of this key and fingerprint; else None
    (torn, truncated, corrupt, another store's or another key's file)."""
    if len(data) != HEADER.size + payload_len:
        return None
    magic, version, fp, k, length, crc = HEADER.unpack_from(data)
    if (magic, version, fp, k, length) != (MAGIC, VERSION, fingerprint, key, payload_len):
        return None
    payload = memoryview(data)[HEADER.size :]
    if checksum(payload) != crc:
        return None
    return bytes(payload)
