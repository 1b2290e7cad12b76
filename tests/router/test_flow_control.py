"""Flow control through real HTTP on loopback, with stub engines and their sidecars in a real
Redis: a flooding tenant against light ones, the critical band against the sheddable one, and
two routers sharing fair share through Redis. The assertions are about order and counts, not
about timings (the bench, bench/flow_control.py, measures those)."""

from __future__ import annotations

import asyncio
import time

import httpx

from kvmesh.router.flow import FlowSettings
from tests.conftest import wait_until


def flow(**kw) -> FlowSettings:
    return FlowSettings(enabled=True, **kw)


async def ask(client, url, tenant, band=None, rid=None, max_tokens=4):
    headers = {"x-gateway-inference-fairness-id": tenant}
    if band:
        headers["x-gateway-inference-objective"] = band
    if rid:
        headers["x-request-id"] = rid
    r = await client.post(
        url + "/v1/completions",
        json={"model": "m", "prompt": f"hello from {tenant}", "max_tokens": max_tokens},
        headers=headers,
    )
    return r


def test_a_flooding_tenant_does_not_starve_the_light_ones(
    mesh, router_factory, model_name, redis_server
):
    """One tenant opens 60 requests at once; three light tenants then ask one request at a time.
    The light tenants finish while most of the flood still waits: each gets its turn within a
    round of the backlogged tenants, not behind the flood. Nothing is refused, no 5xx."""
    mesh(2, "--token-delay", "0.02")
    rt = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        flow=flow(pod_max_inflight=2, default_deadline=120, max_queued=200),
    )

    async def main():
        done_heavy: list[float] = []
        async with httpx.AsyncClient(timeout=120) as client:

            async def heavy():
                r = await ask(client, rt.url, "flood", max_tokens=8)
                done_heavy.append(time.monotonic())
                return r

            async def light(name):
                out = []
                for _ in range(4):
                    out.append(await ask(client, rt.url, name, max_tokens=8))
                return out, len(done_heavy)

            flood = [asyncio.ensure_future(heavy()) for _ in range(60)]
            await asyncio.sleep(0.3)  # the flood is queued at the router
            lights = await asyncio.gather(*(light(f"light-{i}") for i in range(3)))
            heavies = await asyncio.gather(*flood)
        return heavies, lights

    heavies, lights = asyncio.run(main())
    assert [r.status_code for r in heavies] == [200] * 60
    print("heavy done before each light tenant finished:", [n for _, n in lights])
    for replies, heavy_done_before in lights:
        assert [r.status_code for r in replies] == [200] * 4
        # 4 light requests, each served within a round of the 4 backlogged tenants (plus what
        # was in flight): far fewer than the flood's 60 went first
        assert heavy_done_before <= 40, heavy_done_before
    text = httpx.get(rt.url + "/metrics").text
    assert 'kvmesh_router_flow_dispatched_total{band="standard",queued="yes"}' in text


def test_the_critical_band_is_never_refused_while_the_sheddable_one_is(
    mesh, router_factory, model_name, redis_server
):
    mesh(2, "--token-delay", "0.02")
    rt = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        flow=flow(pod_max_inflight=1, max_queued=16, default_deadline=120),
    )

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            low = [
                asyncio.ensure_future(ask(client, rt.url, f"b{i % 3}", "sheddable", max_tokens=8))
                for i in range(30)
            ]
            await asyncio.sleep(0.2)
            high = [
                asyncio.ensure_future(ask(client, rt.url, f"c{i % 2}", "critical", max_tokens=8))
                for i in range(12)
            ]
            return await asyncio.gather(*low), await asyncio.gather(*high)

    low, high = asyncio.run(main())
    assert [r.status_code for r in high] == [200] * 12
    codes = sorted({r.status_code for r in low})
    assert codes == [200, 429], codes
    for r in low:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] in ("flow_shed", "flow_queue_full")
    assert all(r.status_code < 500 for r in low + high)


