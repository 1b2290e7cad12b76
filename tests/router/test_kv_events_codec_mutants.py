"""Contract 2, the codec's edges that mutation testing found unpinned (docs/mutation.md).

The decoder's one error names the field, the type it got and a short repr of the value: these
messages are what an operator reads in the sidecar's log and /health, so they are pinned whole.
Also pinned: map-encoded events, bytes tags, the smallest block size and the largest token id,
the repr truncation, and the types of what is decoded."""

from __future__ import annotations

import re

import msgpack
import pytest

from kvmesh.common import kv_events as kv


def decode(obj) -> kv.EventBatch:
    return kv.decode_batch(msgpack.packb(obj, use_bin_type=True))


def error(obj) -> str:
    with pytest.raises(kv.DecodeError) as exc:
        decode(obj)
    return str(exc.value)


@pytest.mark.parametrize(
    "batch, message",
    [
        ([1.0, [["BlockStored", [1], None]]], "BlockStored needs 4 fields, got 2"),
        (
            [1.0, [["BlockStored", [1], None, [1], 0]]],
            "BlockStored.block_size must be a positive int, got 0",
        ),
        (
            [1.0, [["BlockStored", [1], None, [1], "4"]]],
            "BlockStored.block_size must be a positive int, got '4'",
        ),
        (
            [1.0, [["BlockStored", [1.5], None, [1], 4]]],
            "BlockStored.block_hashes must be an int or bytes, got float 1.5",
        ),
        (
            [1.0, [["BlockStored", "ab", None, [1], 4]]],
            "BlockStored.block_hashes must be an array, got str",
        ),
        (
            [1.0, [["BlockStored", [1], "p", [1], 4]]],
            "BlockStored.parent_block_hash must be an int or bytes, got str 'p'",
        ),
        (
            [1.0, [["BlockStored", [1], None, {"a": 1}, 4]]],
            "BlockStored.token_ids must be an array, got dict",
        ),
        (
            [1.0, [["BlockStored", [1], None, [1, -5], 4]]],
            "BlockStored.token_ids must hold uint32 ints, got -5",
        ),
        (
            [1.0, [["BlockStored", [1], None, [1], 4, 2.5]]],
            "BlockStored.lora_id must be an int or nil, got float",
        ),
        (
            [1.0, [["BlockStored", [1], None, [1], 4, None, b"GPU"]]],
            "BlockStored.medium must be a string or nil, got bytes",
        ),
        ([1.0, [["BlockRemoved"]]], "BlockRemoved needs block_hashes"),
        (
            [1.0, [["BlockRemoved", [b"x", 2.0]]]],
            "BlockRemoved.block_hashes must be an int or bytes, got float 2.0",
        ),
        ([1.0, [["BlockRemoved", 3]]], "BlockRemoved.block_hashes must be an array, got int"),
        ([1.0, [["BlockRemoved", [1], 7]]], "BlockRemoved.medium must be a string or nil, got int"),
        ([1.0, [["Nope", 1]]], "unknown KV event kind 'Nope'"),
        ([1.0, [[b"\xff\xfe", 1]]], r"event tag is not text: b'\xff\xfe'"),
        ([1.0, [5]], "event is not a tagged array: 5"),
        ([1.0, [[]]], "event is not a tagged array: []"),
        ([1.0, "events"], "EventBatch.events must be an array, got str"),
        (["now", []], "EventBatch.ts must be a number, got str"),
        ([True, []], "EventBatch.ts must be a number, got bool"),
        ([1.0, [], 1.5], "EventBatch.data_parallel_rank must be an int or nil, got float"),
        ({"ts": 1.0}, "EventBatch must be an array [ts, events, ...], got dict"),
        ([1.0], "EventBatch must be an array [ts, events, ...], got list"),
    ],
)
def test_each_error_names_the_field_and_what_it_got(batch, message):
    assert error(batch) == message


def test_long_values_are_cut_to_80_characters_of_repr():
    tag = "x" * 200
    assert error([1.0, [[tag]]]) == "unknown KV event kind " + repr(tag)[:80] + "..."
    exact = "y" * 78  # its repr is exactly 80 characters: not cut
    assert error([1.0, [[exact]]]) == "unknown KV event kind " + repr(exact)
    longer = "y" * 79
    assert error([1.0, [[longer]]]) == "unknown KV event kind " + repr(longer)[:80] + "..."


