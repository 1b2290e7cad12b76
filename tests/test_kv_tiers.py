"""Contract 5 (kvmesh/common/kv_tiers.py): tier names, Redis keys, reported costs, saved work."""

import pytest

from kvmesh.common import kv_tiers as kt


@pytest.mark.parametrize(
    "medium,tier",
    [
        (None, "GPU"),
        ("GPU", "GPU"),
        ("cuda", "GPU"),
        ("CPU", "CPU"),
        ("cpu", "CPU"),
        ("SHARED", "SHARED"),
        ("DISK", None),
        ("", None),
        (7, None),
    ],
)
def test_a_medium_names_one_tier_or_none(medium, tier):
    assert kt.tier_of(medium) == tier


def test_tier_keys_live_under_the_model_prefix():
    assert kt.host_blocks_key("m", "pod-1") == "kvmesh:v1:m:host-blocks:pod-1"
    assert kt.shared_blocks_key("m") == "kvmesh:v1:m:shared-blocks"


def test_costs_round_trip_through_a_heartbeat():
    costs = kt.BlockCosts(0.02, 0.001, 0.004)
    assert kt.BlockCosts.from_mapping(costs.to_mapping()) == costs


def test_junk_costs_keep_the_defaults_and_a_load_never_costs_more_than_a_prefill():
    assert kt.BlockCosts.from_mapping({}) == kt.BlockCosts()
    assert kt.BlockCosts.from_mapping({kt.F_COST_PREFILL: "nan"}) == kt.BlockCosts()
    got = kt.BlockCosts.from_mapping(
        {kt.F_COST_PREFILL: "0.01", kt.F_COST_CPU: "-1", kt.F_COST_SHARED: "5"}
    )
    assert got == kt.BlockCosts(0.01, 0.05 * 0.01, 0.01)


def test_saved_blocks_weighs_each_tier_by_its_load_cost():
    costs = kt.BlockCosts(prefill=1.0, cpu=0.25, shared=0.5)
    assert kt.saved_blocks(4, 0, 0, costs) == 4.0
    assert kt.saved_blocks(0, 4, 0, costs) == 3.0
    assert kt.saved_blocks(0, 0, 4, costs) == 2.0
    assert kt.saved_blocks(2, 2, 2, costs) == 2 + 1.5 + 1.0
    # a load as slow as the prefill saves nothing
    assert kt.saved_blocks(0, 3, 3, kt.BlockCosts(1.0, 1.0, 1.0)) == 0.0
