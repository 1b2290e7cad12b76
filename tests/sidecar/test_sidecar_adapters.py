"""LoRA adapters in the heartbeat: ``adapters`` from the engine's /v1/models (entries whose parent
is the base, the digest a kvmesh engine adds, "" from vLLM), ``active_adapters`` and ``max_loras``
from ``vllm:lora_requests_info``; an engine listing 10,000 models has its first 1,024 adapters
carried. Beats are driven by hand against a mock engine and a real Redis."""

from __future__ import annotations

import logging
from collections import Counter

import httpx
import redis

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys
from kvmesh.common.kv_events import BlockStored
from kvmesh.common.lora import MODEL_CARD_DIGEST, decode_adapters, vllm_adapter_identity
from kvmesh.sidecar.adapters import MAX_ADAPTERS
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.heartbeat import Heartbeat
from kvmesh.sidecar.index_writer import BlockIndex, IndexWriter


class LoraEngine:
    """An engine's /ready, /health, /v1/models and /metrics, serving `adapters` (name -> digest)."""

    def __init__(self, base: str, adapters: dict[str, str], vllm: bool = False):
        self.base = base
        self.adapters = adapters
        self.vllm = vllm
        self.info = 'max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="chat"'
        self.others: list[dict] = []  # further entries (other bases, junk)

    def models(self) -> list[dict]:
        data = [{"id": self.base, "object": "model", "parent": None}]
        for name, digest in self.adapters.items():
            entry = {"id": name, "object": "model", "parent": self.base, "root": f"/a/{name}"}
            if not self.vllm:
                entry[MODEL_CARD_DIGEST] = digest
            data.append(entry)
        return data + self.others

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/ready", "/health"):
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": self.models()})
        if path == "/metrics":
            lora = f"vllm:lora_requests_info{{{self.info}}} 1700000000.0\n" if self.info else ""
            return httpx.Response(200, text="vllm:num_requests_running 1\n" + lora)
        return httpx.Response(404)


class NoEvents:
    def problem(self):
        return None

    def request_resync(self, reason):
        pass


def _beat(
    redis_url: str,
    model: str,
    engine: LoraEngine,
    fmt: str = "kvmesh",
    beats: int = 1,
    between=None,
) -> dict[str, str]:
    cfg = SidecarConfig(
        pod_name="pod-a",
        pod_url="http://pod-a:8000",
        model=model,
        engine_url="http://engine",
        redis_url=redis_url,
        engine_format=fmt,
        block_size=16,
    )
    stats: Counter = Counter()
    hb = Heartbeat(cfg, IndexWriter(cfg, stats), NoEvents(), stats)
    client = httpx.Client(transport=httpx.MockTransport(engine.handle))
    try:
        for i in range(beats):
            if i and between is not None:
                between()
            hb.beat(client)
        raw = redis.Redis.from_url(redis_url).hgetall(rl.heartbeat_key(model, "pod-a"))
        return {k.decode(): v.decode() for k, v in raw.items()}
    finally:
        client.close()
        hb.close()


def test_a_kvmesh_engines_adapters_digests_and_batch_are_in_its_heartbeat(redis_server, model_name):
    engine = LoraEngine(model_name, {"sql": "0123456789abcdef", "chat": "fedcba9876543210"})
    engine.others = [{"id": "other-base-adapter", "parent": "other-base"}, "junk", {"id": 3}]
    fields = _beat(redis_server.url, model_name, engine)
    assert decode_adapters(fields[rl.F_ADAPTERS]) == {
        "sql": "0123456789abcdef",
        "chat": "fedcba9876543210",
    }
    assert fields[rl.F_ACTIVE_ADAPTERS] == "sql" and fields[rl.F_MAX_LORAS] == "2"
    hb = rl.Heartbeat.from_mapping("pod-a", fields)
    assert (hb.active_adapters, hb.max_loras) == (("sql",), 2)


def test_vllm_publishes_no_digest_and_its_adapters_read_as_empty_digests(redis_server, model_name):
    engine = LoraEngine(model_name, {"sql": "ignored"}, vllm=True)
    fields = _beat(redis_server.url, model_name, engine, fmt="vllm")
    assert decode_adapters(fields[rl.F_ADAPTERS]) == {"sql": ""}
    assert fields[rl.F_MAX_LORAS] == "2"


def test_an_engine_without_lora_has_no_adapter_fields_and_a_restart_without_clears_them(
    redis_server, model_name
):
    engine = LoraEngine(model_name, {"sql": "0123456789abcdef"})
    assert rl.F_ADAPTERS in _beat(redis_server.url, model_name, engine)

    def restart_without_lora():
        engine.info = ""  # no --enable-lora: no lora_requests_info

    fields = _beat(redis_server.url, model_name, engine, beats=2, between=restart_without_lora)
    assert not {rl.F_ADAPTERS, rl.F_ACTIVE_ADAPTERS, rl.F_MAX_LORAS} & set(fields)
    assert fields[rl.F_STATE] == rl.STATE_READY


def test_an_engine_listing_10000_models_has_its_first_1024_adapters_carried(
    redis_server, model_name, caplog
):
    engine = LoraEngine(model_name, {f"a{i:05d}": f"{i:016x}" for i in range(10_000)})
    with caplog.at_level(logging.WARNING, logger="kvmesh.sidecar"):
        fields = _beat(redis_server.url, model_name, engine)
    carried = decode_adapters(fields[rl.F_ADAPTERS], limit=10_000)
    assert carried == {f"a{i:05d}": f"{i:016x}" for i in range(MAX_ADAPTERS)}
    assert MAX_ADAPTERS == 1024
    assert [r.getMessage() for r in caplog.records if "lists" in r.getMessage()] == [
        "the engine lists 10001 models; heartbeats carry its first 1024 adapters"
    ]


def test_a_vllm_adapters_blocks_are_indexed_from_the_shared_identity(model_name):
    index = BlockIndex(
        SidecarConfig("p", "u", model=model_name, engine_format="vllm", block_size=4)
    )
    tokens = list(range(8))
    added: set[int] = set()
    index.stored(BlockStored([1, 2], None, tokens, 4, 1, "GPU", "sql"), added, set())
    assert added == set(block_keys(tokens, vllm_adapter_identity("sql"), 4))


def test_a_kvmesh_engine_refusing_models_without_the_key_is_a_problem_not_adapters():
    """Behind an API key the engine answers /v1/models 401 to a sidecar without the key: its
    adapters stay unknown and the reading says why."""
    from kvmesh.sidecar.engine_probe import read_engine

    engine = LoraEngine("base", {"sql": "0123456789abcdef"})
    handle = engine.handle

    def keyed(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models" and "authorization" not in request.headers:
            return httpx.Response(401)
        return handle(request)

    with httpx.Client(transport=httpx.MockTransport(keyed)) as client:
        reading = read_engine(client, "http://engine", "kvmesh", "base", 16)
        assert reading.adapters is None
        assert reading.problem == (
            "GET http://engine/v1/models answered 401 (the sidecar needs KVMESH_ENGINE_API_KEY)"
        )
    with httpx.Client(
        transport=httpx.MockTransport(keyed), headers={"Authorization": "Bearer k"}
    ) as client:
        reading = read_engine(client, "http://engine", "kvmesh", "base", 16)
        assert reading.adapters == {"sql": "0123456789abcdef"} and reading.problem is None