@pytest.mark.parametrize("payload", [b"\xc1garbage", msgpack.packb([1.0, []]) + b"\x00", b""])
def test_not_msgpack_says_what_the_parser_said(payload):
    try:
        msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - whatever msgpack raises is what the message names
        expected = f"not msgpack: {type(exc).__name__}: {str(exc)!r}"
    with pytest.raises(kv.DecodeError) as got:
        kv.decode_batch(payload)
    assert str(got.value) == expected


def test_map_encoded_events_decode_like_arrays():
    batch = decode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1, 2],
                    "parent_block_hash": 9,
                    "token_ids": [5, 6, 7, 8],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                },
                {"type": "BlockRemoved", "block_hashes": [1], "medium": None},
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    assert batch.events == [
        kv.BlockStored([1, 2], 9, [5, 6, 7, 8], 2, None, "GPU"),
        kv.BlockRemoved([1], None),
        kv.AllBlocksCleared(),
    ]
    assert error([1.0, [{"kind": "BlockStored"}]]) == "unknown KV event kind None"


def test_bytes_tags_are_read_as_text():
    batch = decode([1.0, [[b"BlockRemoved", [3]], [b"AllBlocksCleared"]]])
    assert batch.events == [kv.BlockRemoved([3]), kv.AllBlocksCleared()]


def test_the_smallest_block_size_and_the_largest_token_id_are_valid():
    (ev,) = decode([1.0, [["BlockStored", [1], None, [0xFFFFFFFF], 1]]]).events
    assert ev == kv.BlockStored([1], None, [0xFFFFFFFF], 1)
    assert "uint32" in error([1.0, [["BlockStored", [1], None, [0x100000000], 1]]])


def test_decoded_types():
    batch = decode([7, [["BlockStored", [2**64 - 1, b"h"], b"p", [1, 2], 2, 3, "GPU"]], 2])
    assert batch.ts == 7.0 and type(batch.ts) is float and batch.data_parallel_rank == 2
    (ev,) = batch.events
    assert ev == kv.BlockStored([2**64 - 1, b"h"], b"p", [1, 2], 2, 3, "GPU")
    assert type(ev.block_hashes[1]) is bytes and type(ev.parent_block_hash) is bytes
    assert decode([1.5, []]) == kv.EventBatch(ts=1.5, events=[], data_parallel_rank=None)


def test_encoded_batches_round_trip_with_every_field():
    events = [
        kv.BlockStored([1, b"h"], 0, [3, 4], 2, 7, "cpu"),
        kv.BlockRemoved([b"h"], "GPU"),
        kv.AllBlocksCleared(),
    ]
    payload = kv.encode_batch(events, ts=5, data_parallel_rank=1)
    assert msgpack.unpackb(payload) == [
        5.0,
        [
            ["BlockStored", [1, b"h"], 0, [3, 4], 2, 7, "cpu"],
            ["BlockRemoved", [b"h"], "GPU"],
            ["AllBlocksCleared"],
        ],
        1,
    ]
    assert kv.decode_batch(payload) == kv.EventBatch(5.0, events, 1)
    assert type(msgpack.unpackb(payload)[0]) is float
    # Without a timestamp the batch is stamped now.
    import time

    before = time.time()
    ts = msgpack.unpackb(kv.encode_batch([]))[0]
    assert before <= ts <= time.time() and msgpack.unpackb(kv.encode_batch([]))[1:] == [[], None]


def test_error_messages_stay_short():
    msg = error([1.0, [["BlockStored", [1], None, list(range(-1, 500)), 4]]])
    assert re.fullmatch(r"BlockStored\.token_ids must hold uint32 ints, got -1", msg)


def test_maps_with_integer_keys_are_msgpack_too():
    # Another encoder may key a map-encoded event's fields by position.
    batch = kv.decode_batch(msgpack.packb([1.0, [{"type": "BlockRemoved", 1: [4, 5]}]]))
    assert batch.events == [kv.BlockRemoved([4, 5])]
