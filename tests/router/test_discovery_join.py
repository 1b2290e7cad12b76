"""The join of endpoints and heartbeats into pods (router/discovery/join.py), called directly: no Redis, no clock."""

from __future__ import annotations

from kvmesh.common import redis_layout as rl
from kvmesh.router.discovery.join import (
    FALLBACK_REDIS,
    FallbackEnded,
    FallbackStarted,
    IgnoredHeartbeat,
    JoinState,
    RedisView,
    join,
    state_counts,
)
from kvmesh.router.discovery.sources import Endpoint

NOW = 1000.0
STALE = 10.0
A = Endpoint("a", "http://10.0.0.1:8000")
UNNAMED = Endpoint(None, "http://10.0.0.2:8000")


def beat(pod: str, url: str, **fields) -> rl.Heartbeat:
    return rl.Heartbeat(pod=pod, url=url, ts=1.0, **fields)


def fresh(*beats: rl.Heartbeat, read_at: float = NOW - 1) -> RedisView:
    return RedisView({b.pod: b for b in beats}, read_at, STALE)


def run(known, view, claims=None, previous=JoinState(), synced=True):
    return join(list(known), synced, view, claims or {}, previous, NOW)


def summary(joined) -> dict[str, tuple[str, str, bool]]:
    return {n: (p.url, p.state, p.has_blocks) for n, p in joined.pods.items()}


def test_a_named_pod_takes_its_heartbeat_and_keeps_the_platforms_url():
    out = run([A], fresh(beat("a", "http://10.0.0.1:8000/", running=3, waiting=2, kv_usage=0.5)))
    assert summary(out) == {
        "a": ("http://10.0.0.1:8000", "ready", True)
    }  # the URL compared normalised
    pod = out.pods["a"]
    assert (pod.running, pod.waiting, pod.load, pod.kv_usage, pod.ts) == (3, 2, 5, 0.5, 1.0)
    assert out.state == JoinState(None, {}) and out.notes == [] and set(out.heartbeats) == {"a"}


def test_a_named_pod_without_a_heartbeat_is_not_routed():
    out = run([A, Endpoint("f", "http://10.0.0.6:8000")], fresh(beat("a", A.url)))
    assert summary(out)["f"] == ("http://10.0.0.6:8000", "no_heartbeat", False)


def test_a_heartbeat_without_an_endpoint_makes_no_pod():
    out = run([A], fresh(beat("a", A.url), beat("c", "http://10.0.0.9:8000"), beat("e", A.url)))
    assert (
        set(out.pods) == {"a"} and out.notes == []
    )  # the sweep counts those (metrics.py), not the join


def test_a_heartbeat_naming_another_url_is_ignored_once_every_source_answered():
    known = [A, Endpoint("d", "http://10.0.0.4:8000")]
    view = fresh(beat("a", A.url), beat("d", "http://evil:8000"))
    out = run(known, view)
    assert summary(out)["d"] == ("http://10.0.0.4:8000", "no_heartbeat", False)
    assert out.state.ignored == {("d", "url_mismatch"): "http://evil:8000"}
    assert out.notes == [IgnoredHeartbeat("d", "url_mismatch", "http://evil:8000")]
    again = run(known, view, previous=out.state)  # seen before: no new note, still ignored
    assert again.notes == [] and again.state.ignored == out.state.ignored
    early = run(known, view, synced=False)  # before every source answered it proves nothing
    assert (
        early.state.ignored == {} and early.notes == [] and early.pods["d"].state == "no_heartbeat"
    )


def test_an_unnamed_backend_is_routed_by_load_or_by_the_heartbeat_that_claims_its_url():
    assert summary(run([UNNAMED], fresh())) == {UNNAMED.url: (UNNAMED.url, "ready", False)}
    claimed = run([UNNAMED], fresh(beat("b", UNNAMED.url + "/", running=4)), {UNNAMED: "b"})
    assert (
        summary(claimed) == {"b": (UNNAMED.url, "ready", True)} and claimed.pods["b"].running == 4
    )
    moved = run(
        [UNNAMED], fresh(beat("b", "http://10.0.0.3:8000")), {UNNAMED: "b"}
    )  # names another URL now
    assert summary(moved) == {UNNAMED.url: (UNNAMED.url, "ready", False)} and moved.notes == []
    taken = run(
        [UNNAMED, Endpoint("b", "http://10.0.0.3:8000")],
        fresh(beat("b", UNNAMED.url)),
        {UNNAMED: "b"},
    )
    assert taken.pods[UNNAMED.url].has_blocks is False  # a claim on a named pod's name is not used


