import time

import msgpack
import pytest
import zmq

from kvmesh.common import kv_events as kv
from tests.router import vllm_structs as vs


def test_encoder_is_byte_identical_to_vllm_msgspec():
    ours = kv.encode_batch([
        kv.BlockStored([1, 2**64 - 1], None, list(range(32)), 16, None, "GPU"),
        kv.BlockRemoved([7], None),
        kv.AllBlocksCleared(),
    ], ts=1234.5)
    theirs = vs.encode(vs.KVEventBatch(ts=1234.5, events=[
        vs.BlockStored([1, 2**64 - 1], None, list(range(32)), 16, None, "GPU"),
        vs.BlockRemoved([7], None),
        vs.AllBlocksCleared(),
    ]))
    assert ours == theirs


def test_decoder_reads_vllm_bytes_with_bytes_hashes_and_dp_rank():
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    payload = vs.encode(vs.KVEventBatch(ts=1.0, data_parallel_rank=3, events=[
        vs.BlockStored([h1, h2], b"\x00" * 32, list(range(32)), 16, 5, "GPU"),
        vs.BlockRemoved([h1], "CPU"),
        vs.AllBlocksCleared(),
    ]))
    batch = kv.decode_batch(payload)
    assert batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert stored == kv.BlockStored([h1, h2], b"\x00" * 32, list(range(32)), 16, 5, "GPU")
    assert removed == kv.BlockRemoved([h1], "CPU")
    assert isinstance(cleared, kv.AllBlocksCleared)


def test_decoder_tolerates_missing_and_extra_trailing_fields():
    payload = msgpack.packb([2.0, [["BlockStored", [1], None, [1, 2], 2],  # older: no lora/medium
                                   ["BlockStored", [2], 1, [3, 4], 2, None, "GPU", "lora-x", 9],  # newer
                                   ["BlockRemoved", [1]],
                                   ["SomethingNew", 1]]])
    batch = kv.decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert batch.events[1].medium == "GPU" and batch.data_parallel_rank is None
    with pytest.raises(kv.DecodeError):
        kv.decode_batch(b"\xc1garbage")


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
            got.append((int.from_bytes(frames[1], "big"), kv.decode_batch(frames[2]).events[0].block_hashes))
        assert got == [(3, [3]), (4, [4])]
        dealer.close(0)
    finally:
        pub.close()


def test_subscriber_catches_up_fills_gaps_and_detects_restart():
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    sub = kv.KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.publish([kv.BlockRemoved([0])])  # before the subscriber's first poll: caught up by replay
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
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2)
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
        assert got[0].reset and "no longer holds" in got[0].reset
        assert [d.seq for d in got[1:]] == [3, 4]
    finally:
        pub.close()
        sub.close()
