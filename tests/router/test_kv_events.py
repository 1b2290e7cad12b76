import time

import msgpack
import pytest
import zmq

from kvmesh.common import kv_events as kv
from tests.router import vllm_structs as vs


def test_encoder_is_byte_identical_to_vllm_msgspec():
    ours = kv.encode_batch(
        [
            kv.BlockStored([1, 2**64 - 1], None, list(range(32)), 16, None, "GPU"),
            kv.BlockRemoved([7], None),
            kv.AllBlocksCleared(),
        ],
        ts=1234.5,
    )
    theirs = vs.encode(
        vs.KVEventBatch(
            ts=1234.5,
            events=[
                vs.BlockStored([1, 2**64 - 1], None, list(range(32)), 16, None, "GPU"),
                vs.BlockRemoved([7], None),
                vs.AllBlocksCleared(),
            ],
        )
    )
    assert ours == theirs


def test_decoder_reads_vllm_bytes_with_bytes_hashes_and_dp_rank():
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    payload = vs.encode(
        vs.KVEventBatch(
            ts=1.0,
            data_parallel_rank=3,
            events=[
                vs.BlockStored([h1, h2], b"\x00" * 32, list(range(32)), 16, 5, "GPU"),
                vs.BlockRemoved([h1], "CPU"),
                vs.AllBlocksCleared(),
            ],
        )
    )
    batch = kv.decode_batch(payload)
    assert batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert stored == kv.BlockStored([h1, h2], b"\x00" * 32, list(range(32)), 16, 5, "GPU")
    assert removed == kv.BlockRemoved([h1], "CPU")
    assert isinstance(cleared, kv.AllBlocksCleared)


def test_decoder_tolerates_missing_and_extra_trailing_fields():
    payload = msgpack.packb(
        [
            2.0,
            [
                ["BlockStored", [1], None, [1, 2], 2],  # older: no lora/medium
                ["BlockStored", [2], 1, [3, 4], 2, None, "GPU", "lora-x", 9],  # newer
                ["BlockRemoved", [1]],
            ],
            0,
            "extra",
        ]
    )
    batch = kv.decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
    ]
    assert batch.events[1].medium == "GPU" and batch.data_parallel_rank == 0
    with pytest.raises(kv.DecodeError):
        kv.decode_batch(b"\xc1garbage")


GOOD_STORED = ["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU"]


@pytest.mark.parametrize(
    "batch, needle",
    [
        (
            [1.0, [GOOD_STORED, ["SomethingNew", 1]]],
            "unknown KV event kind",
        ),  # an unknown kind is not skipped
        (
            [1.0, [["BlockStored", [[1, 2]], None, [1, 2, 3, 4], 4]]],
            "block_hashes",
        ),  # unhashable hash
        ([1.0, [["BlockStored", [{"a": 1}], None, [1, 2, 3, 4], 4]]], "block_hashes"),
        ([1.0, [["BlockStored", [1.5], None, [1, 2, 3, 4], 4]]], "block_hashes"),
        ([1.0, [["BlockStored", [True], None, [1, 2, 3, 4], 4]]], "block_hashes"),
        ([1.0, [["BlockStored", [1], [9], [1, 2, 3, 4], 4]]], "parent_block_hash"),
        ([1.0, [["BlockStored", [1], None, [1, -2, 3, 4], 4]]], "token_ids"),
        ([1.0, [["BlockStored", [1], None, [1, 2**32, 3, 4], 4]]], "token_ids"),
        ([1.0, [["BlockStored", [1], None, "abcd", 4]]], "token_ids"),
        ([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 0]]], "block_size"),
        ([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], "4"]]], "block_size"),
        ([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, "lora", None]]], "lora_id"),
        ([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, 7]]], "medium"),
        ([1.0, [["BlockStored", 5, None, [1, 2, 3, 4], 4]]], "block_hashes"),
        ([1.0, [["BlockStored", [1], None]]], "needs 4 fields"),
        ([1.0, [["BlockRemoved", None]]], "block_hashes"),
        ([1.0, [["BlockRemoved"]]], "needs block_hashes"),
        ([1.0, [[]]], "tagged array"),
        ([1.0, [7]], "tagged array"),
        ([1.0, {"a": 1}], "events must be an array"),
        ([1.0, None], "events must be an array"),
        (["soon", []], "ts must be a number"),
        ([2**64 - 1, [], "rank"], "data_parallel_rank"),
        ({"ts": 1.0}, "must be an array"),
        ([1.0], "must be an array"),
    ],
)
def test_decoder_refuses_wrong_types_with_the_one_error(batch, needle):
    """Each of these would have reached the sidecar's index as a bad value (or been skipped in
    silence): the decoder refuses the whole batch, naming the field."""
    with pytest.raises(kv.DecodeError, match=needle):
        kv.decode_batch(msgpack.packb(batch, use_bin_type=True))