def test_heartbeat_states():
    known = [A, Endpoint("b", "http://10.0.0.2:8000"), Endpoint("c", "http://10.0.0.3:8000")]
    out = run(
        known,
        fresh(
            beat("a", A.url, state="draining"),
            beat("b", "http://10.0.0.2:8000", state="weird"),
            beat("c", "http://10.0.0.3:8000"),
        ),
    )
    assert {n: p.state for n, p in out.pods.items()} == {
        "a": "draining",
        "b": "unknown",
        "c": "ready",
    }
    assert state_counts(out.pods) == {
        "ready": 1,
        "draining": 1,
        "no_heartbeat": 0,
        "not_ready": 0,
        "unknown": 1,
    }


def test_an_endpoint_the_platform_lists_as_not_ready_is_never_ready():
    starting = Endpoint("a", A.url, ready=False)
    assert summary(run([starting], fresh(beat("a", A.url)))) == {"a": (A.url, "not_ready", True)}
    assert summary(run([starting], fresh())) == {"a": (A.url, "not_ready", False)}
    assert summary(run([starting], None)) == {"a": (A.url, "not_ready", False)}


def test_numbers_from_redis_are_clamped():
    out = run([A], fresh(beat("a", A.url, kv_usage=float("nan"), running=-50, waiting=-1)))
    assert (out.pods["a"].kv_usage, out.pods["a"].running, out.pods["a"].waiting) == (1.0, 0, 0)
    assert run([A], fresh(beat("a", A.url, kv_usage=7.0))).pods["a"].kv_usage == 1.0


def test_a_name_listed_by_two_sources_takes_the_last_url():
    out = run([A, Endpoint("a", "http://10.0.0.5:8000")], fresh(beat("a", "http://10.0.0.5:8000")))
    assert summary(out) == {"a": ("http://10.0.0.5:8000", "ready", True)}


def test_without_redis_every_known_pod_is_routed_by_load():
    out = run([A, UNNAMED], None)
    assert summary(out) == {
        "a": (A.url, "ready", False),
        UNNAMED.url: (UNNAMED.url, "ready", False),
    }
    assert out.state.fallback is None and out.heartbeats is None and out.notes == []


def test_a_stale_view_falls_back_to_load_only_and_says_so_once():
    stale = fresh(beat("a", A.url, running=3), read_at=NOW - STALE - 0.5)
    out = run([A, UNNAMED], stale)
    assert summary(out) == {
        "a": (A.url, "ready", False),
        UNNAMED.url: (UNNAMED.url, "ready", False),
    }
    assert (
        out.state.fallback == FALLBACK_REDIS and out.heartbeats is None
    )  # the old view is dropped
    assert out.notes == [FallbackStarted(STALE + 0.5, 2)]
    assert run([A], stale, previous=out.state).notes == []  # still in fallback: nothing new to say
    edge = run(
        [A], fresh(beat("a", A.url), read_at=NOW - STALE)
    )  # exactly stale_after old: still used
    assert edge.state.fallback is None and edge.pods["a"].has_blocks


def test_a_view_never_read_is_a_fallback_without_a_log_line():
    out = run([A], RedisView(None, None, STALE))
    assert (
        out.state.fallback == FALLBACK_REDIS
        and out.notes == []
        and out.pods["a"].has_blocks is False
    )


def test_a_fresh_view_ends_the_fallback():
    out = run([A], fresh(beat("a", A.url)), previous=JoinState(FALLBACK_REDIS))
    assert out.state.fallback is None and out.notes == [FallbackEnded()]
    assert summary(out) == {"a": (A.url, "ready", True)}
