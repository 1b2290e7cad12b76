"""A request that reached no engine is routed again, not failed: when every pod the router
believes ready refuses the connection (its engine was killed an instant ago and discovery has
not caught up), the request never left the router, so it waits, with back-off, for a pod that
takes it, bounded by the scale-from-zero timeout. Real HTTP on loopback, a stub engine as its own
process; the router's only pod is a static backend, so it stays "ready" while its port is dead."""

import threading
import time

from tests.conftest import wait_until
from tests.router.test_router import complete, metric, text


def _dead_pod(stub_factory, model_name):
    stub = stub_factory(model_name, 1)[0]
    stub.kill()  # its port now refuses connections; the router still lists the pod
    return stub


def test_a_request_to_a_just_killed_engine_waits_for_it_to_come_back(
    stub_factory, router_factory, model_name
):
    stub = _dead_pod(stub_factory, model_name)
    router = router_factory(
        model=model_name, static_backends=[f"pod-0={stub.url}"], scale_from_zero_timeout=30
    )
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("resp", complete(router.url, text(900, 30))))
    t.start()
    wait_until(
        lambda: metric(router.url, "kvmesh_router_retries_total", reason="unreached") >= 2,
        10,
        msg="the request routed again while the engine is down",
    )
    assert "resp" not in out, out["resp"].text  # still waiting, not failed
    stub.start()  # the engine comes back on the same address (a restart in place)
    t.join(30)
    resp = out["resp"]
    assert resp.status_code == 200 and resp.headers["x-kvmesh-pod"] == "pod-0", resp.text
    assert stub.stats()["requests"] == 1  # run once
    assert metric(router.url, "kvmesh_router_requests_total", status="200") == 1
    assert metric(router.url, "kvmesh_router_requests_total", status="502") == 0


def test_rerouting_is_bounded_by_the_scale_from_zero_timeout(
    stub_factory, router_factory, model_name
):
    stub = _dead_pod(stub_factory, model_name)
    router = router_factory(
        model=model_name, static_backends=[f"pod-0={stub.url}"], scale_from_zero_timeout=2
    )
    t0 = time.monotonic()
    resp = complete(router.url, text(901, 30))
    waited = time.monotonic() - t0
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "no_engine_reachable", (
        resp.text
    )
    assert 1.0 <= waited < 10, waited
    assert metric(router.url, "kvmesh_router_retries_total", reason="unreached") >= 2


def test_without_holding_the_first_unreached_try_is_answered(
    stub_factory, router_factory, model_name
):
    stub = _dead_pod(stub_factory, model_name)
    router = router_factory(
        model=model_name, static_backends=[f"pod-0={stub.url}"], scale_from_zero_timeout=0
    )
    resp = complete(router.url, text(902, 30))
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "no_engine_reachable", (
        resp.text
    )
    assert metric(router.url, "kvmesh_router_retries_total", reason="unreached") == 0