async def queued(fc, n: int, timeout: float = 30.0) -> None:
    """Until the router's flow queue holds n requests (a loaded machine takes its time to send
    them), without blocking the event loop the requests are sent from."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(fc.queue) < n:
        assert loop.time() < deadline, f"{len(fc.queue)} of {n} requests queued"
        await asyncio.sleep(0.02)


def test_two_routers_sharing_redis_converge_on_fair_share(
    mesh, router_factory, model_name, redis_server
):
    """Router A serves the tenant "heavy" alone (never saturated); router B, whose replica
    says it is saturated, holds requests of "heavy" and "light". Once B has synced the service A
    gave "heavy", B dispatches every "light" request before any "heavy" one, although "heavy"
    asked first."""
    (stub,), _ = mesh(1)
    a = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        flow=flow(queue_threshold=10_000, kv_threshold=1.01, sync_interval=0.2),
    )
    b = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        flow=flow(pod_max_inflight=1, queue_threshold=5, sync_interval=0.2, default_deadline=120),
    )
    fc_a, fc_b = a.router.flow, b.router.flow

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            # B knows both tenants (a baseline for each), then its replica says it is saturated
            await ask(client, b.url, "heavy")
            await ask(client, b.url, "light")
            stub.config(waiting=50)
            wait_until(lambda: b.router.flow.saturated(), 10, msg="B saturated")
            held = [
                asyncio.ensure_future(ask(client, b.url, "heavy", rid=f"heavy-{i}"))
                for i in range(4)
            ]
            await queued(fc_b, 4)  # every "heavy" request asked (and held) first
            held += [
                asyncio.ensure_future(ask(client, b.url, "light", rid=f"light-{i}"))
                for i in range(4)
            ]
            await queued(fc_b, 8)
            assert len(fc_b.queue) == 8
            # A gives "heavy" a lot of service; B learns it within a sync or two
            for _ in range(5):
                await asyncio.gather(
                    *(ask(client, a.url, "heavy", max_tokens=32) for _ in range(4))
                )
            served_at_a = fc_a.counters.value("id:heavy")
            wait_until(
                lambda: fc_b.counters.value("id:heavy") > 0.8 * served_at_a,
                10,
                msg="B sees A's service",
            )
            stub.config(waiting=0)
            return await asyncio.gather(*held)

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [200] * 8
    seen = [rid for rid in stub.stats()["request_ids"] if rid.startswith(("heavy-", "light-"))]
    assert [rid.split("-")[0] for rid in seen] == ["light"] * 4 + ["heavy"] * 4, seen
    # each router's queue depth is published for the autoscalers
    from kvmesh.common import redis_layout as rl

    entries = redis_server.client().hgetall(rl.flow_queued_key(model_name))
    assert fc_a.router_id in entries and fc_b.router_id in entries


def test_malformed_flow_headers_get_the_default_band_never_a_5xx(
    mesh, router_factory, model_name, redis_server
):
    mesh(1)
    rt = router_factory(model=model_name, redis_url=redis_server.url, flow=flow())
    junk = [
        {"x-gateway-inference-objective": "platinum"},
        {"x-gateway-inference-objective": "x" * 5000},
        {"x-gateway-inference-fairness-id": b"\xe9\xff" * 50},
        {"x-gateway-inference-fairness-id": "a b c"},
        {"x-kvmesh-deadline-seconds": "-1"},
        {"x-kvmesh-deadline-seconds": "1e999"},
        {"x-kvmesh-deadline-seconds": "soon"},
    ]
    for headers in junk:
        r = httpx.post(
            rt.url + "/v1/completions",
            json={"model": "m", "prompt": "hi", "max_tokens": 2},
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 200, (headers, r.text)
    text = httpx.get(rt.url + "/metrics").text
    assert 'kvmesh_router_flow_dispatched_total{band="standard",queued="no"} 7.0' in text
    assert 'tenant="anonymous"' in text and "platinum" not in text


def test_the_routers_queue_depths_are_read_by_sync_and_asyncio_clients(redis_server, model_name):
    import redis.asyncio as aioredis

    from kvmesh.common import redis_layout as rl

    r = redis_server.client()
    now = time.time()
    r.hset(rl.flow_queued_key(model_name), mapping={"a": rl.queued_entry(3, now), "b": "junk"})
    assert rl.read_queued_at_routers(r, model_name, now) == 3

    async def read():
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            return await rl.read_queued_at_routers(client, model_name, now)
        finally:
            await client.aclose()

    assert asyncio.run(read()) == 3


def test_the_stub_engines_token_jitter_scatters_delays_within_its_bounds():
    from kvmesh.mesh.stub_engine import StubEngine, build_parser

    exact = StubEngine(build_parser().parse_args(["--token-delay", "0.4"]))
    assert {exact._token_delay() for _ in range(20)} == {0.4}
    jittered = StubEngine(
        build_parser().parse_args(["--token-delay", "0.4", "--token-jitter", "0.5"])
    )
    delays = [jittered._token_delay() for _ in range(200)]
    assert all(0.2 <= d <= 0.6 for d in delays) and len(set(delays)) > 100
    assert min(delays) < 0.25 and max(delays) > 0.55  # the whole range, not a corner of it
