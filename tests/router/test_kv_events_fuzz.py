"""Fuzzing the KV-event decoder (contract 2) and what the sidecar does with its output.

Properties, for any input:
  * ``decode_batch`` returns an EventBatch or raises ``DecodeError``, nothing else;
  * a batch it returns is well typed (the sidecar's index cannot choke on it): applying it
    to the sidecar's BlockIndex, in either engine format, never raises;
  * ``validate_kvmesh_batch`` refuses (with DecodeError only) what the kvmesh format cannot index.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.common import kv_events as kv
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.index_writer import BlockIndex, IndexWriter, validate_kvmesh_batch

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Every msgpack scalar, at its edges: ints over the full wire range, non-finite floats, text, bytes.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([0, 1, -1, 2**32, 2**32 - 1, 2**63, 2**64 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from(
        ["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU", b"BlockStored"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-5, 5)), inner, max_size=4),
    ),
    max_leaves=30,
)

# Well-formed events, so the mutations below start close to what an engine sends.
hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))
stored = st.builds(
    lambda hs, parent, bs, medium: [
        "BlockStored",
        hs,
        parent,
        list(range(bs * len(hs))),
        bs,
        None,
        medium,
    ],
    st.lists(hashes, min_size=1, max_size=4),
    st.one_of(st.none(), hashes),
    st.integers(1, 4),
    st.sampled_from([None, "GPU", "CPU"]),
)
removed = st.builds(
    lambda hs, medium: ["BlockRemoved", hs, medium],
    st.lists(hashes, max_size=4),
    st.sampled_from([None, "GPU"]),
)
events = st.one_of(stored, removed, st.just(["AllBlocksCleared"]))
good_batches = st.builds(
    lambda ts, evs, rank: [ts, evs, rank],
    st.floats(0, 2e9),
    st.lists(events, max_size=5),
    st.one_of(st.none(), st.integers(0, 7)),
)


def _paths(obj, path=()):
    yield path
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, path + (i,))


@st.composite
def mutated_batches(draw):
    """A valid batch with one node replaced by anything, one list truncated, or a field appended."""
    batch = copy.deepcopy(draw(good_batches))  # never mutate what a strategy may hand out again
    paths = list(_paths(batch))
    path = draw(st.sampled_from(paths))
    how = draw(st.sampled_from(["replace", "truncate", "append"]))
    if not path:
        return draw(values) if how == "replace" else batch
    parent = batch
    for i in path[:-1]:
        parent = parent[i]
    target = parent[path[-1]]
    if how == "replace" or not isinstance(target, list):
        parent[path[-1]] = draw(values)
    elif how == "truncate":
        del target[draw(st.integers(0, len(target))) :]
    else:
        target.append(draw(values))
    return batch


def _check_well_typed(batch: kv.EventBatch) -> None:
    assert isinstance(batch.ts, float)
    assert batch.data_parallel_rank is None or type(batch.data_parallel_rank) is int

    def is_hash(h):
        return type(h) in (int, bytes)

    for ev in batch.events:
        assert type(ev) in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared)
        if isinstance(ev, kv.BlockStored):
            assert all(is_hash(h) for h in ev.block_hashes)
            assert ev.parent_block_hash is None or is_hash(ev.parent_block_hash)
            assert all(type(t) is int and 0 <= t < 2**32 for t in ev.token_ids)
            assert type(ev.block_size) is int and ev.block_size > 0
            assert ev.lora_id is None or type(ev.lora_id) is int
            assert ev.medium is None or type(ev.medium) is str
        elif isinstance(ev, kv.BlockRemoved):
            assert all(is_hash(h) for h in ev.block_hashes)
            assert ev.medium is None or type(ev.medium) is str


def _apply_everywhere(batch: kv.EventBatch) -> None:
    """What the sidecar does with a decoded batch, in both engine formats: must not raise."""
    for fmt in ("kvmesh", "vllm"):
        cfg = SidecarConfig(
            pod_name="p", pod_url="http://x", model="m", engine_format=fmt, block_size=2
        )
        if fmt == "kvmesh":
            try:
                validate_kvmesh_batch(batch)
            except kv.DecodeError:
                continue  # the subscriber treats it as undecodable: never applied
        sidecar = IndexWriter.__new__(
            IndexWriter
        )  # apply() needs only the index and stats (no Redis client)
        sidecar.cfg, sidecar.index, sidecar.stats = cfg, BlockIndex(cfg), Counter()
        sidecar.index._warned_block_size = True  # block sizes vary on purpose here
        added, removed_, _ = sidecar.apply([kv.Delivery(seq=0, batch=batch)])
        assert set(sidecar.index.refs) >= added
        assert all(type(k) is int and 0 <= k < 2**64 for k in sidecar.index.refs)


def _decode_or_error(payload: bytes) -> kv.EventBatch | None:
    try:
        batch = kv.decode_batch(payload)
    except kv.DecodeError as exc:
        assert str(exc) and len(str(exc)) < 400  # says what is wrong, without echoing the payload
        return None
    _check_well_typed(batch)
    _apply_everywhere(batch)
    return batch


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_or_raise_the_one_error(payload):
    _decode_or_error(payload)


@FUZZ
@given(values)
def test_arbitrary_msgpack_structures_decode_or_raise_the_one_error(obj):
    _decode_or_error(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(mutated_batches())
def test_structurally_wrong_batches_decode_or_raise_the_one_error(obj):
    _decode_or_error(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(good_batches, st.data())
def test_valid_batches_decode_exactly_and_damaged_ones_never_escape(batch, data):
    payload = msgpack.packb(batch, use_bin_type=True)
    decoded = _decode_or_error(payload)
    assert decoded is not None  # a valid batch is never refused
    assert len(decoded.events) == len(batch[1])
    assert math.isclose(decoded.ts, batch[0]) and decoded.data_parallel_rank == batch[2]
    # The same bytes, damaged: cut short, one byte flipped, or junk appended.
    cut = data.draw(st.integers(0, max(0, len(payload) - 1)))
    _decode_or_error(payload[:cut])
    pos = data.draw(st.integers(0, len(payload) - 1))
    flipped = bytearray(payload)
    flipped[pos] ^= data.draw(st.integers(1, 255))
    _decode_or_error(bytes(flipped))
    _decode_or_error(payload + data.draw(st.binary(min_size=1, max_size=8)))


def test_fuzz_properties_can_fail():
    """The checks above are not vacuous: a decoder that let a bad type through would be caught."""
    bad = kv.EventBatch(
        ts=1.0, events=[kv.BlockStored([[1, 2]], None, [1, 2], 2)]
    )  # a list as a hash
    try:
        _check_well_typed(bad)
    except AssertionError:
        pass
    else:
        raise AssertionError("_check_well_typed accepted a list as a block hash")
    overflow = kv.EventBatch(ts=1.0, events=[kv.BlockStored([2**64], None, [1, 2], 2)])
    try:
        validate_kvmesh_batch(overflow)
    except kv.DecodeError:
        pass
    else:
        raise AssertionError("a hash beyond uint64 passed the kvmesh-format check")
