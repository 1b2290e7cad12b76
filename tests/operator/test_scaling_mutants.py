"""The operator loop's reads pinned exactly, over a stand-in API client and heartbeat source:
`engine_pods` without permission (which statuses, the one warning), each pod's annotations and
creation time; `read_load`'s arguments, demand and failures; the deletion-cost patches; the time
parser's zone; `observe` with nothing running (the mutation run's selection for operator/scaling.py)."""

from __future__ import annotations

import datetime

import pytest

from kvmesh.common.redis_layout import Heartbeat
from kvmesh.operator import scaling
from kvmesh.operator.apply import ApiError
from kvmesh.operator.memo import Memo, OperatorConfig
from kvmesh.operator.metrics_source import Snapshot
from kvmesh.operator.scaling import (
    DELETION_COST,
    EnginePod,
    Load,
    LoopState,
    annotate_deletion_costs,
    engine_pods,
    observe,
    read_load,
)


class Client:
    """The API calls the loop makes: a pod list (or an error) and the patches it sent."""

    def __init__(self, items=(), error: int | None = None, patch_error: int | None = None):
        self.items, self.error, self.patch_error = list(items), error, patch_error
        self.lists, self.patches = [], []

    async def list(self, kind, namespace, selector):
        self.lists.append((kind, namespace, selector))
        if self.error is not None:
            raise ApiError(self.error, "nope")
        return self.items

    async def patch(self, kind, namespace, name, body):
        self.patches.append((kind, namespace, name, body))
        if self.patch_error is not None:
            raise ApiError(self.patch_error, "nope")


class Logger:
    def __init__(self):
        self.warnings = []
        self.infos = []

    def warning(self, message):
        self.warnings.append(message)

    def info(self, message):
        self.infos.append(message)


def memo(client: Client, now: float = 5000.0) -> Memo:
    m = Memo(config=OperatorConfig(clock=lambda: now))
    m.shared.client = client
    return m


def loop() -> LoopState:
    return LoopState(scaler=None)


def api_pod(name, created="2026-12-06T10:00:00Z", annotations=None, ready=True):
    meta = {"name": name}
    if created is not None:
        meta["creationTimestamp"] = created
    if annotations is not None:
        meta["annotations"] = annotations
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": meta, "status": {"phase": "Running", "conditions": conditions}}


async def test_the_pods_are_listed_in_their_namespace_by_the_deployments_selector():
    client = Client([api_pod("demo-engine-b"), api_pod("demo-engine-a", ready=False)])
    pods = await engine_pods(memo(client), "ns", "demo")
    assert client.lists == [("Pod", "ns", scaling.render.selector_string("demo"))]
    assert [(p.name, p.ready) for p in pods] == [("demo-engine-a", False), ("demo-engine-b", True)]


async def test_a_pods_annotations_and_creation_time_as_the_api_gives_them():
    client = Client(
        [
            api_pod("a", annotations={DELETION_COST: "7"}),
            api_pod("b", created=None),
            api_pod("c", created="garbled"),
        ]
    )
    a, b, c = await engine_pods(memo(client, now=5000.0), "ns", "demo")
    assert a.annotations == {DELETION_COST: "7"} and b.annotations == {} == c.annotations
    when = datetime.datetime(2026, 12, 6, 10, tzinfo=datetime.UTC).timestamp()
    assert a.created == when  # "Z" is UTC
    assert b.created == 5000.0 and c.created == 5000.0  # unknown: now


@pytest.mark.parametrize("status", [403, 404])
async def test_without_permission_to_list_pods_none_and_one_warning(status):
    state, logger = loop(), Logger()
    for _ in range(3):
        assert await engine_pods(memo(Client(error=status)), "ns", "demo", state, logger) is None
    assert state.warned_pods is True
    assert logger.warnings == [
        f"cannot list engine pods (HTTP {status}: nope); counting replicas from heartbeats, "
        "without the startup deadline (grant pods list/patch: manifests/rbac.yaml)"
    ]
    # no loop state or no logger: no warning, no error
    assert await engine_pods(memo(Client(error=status)), "ns", "demo", None, logger) is None
    assert await engine_pods(memo(Client(error=status)), "ns", "demo", loop(), None) is None
    assert len(logger.warnings) == 1


@pytest.mark.parametrize("status", [400, 401, 405, 500])
async def test_other_list_errors_are_raised(status):
    with pytest.raises(ApiError):
        await engine_pods(memo(Client(error=status)), "ns", "demo", loop(), Logger())


def test_a_time_in_utc_written_either_way():
    assert scaling._parse_time("2026-12-06T10:00:00+00:00") == scaling._parse_time(
        "2026-12-06T10:00:00Z"
    )
    assert scaling._parse_time(None) is None and scaling._parse_time("") is None


