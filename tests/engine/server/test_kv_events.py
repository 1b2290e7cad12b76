"""KV events (contract 2): a ZMQ subscriber sees the blocks the engine stores and evicts."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvmesh.common.block_keys import block_key, block_keys, root_key
from kvmesh.common.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
)
from kvmesh_testing.core_hooks import HookedCoreLoop
from tests.engine.server.conftest import ThreadServer, free_port, wait_for

MODEL = "tiny"
BS = 16


@pytest.fixture(scope="module")
def server(tiny_model):
    pub, replay = free_port(), free_port()
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            "24",
            "--max-model-len",
            "256",
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{pub}",
            "--kv-events-replay-endpoint",
            f"tcp://127.0.0.1:{replay}",
        ],
        core_loop=HookedCoreLoop,
    ).start()
    srv.pub_endpoint = f"tcp://127.0.0.1:{pub}"
    srv.replay_endpoint = f"tcp://127.0.0.1:{replay}"
    yield srv
    srv.stop()


def _subscribe(endpoint: str):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # ZMQ's slow joiner: messages published before the handshake are lost. Wait for it, then give
    # the subscription frame that follows it a moment to reach the publisher.
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        assert monitor.poll(10_000), f"no ZMQ handshake with {endpoint}"
        recv_monitor_message(monitor)
    finally:
        sub.disable_monitor()
        monitor.close(0)
    time.sleep(0.1)
    return sub


def _drain(sub, quiet_s: float = 0.5) -> list[tuple[int, bytes]]:
    out = []
    while sub.poll(int(quiet_s * 1000)):
        _, seq, payload = sub.recv_multipart()
        out.append((int.from_bytes(seq, "big"), payload))
    return out


def _replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(3000), "replay socket did not answer"
            frames = dealer.recv_multipart()[-2:]
            if frames[0] == END_SEQ:
                return out
            out.append((int.from_bytes(frames[0], "big"), frames[1]))
    finally:
        dealer.close(0)


def _complete(server, prompt_ids, max_tokens=4):
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_events_match_blocks_stored_and_evicted(server):
    """Every BlockStored chains from its parent (the model's root for None, else a live block),
    including blocks after a prefix hit and a block filled by decoding; what a subscriber derives
    from the events is the engine's prefix cache, parents included."""
    sub = _subscribe(server.pub_endpoint)
    try:
        prompts = [
            [100 + 7 * p + i for i in range(5 * BS + 3)] for p in range(6)
        ]  # 5 full blocks each
        for ids in prompts:
            _complete(server, ids)
        # A prefix hit: the newest prompt's first 3 blocks, then 2 new ones chained from block 3.
        hit = prompts[-1][: 3 * BS] + [5000 + i for i in range(2 * BS + 3)]
        assert _complete(server, hit)["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
        # A block filled by decoding: 2 full prompt blocks + 10 tokens, then 10 generated tokens;
        # block 3 (10 prompt + 6 generated tokens) becomes full, and is stored, during decode.
        filled = [7000 + i for i in range(2 * BS + 10)]
        _complete(server, filled, max_tokens=10)
        messages = _drain(sub)
    finally:
        sub.close(0)
    seqs = [s for s, _ in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers are consecutive"

    stored: set[int] = set()
    removed: set[int] = set()
    live: set[int] = set()
    parent_of: dict[int, int | None] = {}
    events_with_parent: list[BlockStored] = []
    root = root_key(MODEL)
    for _, payload in messages:
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BS and len(ev.token_ids) == BS * len(ev.block_hashes)
                if ev.parent_block_hash is not None:
                    assert ev.parent_block_hash in live, "a parent is a block the engine holds"
                    events_with_parent.append(ev)
                parent = ev.parent_block_hash if ev.parent_block_hash is not None else root
                for i, h in enumerate(
                    ev.block_hashes
                ):  # every hash is the contract-1 key of its tokens
                    parent_of[h] = None if parent == root else parent
                    parent = block_key(parent, ev.token_ids[i * BS : (i + 1) * BS])
                    assert h == parent
                stored.update(ev.block_hashes)
                live.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= live, "only stored blocks are removed"
                removed.update(ev.block_hashes)
                live.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
    for ids in prompts:
        assert set(block_keys(ids, MODEL, BS)) <= stored
    # 6 prompts x 5 blocks do not fit 24 blocks: the oldest were evicted and reported.
    assert removed and set(block_keys(prompts[0], MODEL, BS)) & removed

    # The prefix hit: its new blocks chain from the shared block 3, and are the router's keys.
    hit_keys = block_keys(hit, MODEL, BS)
    (after_hit,) = [e for e in events_with_parent if e.parent_block_hash == hit_keys[2]]
    assert after_hit.block_hashes == hit_keys[3:] and after_hit.token_ids == hit[3 * BS : 5 * BS]
    # The decode-filled block: chained from the prompt's block 2, its first 10 tokens the prompt's tail.
    filled_keys = block_keys(filled, MODEL, BS)
    assert len(filled_keys) == 2
    (decoded,) = [e for e in events_with_parent if e.parent_block_hash == filled_keys[1]]
    assert len(decoded.block_hashes) == 1 and decoded.token_ids[:10] == filled[2 * BS :]
    assert decoded.block_hashes[0] in live

    # What the subscriber derived is exactly what the engine's prefix cache holds now, parents too.
    # (read in the engine core's process)
    cached = server.state.engine.call_utility("hook", "kvmesh_testing.core_hooks:cached_blocks")
    assert live == set(cached)
    assert cached == {k: parent_of[k] for k in live}


def test_missed_sequence_is_recovered_through_replay(server):
    sub = _subscribe(server.pub_endpoint)
    try:
        _complete(server, [900 + i for i in range(3 * BS + 1)])
        _complete(server, [1900 + i for i in range(3 * BS + 1)])
        messages = _drain(sub)
    finally:
        sub.close(0)
    assert len(messages) >= 2
    # Pretend the first live message was lost: the gap is seen at the next one, replay fills it.
    lost_seq, lost_payload = messages[0]
    seen_next = messages[1][0]
    assert seen_next > lost_seq
    replayed = _replay(server.replay_endpoint, lost_seq)
    assert replayed[0] == (lost_seq, lost_payload)
    assert [s for s, _ in replayed] == list(range(lost_seq, lost_seq + len(replayed)))
    assert dict(replayed)[seen_next] == messages[1][1]


def test_sidecar_subscriber_catches_up_from_zero(server):
    from kvmesh.common.kv_events import KVEventSubscriber

    sub = KVEventSubscriber(server.pub_endpoint, server.replay_endpoint)
    try:
        deliveries = wait_for(lambda: sub.poll(200), timeout=10)
        assert deliveries[0].seq == 0 and all(d.batch is not None for d in deliveries)
    finally:
        sub.close()
