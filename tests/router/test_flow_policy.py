"""Flow control's policy, pure and on a fake clock: who is asking, band order, Virtual Token
Counting among tenants, deadlines, shedding the lowest band first, the bounded tenant table,
and the asyncio side (router/flow/controller.py) refusing before any engine is called."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvmesh.router.auth import parse_keys
from kvmesh.router.discovery import Pod
from kvmesh.router.flow import FlowControl, FlowSettings, parse_band
from kvmesh.router.flow import queue as fq
from kvmesh.router.flow.fairness import OTHER, VirtualCounters
from kvmesh.router.flow.identity import ANONYMOUS, identify
from kvmesh.router.flow.queue import FlowQueue, Ticket
from kvmesh.router.flow.saturation import all_saturated, pod_saturated
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request_checks import Refused


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def settings(**kw) -> FlowSettings:
    return FlowSettings(enabled=True, **kw)


def key(line: str):
    return next(iter(parse_keys(line).values()))


# -- who is asking ---------------------------------------------------------------------------


def test_the_tenant_is_the_key_where_keys_are_on_else_the_fairness_header():
    s = settings()
    assert identify(s, {}, key("sk-a name=alice")).tenant == "key:alice"
    ident = identify(s, {"x-gateway-inference-fairness-id": "team-7"}, None)
    assert ident.tenant == "id:team-7" and ident.band.name == "standard"
    # the header cannot pose as another key's tenant when keys are on
    assert (
        identify(s, {"x-gateway-inference-fairness-id": "x"}, key("sk-a name=alice")).tenant
        == "key:alice"
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"x-gateway-inference-fairness-id": ""},
        {"x-gateway-inference-fairness-id": "a" * 65},
        {"x-gateway-inference-fairness-id": "bad id\x00"},
        {"x-gateway-inference-objective": "platinum"},
        {"x-gateway-inference-objective": "\udcff" * 3},
        {"x-kvmesh-deadline-seconds": "soon"},
        {"x-kvmesh-deadline-seconds": "nan"},
        {"x-kvmesh-deadline-seconds": "-4"},
    ],
)
def test_malformed_or_unknown_headers_give_the_defaults(headers):
    ident = identify(settings(default_deadline=30), headers, None)
    assert ident.band.name == "standard"
    assert ident.tenant == ANONYMOUS or headers.get("x-gateway-inference-fairness-id")
    assert ident.deadline_s == 30


def test_the_objective_header_picks_a_band_but_never_above_the_keys():
    s = settings(objectives={"chat": "critical", "batch": "sheddable"})
    assert identify(s, {"x-gateway-inference-objective": "Critical"}, None).band.name == "critical"
    assert identify(s, {"x-gateway-inference-objective": "batch"}, None).band.name == "sheddable"
    assert identify(s, {"x-gateway-inference-objective": "chat"}, None).band.name == "critical"
    k = key("sk-b name=bob band=standard weight=3")
    assert identify(s, {"x-gateway-inference-objective": "critical"}, k).band.name == "standard"
    assert identify(s, {"x-gateway-inference-objective": "sheddable"}, k).band.name == "sheddable"
    assert identify(s, {}, k).weight == 3
    assert identify(s, {}, key("sk-c band=critical")).band.name == "critical"
    # a key naming a band this router does not have: the default band
    assert identify(s, {}, key("sk-d band=gold")).band.name == "standard"


def test_the_deadline_header_may_shorten_the_wait_never_lengthen_it():
    s = settings(default_deadline=20)
    assert identify(s, {"x-kvmesh-deadline-seconds": "2.5"}, None).deadline_s == 2.5
    assert identify(s, {"x-kvmesh-deadline-seconds": "600"}, None).deadline_s == 20


def test_band_flags_are_parsed_and_checked():
    assert parse_band("gold:5:2:10") == parse_band("gold:5:2.0:10")
    assert parse_band("bulk:-1").max_queued == 256
    for bad in ("gold", "gold:x", "Gold Star:1", "gold:1:0", "gold:1:1:-1"):
        with pytest.raises(ValueError):
            parse_band(bad)
    with pytest.raises(ValueError):
        FlowSettings(bands=(parse_band("a:1"), parse_band("b:1")), default_band="a")
    with pytest.raises(ValueError):
        FlowSettings(default_band="gold")


# -- the queue: order, fairness, deadlines, shedding ---------------------------------------------


def ticket(s: FlowSettings, tenant: str, band: str, now: float = 0.0, deadline: float = 60.0):
    return Ticket(tenant, s.band(band), now, now + deadline)


def test_dispatch_takes_the_highest_band_first_then_the_least_served_tenant_then_arrival_order():
    s = settings()
    q = FlowQueue(s)
    served = {"heavy": 500.0, "light": 10.0}
    order = [
        ticket(s, "heavy", "sheddable"),
        ticket(s, "heavy", "standard"),
        ticket(s, "light", "standard"),
        ticket(s, "heavy", "critical"),
        ticket(s, "light", "standard"),
    ]
    for t in order:
        assert q.push(t) == [] and t.outcome is None
    popped = [q.pop(lambda n: served[n]) for _ in range(5)]
    assert popped == [order[3], order[2], order[4], order[1], order[0]]
    assert q.pop(lambda n: 0) is None and len(q) == 0


def test_virtual_token_counting_gives_light_tenants_their_share_against_a_flood():
    """One tenant queues 10x the others' requests; each dispatch charges the tenant its tokens.
    Every light request is served within a round of its arrival, and over the run each light
    tenant gets its fair share of the dispatches while it has requests waiting."""
    clock = Clock()
    s = settings(max_queued=10_000, bands=(parse_band("standard:1:1:10000"),))
    q = FlowQueue(s)
    vtc = VirtualCounters(100, half_life=1e9, clock=clock)
    tenants = ["heavy", "l1", "l2", "l3"]
    for n in tenants:
        vtc.tenant(n)
    for i in range(200):
        q.push(ticket(s, "heavy", "standard", now=i))
        if i % 10 == 0:
            for n in tenants[1:]:
                q.push(ticket(s, n, "standard", now=i))
    served = dict.fromkeys(tenants, 0)
    for _ in range(4 * 20):  # as many dispatches as it takes to serve all light requests fairly
        t = q.pop(vtc.value)
        served[t.tenant] += 1
        vtc.charge(t.tenant, 100.0)
    assert all(served[n] == 20 for n in tenants[1:]), served  # every light request served
    assert served["heavy"] == 20  # the flood got its share, no more


def test_on_equal_service_the_tenant_with_fewer_requests_waiting_goes_first():
    s = settings()
    q = FlowQueue(s)
    flood = [ticket(s, "flood", "standard") for _ in range(3)]
    for t in flood:
        q.push(t)
    newcomer = ticket(s, "new", "standard")
    q.push(newcomer)
    assert q.pop(lambda n: 100.0) is newcomer  # lifted to the flood's service: a tie
    assert q.pop(lambda n: 100.0) is flood[0]


def test_a_tenant_that_starts_waiting_is_lifted_to_the_least_service_among_those_waiting():
    clock = Clock()
    vtc = VirtualCounters(10, half_life=60, clock=clock)
    vtc.tenant("old")
    vtc.charge("old", 1000)
    vtc.tenant("new")
    vtc.lift("new", vtc.value("old"))
    assert vtc.value("new") == pytest.approx(1000)
    vtc.lift("old", 10)  # never lowers
    assert vtc.value("old") == pytest.approx(1000)


def test_service_decays_with_the_half_life():
    clock = Clock()
    vtc = VirtualCounters(10, half_life=30, clock=clock)
    vtc.tenant("a")
    vtc.charge("a", 800)
    clock.t += 60
    assert vtc.value("a") == pytest.approx(200)
    assert vtc.take_local() == {"a": 800}
    assert vtc.take_local() == {}


def test_requests_past_their_deadline_leave_the_queue_lowest_band_first():
    s = settings()
    q = FlowQueue(s)
    a = ticket(s, "x", "critical", now=0, deadline=5)
    b = ticket(s, "y", "sheddable", now=0, deadline=5)
    c = ticket(s, "y", "standard", now=0, deadline=50)
    for t in (a, b, c):
        q.push(t)
    assert q.expire(4.9) == []
    assert q.expire(5.0) == [b, a]
    assert a.outcome == b.outcome == fq.DEADLINE
    assert len(q) == 1 and q.pop(lambda n: 0) is c


def test_a_full_queue_sheds_the_lowest_band_first_and_refuses_the_lowest_band_itself():
    s = settings(max_queued=3)
    q = FlowQueue(s)
    low = [ticket(s, "b", "sheddable") for _ in range(2)]
    mid = ticket(s, "b", "standard")
    for t in [*low, mid]:
        assert q.push(t) == []
    # a critical request takes the newest sheddable one's place
    crit = ticket(s, "c", "critical")
    assert q.push(crit) == [low[1]] and low[1].outcome == fq.SHED
    # another sheddable request finds no band below its own: refused itself
    late = ticket(s, "d", "sheddable")
    assert q.push(late) == [] and late.outcome == fq.QUEUE_FULL
    # a critical request is never refused while a lower band holds requests
    assert q.push(ticket(s, "c", "critical")) == [low[0]]
    assert q.push(ticket(s, "c", "critical")) == [mid]
    assert [q.depth(b) for b in ("critical", "standard", "sheddable")] == [3, 0, 0]


def test_in_a_full_band_a_flood_makes_room_for_a_smaller_tenant_never_the_reverse():
    s = settings(bands=(parse_band("standard:1:1:4"),))
    q = FlowQueue(s)
    flood = [ticket(s, "flood", "standard") for _ in range(4)]
    for t in flood:
        q.push(t)
    light = ticket(s, "light", "standard")
    assert q.push(light) == [flood[-1]] and flood[-1].outcome == fq.TENANT_SHARE
    again = ticket(s, "flood", "standard")
    assert q.push(again) == [] and again.outcome == fq.QUEUE_FULL
    assert q.queued("flood") == 3 and q.queued("light") == 1


def test_the_tenant_table_is_bounded_and_folds_the_rest_into_one_flow():
    clock = Clock()
    busy = {"t0", "t1", "t2"}
    vtc = VirtualCounters(3, half_life=60, clock=clock, busy=lambda n: n in busy)
    evicted = []
    vtc.on_evict = evicted.append
    for i in range(3):
        assert vtc.tenant(f"t{i}") == f"t{i}"
    # all three have requests waiting: a million new ids share OTHER
    assert {vtc.tenant(f"attacker-{i}") for i in range(1000)} == {OTHER}
    assert len(vtc) == 4 and evicted == []
    busy.clear()  # now the least recently seen idle tenant makes room
    assert vtc.tenant("new") == "new" and evicted == ["t0"]
    assert len(vtc) <= 4


# -- saturation -----------------------------------------------------------------------------


def test_a_replica_is_saturated_by_kv_usage_its_engine_queue_or_this_routers_in_flight_cap():
    s = settings(kv_threshold=0.8, queue_threshold=3)
    assert pod_saturated(Pod("a", "u", kv_usage=0.85, ts=1), 0, s)
    assert pod_saturated(Pod("a", "u", waiting=3, ts=1), 0, s)
    assert not pod_saturated(Pod("a", "u", running=10, waiting=1, ts=1), 10, s)
    # sent since the heartbeat, beyond what it counted: taken as waiting
    assert pod_saturated(Pod("a", "u", running=2, waiting=0, ts=1), 5, s)
    # no heartbeat: only the in-flight cap says
    assert not pod_saturated(Pod("a", "u"), 50, s)
    assert pod_saturated(Pod("a", "u"), 4, settings(pod_max_inflight=4))
    pods = [Pod("a", "u", kv_usage=0.9, ts=1), Pod("b", "u", ts=1)]
    assert not all_saturated(pods, {}, s)
    assert all_saturated(pods, {"b": 3}, s)
    assert not all_saturated([], {}, s)  # no replica: the hold queue's business


def test_the_policy_chooses_among_the_replicas_with_room_and_among_all_when_none_has():
    s = settings(queue_threshold=3, pod_max_inflight=8)
    full_cap, full_queue, roomy = (
        Pod("a", "u", ts=1),
        Pod("b", "u", waiting=3, ts=1),
        Pod("c", "u", running=2, ts=1),
    )
    fc = control(s, Pods(full_cap, full_queue, roomy), inflight={"a": 8, "c": 2})
    assert fc.with_room([full_cap, full_queue, roomy]) == [roomy]
    assert fc.with_room([full_cap, full_queue]) == [full_cap, full_queue]
    fc.traffic.inflight["c"] = 8  # at this router's cap: no room left anywhere
    assert fc.with_room([full_cap, roomy]) == [full_cap, roomy]
    off = control(FlowSettings(enabled=False), Pods(full_cap))
    assert off.with_room([full_cap, roomy]) == [full_cap, roomy]


# -- the asyncio side -----------------------------------------------------------------------


class Pods:
    def __init__(self, *pods: Pod):
        self.pods = list(pods)

    def routable(self):
        return self.pods


def control(s: FlowSettings, discovery, inflight=None, clock=None) -> FlowControl:
    traffic = SimpleNamespace(inflight=inflight if inflight is not None else {})
    fc = FlowControl(s, "m", RouterMetrics(), traffic, clock=clock or Clock())
    fc.attach(discovery, None)
    return fc


def call(headers=None, tokens=10):
    return SimpleNamespace(
        generate=True, headers=headers or {}, key_info=None, tokens=[0] * tokens, flow=None
    )


def pending():
    return asyncio.get_running_loop().create_future()


def test_requests_pass_at_once_while_a_replica_has_room_and_are_charged_their_prompt():
    async def main():
        fc = control(settings(), Pods(Pod("a", "u", ts=1)))
        c = call({"x-gateway-inference-fairness-id": "t"}, tokens=40)
        assert await fc.wait(c, pending()) is True
        assert not c.flow.waited and fc.counters.value("id:t") == pytest.approx(40)
        fc.done(c, {"completion_tokens": 5})
        assert fc.counters.value("id:t") == pytest.approx(50)

    asyncio.run(main())


def test_a_request_that_waits_past_its_deadline_gets_429_with_retry_after_and_never_goes_out():
    async def main():
        sat = Pod("a", "u", kv_usage=0.95, ts=1)
        fc = control(settings(default_deadline=0.05), Pods(sat))
        with pytest.raises(Refused) as err:
            await fc.wait(call(), pending())
        r = err.value
        assert r.status == 429 and r.code == "flow_deadline"
        assert dict(r.headers)[b"retry-after"] == b"2"
        assert len(fc.queue) == 0
        m = fc.metrics.flow_shed.labels("standard", "deadline")._value.get()
        assert m == 1

    asyncio.run(main())


def test_waiting_requests_go_in_band_order_once_a_replica_has_room():
    async def main():
        pod = Pod("a", "u", kv_usage=0.95, ts=1)
        fc = control(settings(), Pods(pod))
        order = []

        async def one(band):
            c = call({"x-gateway-inference-objective": band})
            await fc.wait(c, pending())
            order.append(band)
            c.flow.held.sent.set()  # on the engine's socket: the next may go

        tasks = [asyncio.ensure_future(one(b)) for b in ("sheddable", "standard", "critical")]
        await asyncio.sleep(0.05)
        assert order == [] and len(fc.queue) == 3
        assert fc.metrics.flow_queue_depth.labels("critical")._value.get() == 1
        pod.kv_usage = 0.1
        await asyncio.gather(*tasks)
        assert order == ["critical", "standard", "sheddable"]

    asyncio.run(main())


def test_a_sheddable_request_is_refused_with_429_when_a_critical_one_needs_its_place():
    async def main():
        fc = control(settings(max_queued=1), Pods(Pod("a", "u", kv_usage=0.95, ts=1)))
        low = asyncio.ensure_future(
            fc.wait(call({"x-gateway-inference-objective": "sheddable"}), pending())
        )
        await asyncio.sleep(0.01)
        high = asyncio.ensure_future(
            fc.wait(call({"x-gateway-inference-objective": "critical"}), pending())
        )
        with pytest.raises(Refused) as err:
            await low
        assert err.value.status == 429 and err.value.code == "flow_shed"
        assert dict(err.value.headers)[b"retry-after"] == b"1"
        assert not high.done()
        fc.cancel_all()
        with pytest.raises(Refused) as err:
            await high
        assert err.value.status == 503 and err.value.code == "router_shutdown"

    asyncio.run(main())


def test_a_client_that_leaves_while_waiting_leaves_the_queue():
    async def main():
        fc = control(settings(), Pods(Pod("a", "u", kv_usage=0.95, ts=1)))
        watcher = pending()
        task = asyncio.ensure_future(fc.wait(call(), watcher))
        await asyncio.sleep(0.01)
        watcher.set_result(None)
        assert await task is False
        assert len(fc.queue) == 0

    asyncio.run(main())


def test_requests_let_through_count_against_the_room_until_they_are_on_an_engines_socket():
    """A burst on one look: the replica's room (here this router's cap of 2) is handed out
    once, not to every request of the burst; what was let through counts until it is sent."""

    async def main():
        inflight = {"a": 0}
        fc = control(settings(pod_max_inflight=2), Pods(Pod("a", "u")), inflight)
        calls = [call() for _ in range(3)]
        first = [await fc.wait(c, pending()) for c in calls[:2]]
        assert first == [True, True]
        third = asyncio.ensure_future(fc.wait(calls[2], pending()))
        await asyncio.sleep(0.05)
        assert not third.done() and len(fc.queue) == 1
        inflight["a"] = 2  # both on the engine's socket now: still no room
        for c in calls[:2]:
            c.flow.held.sent.set()
        await asyncio.sleep(0.05)
        assert not third.done()
        inflight["a"] = 1  # one ended
        fc.done(calls[0], None)
        assert await asyncio.wait_for(third, 2) is True and calls[2].flow.waited

    asyncio.run(main())


@pytest.mark.parametrize("credit", [0.0, 100.0, 512.0])
def test_a_tenant_that_starts_asking_is_lifted_to_the_tenant_served_last_less_the_credit(credit):
    """Service received while there was room for everyone does not count against a tenant once
    another one starts asking: the newcomer starts level with it, less the newcomer credit (a
    lift never lowers: with a credit above the other's service, the newcomer keeps its own)."""

    async def main():
        fc = control(settings(newcomer_credit=credit), Pods(Pod("a", "u", ts=1)))
        for _ in range(5):
            c = call({"x-gateway-inference-fairness-id": "early"}, tokens=100)
            await fc.wait(c, pending())
            c.flow.held.sent.set()
        assert fc.counters.value("id:early") == pytest.approx(500)
        late = call({"x-gateway-inference-fairness-id": "late"}, tokens=10)
        await fc.wait(late, pending())
        assert fc.counters.value("id:late") == pytest.approx(max(0.0, 500 - credit) + 10)

    asyncio.run(main())


def test_the_newcomer_credit_is_a_head_start_that_never_accumulates():
    """A tenant that goes idle and comes back again and again is lifted each time to at most the
    credit below the least-served waiting tenant: never further behind it than that."""
    clock = Clock()
    fc = control(settings(newcomer_credit=50.0), Pods(Pod("a", "u", ts=1)), clock=clock)
    fc.counters.tenant("id:flood")
    fc.counters.charge("id:flood", 1000.0)
    flood = Ticket("id:flood", fc.s.band("standard"), clock(), clock() + 60)
    fc.queue.push(flood)  # the flood waits
    fc.counters.tenant("id:pulse")
    for _ in range(5):  # idle -> asking, served, idle again
        fc._lift(SimpleNamespace(tenant="id:pulse", identity=identify(fc.s, {}, None)))
        assert fc.counters.value("id:pulse") == pytest.approx(950.0)
    fc.counters.charge("id:pulse", 30.0)  # served a little: still within the credit, no lift
    fc._lift(SimpleNamespace(tenant="id:pulse", identity=identify(fc.s, {}, None)))
    assert fc.counters.value("id:pulse") == pytest.approx(980.0)
    with pytest.raises(ValueError, match="newcomer credit"):
        settings(newcomer_credit=-1.0)