def test_decoder_refuses_truncated_payloads():
    payload = kv.encode_batch(
        [kv.BlockStored([1, 2], None, list(range(32)), 16, None, "GPU")], ts=3.0
    )
    assert kv.decode_batch(payload).events
    for cut in range(len(payload)):
        with pytest.raises(kv.DecodeError):
            kv.decode_batch(payload[:cut])


def _wait_for(cond, timeout=3.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _drain(sub, n_polls=20):
    out = []
    for _ in range(n_polls):
        out.extend(sub.poll(50))
    return out


def test_publisher_wire_and_replay_protocol():
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=3)
    ctx = zmq.Context.instance()
    try:
        for i in range(5):
            pub.publish([kv.BlockRemoved([i])])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(2000)
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[1] == kv.END_SEQ:
                assert frames[2] == b""
                break
            got.append(
                (
                    int.from_bytes(frames[1], "big"),
                    kv.decode_batch(frames[2]).events[0].block_hashes,
                )
            )
        assert got == [(3, [3]), (4, [4])]
        dealer.close(0)
    finally:
        pub.close()


def test_subscriber_catches_up_fills_gaps_and_detects_restart():
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    sub = kv.KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.publish(
            [kv.BlockRemoved([0])]
        )  # before the subscriber's first poll: caught up by replay
        pub.publish([kv.BlockRemoved([1])])
        first = _drain(sub, 5)
        assert [d.seq for d in first] == [0, 1]
        # Simulate a lost message: publish seq 2 while nobody listens, then 3.
        with pub._lock:
            pub._buffer.append((pub._seq, kv.encode_batch([kv.BlockRemoved([2])])))
            pub._seq += 1
        pub.publish([kv.BlockRemoved([3])])
        got = _drain(sub, 5)
        assert [d.seq for d in got] == [2, 3] and sub.stats["gaps"] == 1
        assert got[0].batch.events[0].block_hashes == [2]
    finally:
        pub.close()
        endpoint, replay = pub.endpoint, pub.replay_endpoint
    # The engine restarts on the same ports: seq starts again at 0.
    pub2 = None
    for _ in range(50):  # zmq releases the closed sockets' ports asynchronously
        try:
            pub2 = kv.KVEventPublisher(endpoint, replay)
            break
        except zmq.ZMQError:
            time.sleep(0.1)
    assert pub2 is not None
    try:
        pub2.publish([kv.BlockRemoved([10])])  # probably lost: the SUB has not reconnected yet
        got = []
        assert _wait_for(lambda: got.extend(sub.poll(50)) or any(d.seq == 0 for d in got), 5)
        assert got[0].reset and "restart" in got[0].reset
        assert [d.seq for d in got[1:]] == [0]  # recovered through the replay socket
        pub2.publish([kv.BlockRemoved([11])])
        assert [d.seq for d in _drain(sub, 5)] == [1]
    finally:
        pub2.close()
        sub.close()


def test_unrecoverable_gap_resets():
    """A publisher without snapshots (as vLLM's) cannot fill a range it no longer buffers."""
    pub = kv.KVEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2, snapshots=False
    )
    sub = kv.KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.publish([kv.BlockRemoved([0])])
        assert [d.seq for d in _drain(sub, 5)] == [0]
        with pub._lock:  # seqs 1..3 are published while the subscriber is away; buffer keeps 2
            for s in (1, 2, 3):
                pub._buffer.append((s, kv.encode_batch([kv.BlockRemoved([s])])))
            pub._seq = 4
        pub.publish([kv.BlockRemoved([4])])
        got = _drain(sub, 5)
        assert got[0].reset and "seq 1..2 lost" in got[0].reset
        assert [d.seq for d in got[1:]] == [3, 4] and sub.stats["gap_resets"] == 1
    finally:
        pub.close()
        sub.close()


def _until_live(pub, sub):
    """Publish probes until one reaches the subscriber live (no replay needed): the SUB is connected."""
    for _ in range(100):
        replays = sub.stats["replays"]
        pub.publish([kv.BlockRemoved([999])])
        got = _drain(sub, 3)
        if got and sub.stats["replays"] == replays and not any(d.reset for d in got):
            return
    raise AssertionError("the subscriber never received a live message")


def _send_raw(pub, wire_payload, buffered_payload=None, frames=None):
    """Publish one seq with `wire_payload` on the PUB socket while the replay buffer keeps
    `buffered_payload` (default: the same bytes). Returns the seq."""
    with pub._lock:
        seq = pub._seq
        pub._seq += 1
        pub._buffer.append((seq, wire_payload if buffered_payload is None else buffered_payload))
        pub._pub.send_multipart(frames or (b"", seq.to_bytes(8, "big"), wire_payload))
    return seq


def _batches(deliveries):
    return [(d.seq, d.batch.events[0].block_hashes) for d in deliveries if d.batch is not None]


