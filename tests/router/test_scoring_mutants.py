"""Contract 4, pinned where mutation testing found it loose (docs/mutation.md): the rendezvous
hash, which pod wins a tie, the rank() defaults, the hot test with several pods, degenerate
totals, and the exact errors of the parameter checks."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.router.scoring import (
    Candidate,
    Weights,
    check_hotspot_params,
    mark_hot,
    rank,
    rendezvous,
)


def cands(*specs):
    return [
        Candidate(name, f"http://{name}", kv_usage=kv, load=load, matched_blocks=m)
        for name, kv, load, m in specs
    ]


def test_rendezvous_is_pinned():
    """Every router (of any version) must pick the same pod for the same prompt: the tie weight is
    blake2b-64 of tie_key, NUL, pod name, read big-endian."""
    assert rendezvous(b"k", "p0") == 4971088214307705471
    assert rendezvous(b"k", "p1") == 5722953370335470588
    assert rendezvous(b"", "") == 10734006239897485896
    assert rendezvous(b"\x01\x02", "pod-7") == int.from_bytes(
        hashlib.blake2b(b"\x01\x02\x00pod-7", digest_size=8).digest(), "big"
    )


def test_a_tie_goes_to_the_highest_rendezvous_weight():
    for i in range(20):
        key = bytes([i, 7])
        ordered = rank(cands(("p0", 0, 0, 0), ("p1", 0, 0, 0), ("p2", 0, 0, 0)), 4, Weights(), key)
        weights = sorted(("p0", "p1", "p2"), key=lambda n: -rendezvous(key, n))
        assert [c.name for c in ordered] == weights


def test_scores_within_a_billionth_are_a_tie():
    # b's score is 4e-10 lower (float noise from different arithmetic): still a tie, so the
    # rendezvous weight decides, the same way on every router.
    for i in range(20):
        key = bytes([i])
        ordered = rank(cands(("a", 0.2, 0, 0), ("b", 0.2 + 8e-10, 0, 0)), 4, Weights(), key)
        favourite = max(("a", "b"), key=lambda n: rendezvous(key, n))
        assert ordered[0].name == favourite


def test_rank_defaults_are_ratio_2_and_min_load_2():
    # 7 > 2 x 2 + 2: hot; 6 is not.
    assert [
        c.name for c in rank(cands(("a", 0, 7, 4), ("b", 0, 2, 0)), 4, Weights(), b"k") if c.hot
    ] == ["a"]
    assert not any(c.hot for c in rank(cands(("a", 0, 6, 4), ("b", 0, 2, 0)), 4, Weights(), b"k"))


def test_hot_compares_with_the_mean_of_the_other_pods():
    cs = cands(("a", 0, 10, 0), ("b", 0, 4, 0), ("c", 0, 4, 0))
    mark_hot(cs, 2.0, 0)  # a: 10 > 2 x mean(4, 4) = 8
    assert [c.hot for c in cs] == [True, False, False]
    cs = cands(("a", 0, 8, 0), ("b", 0, 4, 0), ("c", 0, 4, 0))
    mark_hot(cs, 2.0, 0)  # 8 is not > 8
    assert not any(c.hot for c in cs)
    one = cands(("a", 0, 100, 0))
    mark_hot(one, 1.0, 0)  # a single pod is never hot
    assert not one[0].hot


def test_no_load_and_no_blocks_score_zero_for_those_terms():
    (c,) = rank(cands(("a", 0.4, 0, 0)), 0, Weights(prefix=1.0, kv=0.5, queue=0.5), b"k")
    assert c.score == pytest.approx(-0.2)  # no blocks: no prefix term; no load: no queue term
    a, b = rank(cands(("a", 0.0, 0, 3), ("b", 0.0, 0, 1)), 4, Weights(), b"k")
    assert (a.name, a.score, b.score) == ("a", pytest.approx(0.75), pytest.approx(0.25))


def test_queue_share_is_the_share_of_all_candidates_load():
    a, b = sorted(
        rank(
            cands(("a", 0, 1, 0), ("b", 0, 3, 0)),
            4,
            Weights(prefix=0, kv=0, queue=1.0),
            b"k",
            10.0,
            100,
        ),
        key=lambda c: c.name,
    )
    assert (a.score, b.score) == (pytest.approx(-0.25), pytest.approx(-0.75))


@pytest.mark.parametrize("ratio", [0.5, float("nan"), float("inf"), "2", None])
def test_a_bad_hotspot_ratio_is_refused_by_name(ratio):
    with pytest.raises(ValueError, match=r"hotspot ratio must be a finite number >= 1, got "):
        check_hotspot_params(ratio, 2)


@pytest.mark.parametrize("low", [-1, 1.5, True, "2"])
def test_a_bad_hotspot_minimum_is_refused_by_name(low):
    with pytest.raises(ValueError, match=r"hotspot minimum load must be an integer >= 0, got "):
        check_hotspot_params(2.0, low)


def test_large_finite_ratios_are_allowed():
    check_hotspot_params(1e300, 0)
    check_hotspot_params(1, 10**9)


def test_weights_parse_skips_empty_parts_and_names_bad_input():
    assert Weights.parse("prefix=2,,kv=0.1, ,queue=0,") == Weights(2.0, 0.1, 0.0)
    assert Weights.parse(" kv = 0.25 ") == Weights(kv=0.25)
    assert Weights.parse("lora=0.5") == Weights(lora=0.5)
    with pytest.raises(
        ValueError, match=r"unknown weight 'speed' \(expected prefix, kv, queue, lora\)"
    ):
        Weights.parse("prefix=1,speed=1")
    with pytest.raises(ValueError, match="0.5=1"):  # the value is what is wrong, not the name
        Weights.parse("kv=0.5=1")