def beat(pod, running=0, waiting=0):
    return Heartbeat(
        pod=pod,
        url="u",
        kv_usage=0.5,
        running=running,
        waiting=waiting,
        total_blocks=10,
        state="ready",
        ts=0.0,
    )


class Source:
    def __init__(self, demand=None, fail=False, queued=0):
        self.demand_value, self.fail, self.queued = demand, fail, queued
        self.calls = []

    async def snapshot(self, model, prefix, pods):
        self.calls.append(("snapshot", model, prefix, pods))
        if self.fail:
            raise ConnectionError("redis down")
        return Snapshot(ready=[beat("e-a", 1, 2)], draining=[beat("e-z", 3, 0)])

    async def demand(self, model):
        self.calls.append(("demand", model))
        return self.demand_value

    async def queued_at_routers(self, model):
        self.calls.append(("queued", model))
        return self.queued


MD = {"metadata": {"name": "demo", "namespace": "ns"}}
SPEC = {"model": {"builtin": "smollm2-135m-instruct", "servedModelName": "m"}}


@pytest.mark.parametrize("demand, queued", [(None, 0), ("1765000000", 4)])
async def test_the_load_read_from_the_heartbeats(monkeypatch, demand, queued):
    source = Source(demand, queued=queued)

    async def redis_source(memo_, md, spec):
        return source

    monkeypatch.setattr(scaling, "_redis_source", redis_source)
    pods = [EnginePod("e-a", True, 0.0), EnginePod("e-b", False, 0.0)]
    load = await read_load(memo(Client()), MD, SPEC, Logger(), pods)
    model = scaling.specs.served_model_name(SPEC)
    prefix = f"{scaling.render.names('demo')[scaling.render.ENGINE]}-"
    assert source.calls == [
        ("snapshot", model, prefix, ["e-a", "e-b"]),
        ("demand", model),
        ("queued", model),
    ]
    assert load.known and load.demand is (demand is not None)
    # requests waiting at the routers (flow control) are busy work as the engines' are
    assert list(load.heartbeats) == ["e-a"] and load.busy == 1 + 2 + 3 + queued
    assert load.queued == queued
    source.calls.clear()
    await read_load(memo(Client()), MD, SPEC, Logger())  # pods not listed: none by name
    assert source.calls[0] == ("snapshot", model, prefix, [])


async def test_a_failed_read_is_unknown_load_and_one_warning(monkeypatch):
    async def redis_source(memo_, md, spec):
        return Source(fail=True)

    monkeypatch.setattr(scaling, "_redis_source", redis_source)
    logger = Logger()
    load = await read_load(memo(Client()), MD, SPEC, logger, [])
    assert load == Load() and not load.known
    assert logger.warnings == ["reading heartbeats failed: ConnectionError('redis down')"]


async def test_deletion_costs_are_patched_where_they_changed():
    client, logger = Client(), Logger()
    pods = [
        EnginePod("a", True, 0.0, {DELETION_COST: "5"}),
        EnginePod("b", True, 0.0, {DELETION_COST: "1"}),
        EnginePod("c", True, 0.0),
    ]
    await annotate_deletion_costs(memo(client), "ns", pods, {"a": 5, "b": 2, "c": -100}, logger)
    assert client.patches == [
        ("Pod", "ns", "b", {"metadata": {"annotations": {DELETION_COST: "2"}}}),
        ("Pod", "ns", "c", {"metadata": {"annotations": {DELETION_COST: "-100"}}}),
    ]
    assert logger.warnings == []


async def test_a_failed_patch_is_warned_unless_the_pod_is_gone():
    pods = [EnginePod("a", True, 0.0), EnginePod("b", True, 0.0)]
    logger = Logger()
    gone = Client(patch_error=404)
    await annotate_deletion_costs(memo(gone), "ns", pods, {"a": 1, "b": 2}, logger)
    assert len(gone.patches) == 2 and logger.warnings == []  # each pod tried
    await annotate_deletion_costs(memo(Client(patch_error=403)), "ns", pods[:1], {"a": 1}, logger)
    assert logger.warnings == ["annotating a with its deletion cost failed: HTTP 403: nope"]


def test_nothing_running_is_zero_not_negative():
    load = Load(known=True, heartbeats={"e-a": beat("e-a", 0, 4)}, busy=4)
    assert observe(0.0, 1, [EnginePod("e-a", True, 0.0)], load).running == 0
    load.busy = 3  # a heartbeat counted before the busy total: never below zero
    assert observe(0.0, 1, [EnginePod("e-a", True, 0.0)], load).running == 0
