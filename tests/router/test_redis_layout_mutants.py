"""Contract 3: the heartbeat hash and the SMISMEMBER helper, field by field.

Written to kill the mutants that tests/router/test_units.py let through (docs/mutation.md):
every field survives a round trip with its type, a missing or garbled field reads as its
documented default, and keys or values may be bytes or str."""

from __future__ import annotations

import pytest

from kvmesh.common import redis_layout as rl


def full_heartbeat() -> rl.Heartbeat:
    return rl.Heartbeat(
        pod="p",
        url="http://x:8000",
        model="m1",
        kv_usage=0.25,
        running=3,
        waiting=4,
        total_blocks=77,
        state="draining",
        ts=1234.5,
        num_keys=12,
        prefix_cache_queries=900.0,
        prefix_cache_hits=450.0,
    )


def test_to_mapping_writes_every_field_in_its_text_form():
    assert full_heartbeat().to_mapping() == {
        "url": "http://x:8000",
        "model": "m1",
        "kv_usage": "0.250000",
        "running": "3",
        "waiting": "4",
        "total_blocks": "77",
        "state": "draining",
        "ts": "1234.500",
        "num_keys": "12",
        "prefix_cache_queries": "900",
        "prefix_cache_hits": "450",
    }


@pytest.mark.parametrize("encode", [True, False], ids=["bytes", "str"])
def test_every_field_round_trips_with_its_type(encode):
    hb = full_heartbeat()
    mapping = hb.to_mapping()
    if encode:
        mapping = {k.encode(): v.encode() for k, v in mapping.items()}
    back = rl.Heartbeat.from_mapping("pod-b", mapping)
    assert back == rl.Heartbeat(
        pod="pod-b",
        url="http://x:8000",
        model="m1",
        kv_usage=0.25,
        running=3,
        waiting=4,
        total_blocks=77,
        state="draining",
        ts=1234.5,
        num_keys=12,
        prefix_cache_queries=900.0,
        prefix_cache_hits=450.0,
    )
    for name in ("running", "waiting", "total_blocks", "num_keys"):
        assert type(getattr(back, name)) is int, name
    for name in ("kv_usage", "ts", "prefix_cache_queries", "prefix_cache_hits"):
        assert type(getattr(back, name)) is float, name
    assert back.load == 7


def test_mixed_bytes_and_str_keys_and_values():
    back = rl.Heartbeat.from_mapping("p", {b"url": "http://u", "running": b"2", "model": "mm"})
    assert (back.url, back.running, back.model) == ("http://u", 2, "mm")


def test_missing_fields_read_as_their_defaults():
    back = rl.Heartbeat.from_mapping("p", {"url": "http://u"})
    assert (back.model, back.state) == ("", rl.STATE_READY)
    assert (
        back.num_keys is None
    )  # optional: unknown (cached_blocks then estimates it from the KV usage)
    for name in (
        "kv_usage",
        "running",
        "waiting",
        "total_blocks",
        "ts",
        "prefix_cache_queries",
        "prefix_cache_hits",
    ):
        assert getattr(back, name) == 0, name
    assert type(back.running) is int and type(back.kv_usage) is float


def test_garbled_numbers_read_as_zero_and_fractions_are_truncated_for_counts():
    back = rl.Heartbeat.from_mapping(
        "p",
        {
            "url": "u",
            "running": "2.9",
            "waiting": "x",
            "total_blocks": "64.5",
            "num_keys": "7.7",
            "ts": "",
            "prefix_cache_queries": "nan?",
            "prefix_cache_hits": "1e3",
            "kv_usage": "junk",
        },
    )
    assert (back.running, back.waiting, back.total_blocks, back.num_keys) == (2, 0, 64, 7)
    assert (back.ts, back.prefix_cache_queries, back.prefix_cache_hits, back.kv_usage) == (
        0.0,
        0.0,
        1000.0,
        0.0,
    )


@pytest.mark.parametrize("raw, expected", [("1.7", 1.0), ("-0.3", 0.0), ("0.4", 0.4), ("1", 1.0)])
def test_kv_usage_is_clamped_to_the_unit_interval(raw, expected):
    assert rl.Heartbeat.from_mapping("p", {"url": "u", "kv_usage": raw}).kv_usage == expected


@pytest.mark.parametrize("data", [{}, None, {"url": ""}, {"model": "m"}, {b"url": b""}])
def test_no_url_no_heartbeat(data):
    assert rl.Heartbeat.from_mapping("p", data) is None


def test_demand_key():
    assert rl.demand_key("m") == "kvmesh:v1:m:demand"


@pytest.mark.parametrize(
    "flags, n",
    [
        ([], 0),
        ([1, 1, 1], 3),
        ([0, 1, 1], 0),
        ([1, 0, 1], 1),
        ([True, True, False, True], 2),
        ([1, 1, 1, 1, 1, 0], 5),
    ],
)
def test_leading_run(flags, n):
    assert rl.leading_run(flags) == n
