"""The sidecar's vLLM mode without a vLLM: events as vLLM 0.32 encodes them (maps, `lora_name`),
its 4-frame replay answers, and its readiness read from /health and /v1/models.

tests/vllm/ runs the same against the real vLLM CPU build."""

from __future__ import annotations

import threading

import httpx
import msgpack
import zmq

from kvmesh.common import kv_events as kv
from kvmesh.common.block_keys import block_keys
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.engine_probe import read_engine
from kvmesh.sidecar.index_writer import BlockIndex

BS = 4


def _vllm_stored(hashes, parent, tokens, lora_name=None) -> dict:
    """A BlockStored as vLLM 0.32's msgspec encodes it: a map with its tag, defaults omitted."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": 1 if lora_name else None,
        "medium": "GPU",
        "lora_name": lora_name,
        "extra_keys": [[lora_name] if lora_name else None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def test_map_encoded_events_decode_by_name_and_adapters_chain_from_their_own_root(model_name):
    tokens = list(range(100, 100 + 2 * BS))
    payload = msgpack.packb(
        [
            1.0,
            [
                _vllm_stored([11, 12], None, tokens),
                _vllm_stored([21], None, tokens[:BS], lora_name="sql-adapter"),
                {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"},
            ],
            0,
        ]
    )
    batch = kv.decode_batch(payload)
    assert batch.events[1].lora_name == "sql-adapter" and batch.events[0].lora_name is None
    index = BlockIndex(
        SidecarConfig("p", "u", model=model_name, engine_format="vllm", block_size=BS)
    )
    added: set[int] = set()
    removed: set[int] = set()
    for ev in batch.events:
        (index.stored if isinstance(ev, kv.BlockStored) else index.removed)(ev, added, removed)
    base = block_keys(tokens, model_name, BS)
    adapter = block_keys(tokens[:BS], "sql-adapter", BS)
    assert set(index.refs) == {base[0], adapter[0]} and adapter[0] != base[0]


def test_a_4_frame_replay_answer_is_read(model_name):
    """vLLM 0.32 answers `[b"", topic, seq, payload]` and ends with `[b"", b"", -1, b""]`."""
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind("tcp://127.0.0.1:*")
    router.bind("tcp://127.0.0.1:*")
    payload = msgpack.packb([1.0, [_vllm_stored([7], None, list(range(BS)))], 0])

    def serve():
        client, _, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        router.send_multipart((client, b"", b"", (0).to_bytes(8, "big"), payload))
        router.send_multipart((client, b"", b"", kv.END_SEQ, b""))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    sub = kv.KVEventSubscriber(
        pub.getsockopt_string(zmq.LAST_ENDPOINT), router.getsockopt_string(zmq.LAST_ENDPOINT)
    )
    try:
        deliveries = sub.poll(50)
        assert [d.seq for d in deliveries] == [0] and sub.next_seq == 1
        assert sub.stats["decode_errors"] == 0 and sub.replay_problem is None
    finally:
        sub.close()
        pub.close(0)
        router.close(0)
        t.join(2)


class FakeVllm:
    """vLLM's HTTP surface as the sidecar reads it: no /ready."""

    def __init__(self, served: str):
        self.served = served
        self.block_size = BS
        self.health = 200

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(self.health)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": self.served}]})
        if path == "/metrics":
            return httpx.Response(
                200,
                text=(
                    'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
                    'vllm:num_requests_running{engine="0"} 2.0\n'
                    f'vllm:cache_config_info{{block_size="{self.block_size}",num_gpu_blocks="728"}} 1.0\n'
                ),
            )
        return httpx.Response(404, json={"detail": "Not Found"})


def test_vllm_readiness_comes_from_health_and_models_and_each_problem_is_named():
    engine = FakeVllm("m")
    client = httpx.Client(transport=httpx.MockTransport(engine.handle))
    url = "http://engine"
    reading = read_engine(client, url, "vllm", "m", BS)
    assert reading.ready and reading.problem is None
    assert (reading.load.kv_usage, reading.load.running, reading.load.total_blocks) == (0.5, 2, 728)
    # The same engine read as ours: its /ready is a 404, and the reading says what to change.
    ours = read_engine(client, url, "kvmesh", "m", BS)
    assert not ours.ready and "--engine-format vllm" in ours.problem
    assert "not 'other'" in read_engine(client, url, "vllm", "other", BS).problem
    engine.block_size = 16
    reading = read_engine(client, url, "vllm", "m", BS)
    assert reading.ready and "block size is 16" in reading.problem
    engine.health = 503
    reading = read_engine(client, url, "vllm", "m", BS)
    assert not reading.ready and "/health answered 503" in reading.problem
