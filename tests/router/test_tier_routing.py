"""Routing with KV tiers: per-pod (g, c, s) matches from a real Redis (script and pipeline
alike), the score by the prefill work each pod's tiers save, the ``tier_match`` reason, the
predicted cached tokens and the per-medium metrics; junk and huge tier sets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from kvmesh.common import kv_tiers as kt
from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import key_hex
from kvmesh.router import policies
from kvmesh.router.auth import RateLimiter
from kvmesh.router.discovery import Pod
from kvmesh.router.discovery.join import _pod
from kvmesh.router.discovery.sources import Endpoint
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.policies import RouteRequest
from kvmesh.router.prefix_match import PrefixMatch, predicted_by_medium, tier_run
from kvmesh.router.proxy import Outcome
from kvmesh.router.request_state import Call
from kvmesh.router.scoring import Candidate, Weights, rank
from kvmesh.router.settle import settle
from tests.router.test_lora_routing import Rig

KEYS = list(range(101, 107))  # a prompt of six full blocks
BS = 4


def pod(name, host=False, shared=False, load=0, costs=None) -> Pod:
    return Pod(
        name, f"http://{name}", running=load, host_tier=host, shared_tier=shared, costs=costs
    )


def hexes(*keys):
    return [key_hex(k) for k in keys]


class Matcher:
    """A PrefixMatch on a real Redis, run on its own event loop."""

    def __init__(self, url: str, model: str):
        self.loop = asyncio.new_event_loop()
        self.aio = aioredis.Redis.from_url(url)
        self.pm = PrefixMatch(model, RouterMetrics(), 1.0)
        self.pm.attach(SimpleNamespace(redis_fresh=True), self.aio)

    def match(self, pods, keys=KEYS, lua=True):
        self.pm._use_lua = lua
        return self.loop.run_until_complete(self.pm.match(pods, keys))

    def close(self):
        self.loop.run_until_complete(self.aio.aclose())
        self.loop.close()


@pytest.fixture
def matcher(redis_server, model_name):
    m = Matcher(redis_server.url, model_name)
    yield m
    m.close()


def fill(r, model, gpu=None, host=None, shared=None):
    for name, keys in (gpu or {}).items():
        r.sadd(rl.blocks_key(model, name), *hexes(*keys))
    for name, keys in (host or {}).items():
        r.sadd(kt.host_blocks_key(model, name), *hexes(*keys))
    if shared:
        r.zadd(kt.shared_blocks_key(model), dict.fromkeys(hexes(*shared), 1.0))


PODS = [
    pod("a", host=True, shared=True),
    pod("b"),
    pod("c", shared=True),
    pod("d", shared=True),
    pod("e", host=True),
    pod("f", host=True, shared=True),
]
EXPECTED = {
    "a": (2, 1, 2),  # GPU 101-102, host 103, shared 104-105
    "b": (1, 0, 0),  # no tiers: the GPU run only, though the shared set has more
    "c": (0, 0, 0),  # the shared set does not hold the first block
    "d": (3, 0, 2),
    "e": (0, 6, 0),  # all in its host tier
    "f": (0, 2, 3),  # host and shared interleaved: 101 host, 102 shared, 103 host, 104-105 shared
}


@pytest.mark.parametrize("lua", [True, False], ids=["script", "pipeline"])
def test_match_counts_each_tier_up_to_the_first_miss(matcher, redis_server, model_name, lua):
    fill(
        redis_server.client(),
        model_name,
        gpu={"a": [101, 102], "b": [101], "d": [101, 102, 103]},
        host={"a": [103], "e": KEYS, "f": [101, 103], "b": KEYS},
        shared=[102, 104, 105],
    )
    got = matcher.match(PODS, lua=lua)
    assert {k: tuple(v) for k, v in got.items()} == EXPECTED


@pytest.mark.parametrize("lua", [True, False], ids=["script", "pipeline"])
def test_junk_tier_keys_count_as_empty(matcher, redis_server, model_name, lua):
    r = redis_server.client()
    fill(r, model_name, gpu={"a": [101]}, host={"e": [101, 102]})
    r.set(kt.shared_blocks_key(model_name), "not a sorted set")
    r.hset(kt.host_blocks_key(model_name, "a"), "junk", "1")
    got = matcher.match([pod("a", host=True, shared=True), pod("e", host=True)], lua=lua)
    assert {k: tuple(v) for k, v in got.items()} == {"a": (1, 0, 0), "e": (0, 2, 0)}


@pytest.mark.parametrize("lua", [True, False], ids=["script", "pipeline"])
def test_junk_members_match_nothing(matcher, redis_server, model_name, lua):
    r = redis_server.client()
    r.zadd(kt.shared_blocks_key(model_name), {"zz": 1, "": 2, "x" * 4096: 3, "101": 4})
    r.sadd(kt.host_blocks_key(model_name, "a"), "junk", key_hex(101) + " ", key_hex(101)[1:])
    got = matcher.match([pod("a", host=True, shared=True)], lua=lua)
    assert tuple(got["a"]) == (0, 0, 0)


def test_a_huge_shared_set_costs_what_the_prompt_matches(matcher, redis_server, model_name):
    r = redis_server.client()
    pipe = r.pipeline(transaction=False)
    for i in range(0, 200_000, 20_000):
        pipe.zadd(
            kt.shared_blocks_key(model_name),
            {key_hex(k): float(k) for k in range(10_000 + i, 30_000 + i)},
        )
    pipe.execute()
    fill(r, model_name, shared=[101, 102, 103])
    assert r.zcard(kt.shared_blocks_key(model_name)) > 200_000
    assert tuple(matcher.match([pod("c", shared=True)])["c"]) == (0, 0, 3)


def test_tier_run_matches_the_script():
    gpu = [1, 1, 0, 0, 0, 0]
    host = [0, 0, 1, 0, 1, 0]
    shared = [None, None, None, b"1", None, None]
    assert tier_run(gpu, host, shared) == (2, 2, 1)
    assert tier_run(gpu, None, shared) == (2, 0, 0)
    assert tier_run([1, 1], [1, 1], None) == (2, 0, 0)


# -- ranking -----------------------------------------------------------------------------------


def cand(name, g=0, c=0, s=0, load=0, costs=None) -> Candidate:
    return Candidate(
        name,
        f"http://{name}",
        load=load,
        matched_blocks=g,
        cpu_blocks=c,
        shared_blocks=s,
        costs=costs,
    )


def names(ordered):
    return [c.name for c in ordered]


def test_a_shared_hit_on_an_idle_pod_beats_a_loaded_pod_that_computed_the_prefix():
    ordered = rank(
        [cand("computed", g=8, load=4), cand("shared", s=8), cand("other", load=4)],
        8,
        Weights(),
        b"t",
    )
    assert names(ordered)[0] == "shared"
    # without its shared-tier hit the idle pod is not worth it
    ordered = rank(
        [cand("computed", g=8, load=4), cand("shared"), cand("other", load=4)], 8, Weights(), b"t"
    )
    assert names(ordered)[0] == "computed"


@pytest.mark.parametrize("tie", [b"a", b"b", b"c", b"d"])
def test_gpu_beats_cpu_beats_shared_at_equal_load(tie):
    ordered = rank(
        [cand("shared", s=6, load=1), cand("cpu", c=6, load=1), cand("gpu", g=6, load=1)],
        6,
        Weights(),
        tie,
    )
    assert names(ordered) == ["gpu", "cpu", "shared"]


def test_costs_from_heartbeats_change_the_order():
    slow_host = kt.BlockCosts.from_mapping(
        {kt.F_COST_PREFILL: "0.01", kt.F_COST_CPU: "0.009", kt.F_COST_SHARED: "0.001"}
    )
    a, b = cand("cpu", c=6, costs=slow_host), cand("shared", s=6)
    assert names(rank([a, b], 6, Weights(), b"t")) == ["shared", "cpu"]
    assert names(rank([cand("cpu", c=6), cand("shared", s=6)], 6, Weights(), b"t")) == [
        "cpu",
        "shared",
    ]


def test_a_pod_without_tiers_scores_as_before():
    c = cand("p", g=3, load=0)
    rank([c], 6, Weights(), b"t")
    assert c.score == pytest.approx(0.5)


def test_heartbeat_costs_reach_the_pod():
    costs = kt.BlockCosts(0.02, 0.01, 0.015)
    hb = rl.Heartbeat("p", "http://p", costs=costs, host_blocks=10, shared_tier=True)
    p = _pod("p", Endpoint("p", "http://p"), hb, False)
    assert p.costs == costs and p.host_tier and p.shared_tier
    p = _pod("p", Endpoint("p", "http://p"), rl.Heartbeat("p", "http://p"), False)
    assert p.costs is None and not p.host_tier and not p.shared_tier


# -- the prefix policy's reason, the prediction ---------------------------------------------------


def reason(matched):
    async def match():
        return matched

    cands = [cand("pod-0"), cand("pod-1")]
    req = RouteRequest(cands, KEYS, {}, b"t", match)
    ordered, why = asyncio.run(policies.create("prefix").order(req))
    return ordered[0].name, why


def test_the_reason_says_where_the_saving_comes_from():
    assert reason({"pod-1": (0, 0, 3)}) == ("pod-1", "tier_match")
    assert reason({"pod-1": (0, 2, 0)}) == ("pod-1", "tier_match")
    assert reason({"pod-1": (1, 2, 3)}) == ("pod-1", "prefix_match")
    assert reason({"pod-1": 2}) == ("pod-1", "prefix_match")  # a bare count: the KV cache
    assert reason({})[1] == "no_match"


def test_predicted_tokens_split_by_tier_and_capped():
    c = cand("p", g=2, c=2, s=2)
    assert predicted_by_medium(c, 6, BS) == {"GPU": 8, "CPU": 8, "SHARED": 8}
    assert predicted_by_medium(c, 5, BS) == {"GPU": 8, "CPU": 8, "SHARED": 4}
    assert predicted_by_medium(c, 1, BS) == {"GPU": 4, "CPU": 0, "SHARED": 0}


def test_routing_predicts_across_tiers(redis_server, model_name):
    pods = [pod("hot", load=3), pod("tiered", host=True, shared=True)]
    rig = Rig(redis_server.url, model_name, pods)
    try:
        prompt = "x" * (6 * BS + 1)
        keys = rig.route(None, prompt).keys
        assert len(keys) == 6
        r = redis_server.client()
        fill(r, model_name, gpu={"hot": keys, "tiered": keys[:1]}, host={"tiered": keys[1:3]})
        fill(r, model_name, shared=keys[3:])
        call = rig.route(None, prompt)
        assert call.ordered[0].name == "tiered" and call.reason == "prefix_match"
        assert call.predicted_by_medium == {"GPU": 4, "CPU": 8, "SHARED": 12}
        assert call.predicted == 24
    finally:
        rig.close()


# -- metrics per medium -------------------------------------------------------------------------


def value(m: RouterMetrics, name: str, medium: str) -> float:
    return m.registry.get_sample_value(name + "_total", {"medium": medium}) or 0.0


def test_metrics_count_predicted_and_engine_tokens_per_medium():
    m = RouterMetrics()
    call = Call(0.0, "/v1/completions", "/v1/completions", {}, "r", [], "c")
    call.predicted, call.predicted_by_medium = 12, {"GPU": 4, "CPU": 0, "SHARED": 8}
    usage = {
        "total_tokens": 20,
        "prompt_tokens_details": {
            "cached_tokens": 12,
            kt.USAGE_BY_MEDIUM: {"GPU": 4, "SHARED": 8, "NVMe": 99, "CPU": "junk"},
        },
    }
    settle(call, Outcome(200, "http://p", usage=usage), m, RateLimiter(), "prefix")
    got = {
        md: (
            value(m, "kvmesh_router_predicted_cached_tokens_by_medium", md),
            value(m, "kvmesh_router_engine_cached_tokens_by_medium", md),
        )
        for md in ("GPU", "CPU", "SHARED", "NVMe")
    }
    assert got == {"GPU": (4, 4), "CPU": (0, 0), "SHARED": (8, 8), "NVMe": (0, 0)}
    assert (
        m.registry.get_sample_value(
            "kvmesh_router_engine_cached_tokens_by_medium_total", {"medium": "NVMe"}
        )
        is None
    )  # never a label value beyond the three media
    # an engine without tiers says nothing per medium
    settle(
        call,
        Outcome(200, "http://p", usage={"prompt_tokens_details": {"cached_tokens": 3}}),
        m,
        RateLimiter(),
        "prefix",
    )
    assert value(m, "kvmesh_router_engine_cached_tokens_by_medium", "GPU") == 4
