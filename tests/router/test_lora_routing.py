"""Routing a LoRA adapter request: its block keys are the engine's (the adapter's name and digest on
kvmesh engines, its name on vLLM), replicas listing different digests for one name are each
matched with their own digest's keys, the score prefers prefix > adapter active > free adapter
slot > none, a replica not listing the adapter is never chosen while one does, and the metrics
label stays bounded. Routing runs for real against Redis block sets; no HTTP."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import redis
import redis.asyncio as aioredis

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import key_hex
from kvmesh.common.lora import adapter_identity
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.router import adapters, policies
from kvmesh.router.discovery import Pod
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.pod_traffic import Breaker, PodTraffic
from kvmesh.router.prefix_match import PrefixMatch
from kvmesh.router.prompt_tokens import PromptTokens
from kvmesh.router.request_state import Call
from kvmesh.router.routing import Routing

BS = 4
D1, D2 = "1111111111111111", "2222222222222222"


class Chars:
    def encode(self, text):
        return [ord(c) for c in text]


class Admits:
    def correct(self, call):
        pass


def pod(name, adapters_=None, active=(), max_loras=0, load=0) -> Pod:
    return Pod(
        name,
        f"http://{name}",
        running=load,
        adapters=dict(adapters_ or {}),
        active_adapters=tuple(active),
        max_loras=max_loras,
    )


class Rig:
    def __init__(self, redis_url: str, model: str, pods: list[Pod], engine: str = "kvmesh"):
        self.model = model
        self.pods = pods
        self.sync = redis.Redis.from_url(redis_url)
        self.loop = asyncio.new_event_loop()  # the async client's connections live on one loop
        self.aio = aioredis.Redis.from_url(redis_url)
        metrics = RouterMetrics()
        discovery = SimpleNamespace(redis_fresh=True, routable=lambda: list(self.pods))
        match = PrefixMatch(model, metrics, 1.0)
        match.attach(discovery, self.aio)
        self.tokens = PromptTokens(Chars(), model, BS, engine=engine)
        self.routing = Routing(
            policies.create("prefix"),
            "prefix",
            BS,
            self.tokens,
            match,
            None,
            PodTraffic(Breaker(3, 10.0, metrics)),
            Admits(),
            metrics,
        )
        self.routing.discovery = discovery

    def holds(self, pod_name: str, keys: list[int]) -> None:
        self.sync.sadd(rl.blocks_key(self.model, pod_name), *[key_hex(k) for k in keys])

    def route(self, model: str | None, prompt: str) -> Call:
        req = {"model": model or self.model, "prompt": prompt}
        call = Call(0.0, "/v1/completions", "/v1/completions", {}, "r", [], "c", req=req)
        call.generate = True
        call.chars = len(prompt)

        async def go():
            await self.routing.tokenize(call)
            await self.routing.order(call, list(self.pods))

        self.loop.run_until_complete(go())
        return call

    def close(self):
        self.sync.close()
        self.loop.run_until_complete(self.aio.aclose())
        self.loop.close()


def engine_keys(model: str, prompt: str, name: str | None = None, digest: str = "") -> list[int]:
    """The block keys a kvmesh engine gives the prompt's blocks (engine/request.py)."""
    lora = None if name is None else SimpleNamespace(name=name, int_id=1, digest=digest)
    ids = [ord(c) for c in prompt]
    req = Request("r", ids, SamplingParams(max_tokens=1), set(), model, BS, 4096, lora=lora)
    return req.block_keys(len(ids) // BS)


PROMPT = "the adapter's prompt, five blocks long!!"  # 40 chars: 10 blocks of 4


def test_an_adapter_requests_keys_are_the_kvmesh_engines(redis_server, model_name):
    rig = Rig(redis_server.url, model_name, [pod("a", {"sql": D1}, max_loras=1)])
    try:
        call = rig.route("sql", PROMPT)
        assert call.adapter == "sql" and call.identity == adapter_identity(model_name, "sql", D1)
        assert call.keys == engine_keys(model_name, PROMPT, "sql", D1)
        assert call.keys != engine_keys(model_name, PROMPT)
        base = rig.route(None, PROMPT)
        assert base.adapter is None and base.keys == engine_keys(model_name, PROMPT)
    finally:
        rig.close()


def test_replicas_with_two_digests_for_one_name_are_each_matched_with_their_own_keys(
    redis_server, model_name
):
    pods = [pod("a", {"sql": D1}, max_loras=1), pod("b", {"sql": D2}, max_loras=1)]
    rig = Rig(redis_server.url, model_name, pods)
    try:
        # a holds 3 blocks of its own digest's keys, b 6 of its own; neither holds the other's
        rig.holds("a", engine_keys(model_name, PROMPT, "sql", D1)[:3])
        rig.holds("b", engine_keys(model_name, PROMPT, "sql", D2)[:6])
        call = rig.route("sql", PROMPT)
        assert {c.name: c.matched_blocks for c in call.ordered} == {"a": 3, "b": 6}
        assert call.ordered[0].name == "b" and call.predicted == 6 * BS
        # the usual digest is the smaller of equals: the call's own keys are D1's
        assert call.keys == engine_keys(model_name, PROMPT, "sql", D1)
    finally:
        rig.close()


def test_prefix_beats_active_beats_free_slot_beats_none(redis_server, model_name):
    lists = {"sql": D1, "chat": D2}
    pods = [
        pod("full", lists, active=("chat",), max_loras=1),  # no slot for sql
        pod("free", lists, active=(), max_loras=1),  # a free slot
        pod("active", lists, active=("sql",), max_loras=1),  # sql in its batch
        pod("prefix", lists, active=("chat",), max_loras=1),  # holds the prompt, no slot
    ]
    rig = Rig(redis_server.url, model_name, pods)
    try:
        rig.holds("prefix", engine_keys(model_name, PROMPT, "sql", D1))
        chosen = []
        for _ in range(4):
            call = rig.route("sql", PROMPT)
            chosen.append(call.ordered[0].name)
            rig.pods = [p for p in rig.pods if p.name != chosen[-1]]
        assert chosen == ["prefix", "active", "free", "full"]
        assert [adapters.affinity(p, "sql") for p in pods] == [0.0, 0.5, 1.0, 0.0]
    finally:
        rig.close()


def test_a_replica_not_listing_the_adapter_is_not_chosen_while_one_does(redis_server, model_name):
    pods = [pod("bare", load=0), pod("busy", {"sql": D1}, active=("a", "b"), max_loras=2, load=9)]
    rig = Rig(redis_server.url, model_name, pods)
    try:
        rig.holds("bare", engine_keys(model_name, PROMPT, "sql", D1))
        call = rig.route("sql", PROMPT)
        assert [c.name for c in call.ordered] == ["busy"] and call.adapter_label == "sql"
        # an adapter no replica lists goes by load, to every replica (the engine answers 404)
        call = rig.route("nobody", PROMPT)
        assert [c.name for c in call.ordered] == ["bare", "busy"]
        assert call.adapter_label == adapters.OTHER_LABEL
        # the base model goes to every replica, without lora affinity
        call = rig.route(None, PROMPT)
        assert {c.name for c in call.ordered} == {"bare", "busy"} and call.adapter_label == ""
        assert all(c.affinity == 0.0 for c in call.ordered)
    finally:
        rig.close()


def test_vllm_adapters_key_from_their_name_whatever_the_digest(redis_server, model_name):
    from kvmesh.common.block_keys import block_keys

    pods = [pod("a", {"sql": ""}, max_loras=1), pod("b", {"sql": ""}, max_loras=1)]
    rig = Rig(redis_server.url, model_name, pods, engine="vllm")
    try:
        keys = block_keys([ord(c) for c in PROMPT], "sql", BS)
        rig.holds("b", keys[:5])
        call = rig.route("sql", PROMPT)
        assert call.keys == keys and call.ordered[0].name == "b"
        assert call.ordered[0].matched_blocks == 5
    finally:
        rig.close()


def test_metric_labels_stay_bounded_to_the_adapters_replicas_list():
    pods = [pod("a", {"sql": D1}), pod("b", {"chat": D2})]
    assert adapters.label(pods, None) == ""
    assert adapters.label(pods, "chat") == "chat"
    assert {adapters.label(pods, f"junk-{i}") for i in range(1000)} == {"other"}
    metrics = RouterMetrics()
    for name in ("sql", *[f"junk-{i}" for i in range(100)]):
        metrics.predicted_cached.labels(adapters.label(pods, name)).inc(16)
    text = metrics.render().decode()
    series = [
        line
        for line in text.splitlines()
        if line.startswith("kvmesh_router_predicted_cached_tokens_total{")
    ]
    assert sorted(series) == [
        'kvmesh_router_predicted_cached_tokens_total{adapter="other"} 1600.0',
        'kvmesh_router_predicted_cached_tokens_total{adapter="sql"} 16.0',
    ]


def test_models_through_the_router_list_the_base_and_the_adapters_ready_replicas_serve():
    from kvmesh.router.app import Router, RouterConfig

    router = Router(RouterConfig(model="base", redis_url=None), encoder=Chars())
    pods = [pod("a", {"sql": D1, "chat": D2}), pod("b", {"sql": D2, "code": ""}), pod("c")]
    router.discovery = SimpleNamespace(routable=lambda: pods)
    cards = router.model_cards()
    assert [(c["id"], c.get("parent")) for c in cards] == [
        ("base", None),
        ("chat", "base"),
        ("code", "base"),
        ("sql", "base"),
    ]
    router.discovery = SimpleNamespace(routable=lambda: [])
    assert [c["id"] for c in router.model_cards()] == ["base"]
