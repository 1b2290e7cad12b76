"""Routing policies as plug-ins: the registry is the one list of names (router, CLIs, CRD), and
each policy orders candidates as docs/router.md says, without Redis or HTTP."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import pytest

from kvmesh.router import policies
from kvmesh.router.policies import PolicySettings, RouteRequest, RoutingPolicy
from kvmesh.router.scoring import Candidate, Weights, rendezvous


def cands(*loads: int) -> list[Candidate]:
    return [Candidate(f"pod-{i}", f"http://p{i}", 0.0, load) for i, load in enumerate(loads)]


def order(policy: RoutingPolicy, candidates, keys=(), headers=None, matched=None, tie=b"t"):
    calls = []

    async def match():
        calls.append(1)
        return matched

    out = asyncio.run(
        policy.order(RouteRequest(list(candidates), list(keys), headers or {}, tie, match))
    )
    return [c.name for c in out[0]], out[1], len(calls)


def test_registry_names_and_classes():
    assert policies.NAMES == ("prefix", "least-load", "round-robin", "session")
    assert policies.DEFAULT == "prefix"
    for name, cls in policies.POLICIES.items():
        assert issubclass(cls, RoutingPolicy) and cls.name == name
        assert isinstance(policies.create(name), cls)
    with pytest.raises(
        ValueError,
        match=r"unknown policy 'fastest' \(expected one of prefix, least-load, "
        r"round-robin, session\)",
    ):
        policies.create("fastest")


def test_every_shared_name_has_exactly_one_registered_policy():
    """The names the operator and `kvmesh up` read (kvmesh.common, no router import) are the registry's."""
    from kvmesh.common import policy_names

    assert tuple(policies.POLICIES) == policy_names.NAMES
    assert policy_names.DEFAULT in policies.POLICIES


def test_the_operator_and_the_mesh_cli_do_not_import_the_router():
    code = (
        "import sys, kvmesh.operator.crd, kvmesh.mesh.up, kvmesh.sidecar.service; "
        "routers = sorted(m for m in sys.modules if m.startswith('kvmesh.router')); "
        "assert not routers, routers"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


def test_every_reader_of_policy_names_reads_the_registry():
    from kvmesh.mesh import up
    from kvmesh.operator import crd
    from kvmesh.router import app, cli

    version = crd.crd_manifest()["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    policy = spec["properties"]["router"]["properties"]["policy"]
    assert policy["enum"] == list(policies.NAMES) and policy["default"] == policies.DEFAULT
    for module in (cli, up):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        action = next(a for a in p._actions if a.dest == "policy")
        assert list(action.choices) == list(policies.NAMES) and action.default == policies.DEFAULT
    assert app.RouterConfig().policy == policies.DEFAULT
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        app.Router(app.RouterConfig(policy="fastest", redis_url=None), encoder=object())


def test_the_registry_and_the_crd_import_without_the_routers_runtime():
    code = (
        "import sys, kvmesh.router.policies, kvmesh.operator.crd; "
        "heavy = {'aiohttp', 'redis', 'prometheus_client', 'torch', 'kopf'} "
        "& {m.split('.')[0] for m in sys.modules}; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefix_policy_reasons():
    p = policies.create("prefix")
    assert order(p, cands(0, 0), keys=[1, 2, 3], matched={"pod-1": 2}) == (
        ["pod-1", "pod-0"],
        "prefix_match",
        1,
    )
    names, reason, _ = order(p, cands(0, 0), keys=[1, 2, 3], matched={})
    assert reason == "no_match" and sorted(names) == ["pod-0", "pod-1"]
    assert order(p, cands(3, 0), keys=[1], matched=None)[:2] == (
        ["pod-1", "pod-0"],
        "redis_unavailable",
    )
    assert order(p, cands(0, 2), keys=[]) == (
        ["pod-0", "pod-1"],
        "short_prompt",
        0,
    )  # no Redis asked
    # the best score is a far hotter pod: the guard puts it last
    assert order(p, cands(40, 0, 0), keys=[1, 2], matched={"pod-0": 2})[1] == "hotspot_guard"


def test_least_load_ignores_the_prefix_and_never_asks_redis():
    p = policies.create("least-load", PolicySettings(Weights(prefix=5.0, kv=0.5, queue=0.5)))
    assert order(p, cands(5, 1), keys=[1, 2], matched={"pod-0": 2}) == (
        ["pod-1", "pod-0"],
        "least_load",
        0,
    )


def test_round_robin_rotates_in_name_order_per_instance():
    p = policies.create("round-robin")
    firsts = [order(p, list(reversed(cands(0, 0, 0))))[0][0] for _ in range(4)]
    assert firsts == ["pod-0", "pod-1", "pod-2", "pod-0"]
    assert order(policies.create("round-robin"), cands(0, 0))[0] == [
        "pod-0",
        "pod-1",
    ]  # its own counter
    assert order(p, cands(0, 0, 0))[:2] == (["pod-1", "pod-2", "pod-0"], "round_robin")


def test_session_affinity_then_prefix_without_a_session_id():
    p = policies.create("session", PolicySettings(session_header="X-Session-Id"))
    want = max(["pod-0", "pod-1", "pod-2"], key=lambda n: rendezvous(b"user-7", n))
    names, reason, asked = order(
        p, cands(0, 0, 0), keys=[1], headers={"x-session-id": "user-7"}, matched={"pod-2": 1}
    )
    assert (names[0], reason, asked) == (want, "session", 0)
    hot = int(want[-1])
    loads = [0, 0, 0]
    loads[hot] = 50
    assert (
        order(p, cands(*loads), headers={"x-session-id": "user-7"})[0][-1] == want
    )  # a hot pod goes last
    # no session id: the prefix policy decides (and asks Redis)
    assert order(p, cands(0, 0, 0), keys=[1], matched={"pod-2": 1})[0][0] == "pod-2"
    assert order(p, cands(0, 0, 0), keys=[1], matched={"pod-2": 1})[1:] == ("prefix_match", 1)
