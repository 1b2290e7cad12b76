"""Contract-1 test vectors. The engine's prefix cache, the sidecar and the router all
compute block keys with kvmesh.common.block_keys; these pinned values catch any change
to the hash, the byte encoding or the chaining (which would silently break routing
across mixed versions)."""

import hashlib
import struct

import pytest

from kvmesh.common.block_keys import block_key, block_keys, key_hex, root_key

MODEL = "smollm2-135m-instruct"

VECTORS = [
    # (token ids, model, block size, salt, expected keys)
    (list(range(40)), MODEL, 16, None, ["4c5c0d642fd83963", "59eb625b71859b5d"]),
    (list(range(40)), MODEL, 16, "tenant-a", ["8b607a232ea68cec", "1e209b2fff216b0c"]),
    ([1, 2, 3, 4], "m", 2, None, ["6745ddce0b0ec3e1", "f67ecaa25117f3ef"]),
    (list(range(15)), MODEL, 16, None, []),  # no full block, no key
]


@pytest.mark.parametrize("tokens,model,bs,salt,expected", VECTORS)
def test_vectors(tokens, model, bs, salt, expected):
    assert [
        key_hex(k) for k in block_keys(tokens, model, block_size=bs, cache_salt=salt)
    ] == expected


def test_roots():
    assert key_hex(root_key(MODEL)) == "e38ac1e06207f624"
    assert key_hex(root_key(MODEL, "tenant-a")) == "49b2e64e5ccf2c88"
    assert key_hex(root_key("other")) == "74eb578de1bcf564"
    assert root_key(MODEL, "") == root_key(MODEL)  # empty salt == no salt


def test_block_key_extremes():
    assert key_hex(block_key(0, [0] * 16)) == "be4e53a29b704a83"
    assert key_hex(block_key(2**64 - 1, [2**32 - 1] * 16)) == "5f13e0ec2fa3cf51"


def test_matches_the_documented_encoding():
    """H = first 8 bytes of SHA-256, little-endian; parent as u64 LE, tokens as u32 LE."""
    root = int.from_bytes(
        hashlib.sha256(b"kvmesh-block-key-v1\0" + MODEL.encode() + b"\0").digest()[:8], "little"
    )
    assert root == root_key(MODEL)
    tokens = list(range(100, 116))
    expected = int.from_bytes(
        hashlib.sha256(struct.pack("<Q16I", root, *tokens)).digest()[:8], "little"
    )
    assert block_keys(tokens, MODEL) == [expected]


def test_chaining_and_continuation():
    tokens = list(range(64))
    keys = block_keys(tokens, MODEL)
    assert len(keys) == 4
    assert block_keys(tokens[32:], MODEL, parent=keys[1]) == keys[2:]
    assert block_keys(tokens[:40], MODEL) == keys[:2]  # a prefix's keys are a prefix of the keys
    other = list(tokens)
    other[3] = 999
    assert not set(block_keys(other, MODEL)) & set(keys)  # a change invalidates all later blocks
    assert key_hex(1) == "0000000000000001"