def test_frame_damaged_on_the_wire_is_recovered_from_the_replay_buffer():
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    sub = kv.KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        _until_live(pub, sub)
        good = kv.encode_batch([kv.BlockRemoved([1])])
        seq = _send_raw(pub, good[:-2], buffered_payload=good)  # truncated on the wire only
        pub.publish([kv.BlockRemoved([2])])
        got = _drain(sub, 5)
        assert _batches(got) == [(seq, [1]), (seq + 1, [2])]
        assert not any(d.reset for d in got)  # nothing lost: no reset
        assert sub.stats["decode_errors"] == 1 and sub.stats["lost_batches"] == 0
        assert f"seq {seq}" in sub.last_decode_error
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize(
    "bad",
    [
        msgpack.packb([1.0, [["BlockRemoved", [3]], ["BlockMoved", [3], [4]]]]),  # an unknown kind
        msgpack.packb([1.0, [["BlockRemoved", [[3, 4]]]]]),  # an unhashable hash
        msgpack.packb([1.0, [["BlockStored", ["3"], None, [1], 1]]]),  # a wrong field type
        kv.encode_batch([kv.BlockRemoved([3])])[:-1],  # truncated, in the buffer too
    ],
    ids=["unknown-kind", "unhashable-hash", "wrong-type", "truncated"],
)
def test_undecodable_batch_is_counted_then_reset_and_the_stream_goes_on(bad):
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    sub = kv.KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        _until_live(pub, sub)
        seq = _send_raw(pub, bad)
        pub.publish([kv.BlockRemoved([5])])
        got = _drain(sub, 5)
        resets = [i for i, d in enumerate(got) if d.reset]
        # One reset, in order: after everything before the bad batch, before everything after it.
        assert len(resets) == 1 and f"seq {seq} is undecodable" in got[resets[0]].reset
        assert _batches(got[resets[0] + 1 :]) == [(seq + 1, [5])]
        assert sub.stats["lost_batches"] == 1
        assert (
            sub.stats["decode_errors"] == 2
        )  # live, then its copy in the replay buffer: retried once
        # It is not retried again, and later batches flow normally: no loop.
        pub.publish([kv.BlockRemoved([6])])
        got = _drain(sub, 5)
        assert _batches(got) == [(seq + 2, [6])] and not any(d.reset for d in got)
        assert sub.stats["decode_errors"] == 2 and sub.stats["resets"] == 1
    finally:
        sub.close()
        pub.close()


def test_undecodable_batch_without_replay_resets_and_continues():
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", None)
    sub = kv.KVEventSubscriber(pub.endpoint, None)
    try:
        for _ in range(100):  # no replay: wait until live messages arrive
            pub.publish([kv.BlockRemoved([999])])
            if _drain(sub, 3):
                break
        seq = _send_raw(pub, b"\x93\x01")
        pub.publish([kv.BlockRemoved([7])])
        got = _drain(sub, 5)
        assert got[0].reset and f"seq {seq}" in got[0].reset
        assert _batches(got[1:]) == [(seq + 1, [7])]
        assert sub.stats["decode_errors"] == 1 and sub.stats["lost_batches"] == 1
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize(
    "frames",
    [
        lambda seq, payload: (b"", payload),  # a frame missing
        lambda seq, payload: (
            b"",
            seq.to_bytes(8, "big")[:3],
            payload,
        ),  # a truncated sequence number
    ],
    ids=["two-frames", "short-seq"],
)
def test_malformed_message_is_counted_and_its_batch_fetched_by_replay(frames):
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    sub = kv.KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        _until_live(pub, sub)
        payload = kv.encode_batch([kv.BlockRemoved([8])])
        with pub._lock:
            seq = pub._seq
        _send_raw(pub, payload, frames=frames(seq, payload))
        got = _drain(
            sub, 5
        )  # nothing follows: the replay after the bad frame must find seq by itself
        assert _batches(got) == [(seq, [8])] and not any(d.reset for d in got)
        assert sub.stats["decode_errors"] == 1
    finally:
        sub.close()
        pub.close()


def test_validation_hook_failures_are_decode_errors():
    """The sidecar's format check (e.g. kvmesh hashes are uint64) rides the same recovery."""

    def no_sevens(batch):
        if any(7 in getattr(e, "block_hashes", []) for e in batch.events):
            raise kv.DecodeError("seven")

    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    sub = kv.KVEventSubscriber(pub.endpoint, pub.replay_endpoint, validate=no_sevens)
    try:
        _until_live(pub, sub)
        pub.publish([kv.BlockRemoved([7])])
        pub.publish([kv.BlockRemoved([8])])
        got = _drain(sub, 5)
        assert got[0].reset and _batches(got[1:])[-1][1] == [8]
        assert sub.stats["lost_batches"] == 1 and "seven" in sub.last_decode_error
    finally:
        sub.close()
        pub.close()
