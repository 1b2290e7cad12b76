"""Scale from zero in the router: with no routable engine, requests are held in a bounded queue
while the Redis demand key tells the autoscalers to scale up; they go out, in arrival order, as
soon as an engine is ready, and get a 503 with Retry-After when the queue is full or the wait
too long. Real Redis, real stub engines with their sidecars, real HTTP on loopback."""

import dataclasses
import math
import threading
import time

import httpx

from kvmesh.common import redis_layout as rl
from kvmesh.router.app import RouterConfig
from tests.conftest import wait_until
from tests.router.test_router import metric, text


class Endpoints:
    """The router's endpoint source at zero replicas: an empty backends file that gains a line
    when an engine comes up (as `kvmesh up` writes it), where the router reads one; else the
    heartbeats in Redis are the source."""

    FILE = "backends_file" in {f.name for f in dataclasses.fields(RouterConfig)}

    def __init__(self, tmp_path):
        self.path = tmp_path / "backends"
        self.path.write_text("")

    @property
    def kw(self) -> dict:
        return {"backends_file": str(self.path)} if self.FILE else {}

    def add(self, name: str, url: str) -> None:
        with self.path.open("a") as f:
            f.write(f"{name}={url}\n")


def post(base: str, prompt: str, timeout: float = 60, **headers) -> httpx.Response:
    return httpx.post(
        base + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4},
        headers=headers,
        timeout=timeout,
    )


def ready(router) -> dict:
    resp = httpx.get(router.url + "/ready", timeout=5)
    assert resp.status_code == 200, resp.text  # the router can accept: it stays ready
    return resp.json()


def test_held_requests_signal_demand_and_go_out_in_order_once_an_engine_is_ready(
    redis_server, router_factory, mesh, model_name, tmp_path
):
    r = redis_server.client()
    endpoints = Endpoints(tmp_path)
    router = router_factory(
        model=model_name, redis_url=redis_server.url, scale_from_zero_timeout=60, **endpoints.kw
    )
    assert ready(router)["pods"] == 0 and ready(router)["held_requests"] == 0
    assert r.get(rl.demand_key(model_name)) is None  # nothing held, no demand

    results: dict[int, httpx.Response] = {}
    threads = []
    t_first = time.time()
    for i in range(3):
        t = threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, post(router.url, text(200 + i, 40), **{"X-Request-Id": f"held-{i}"})
            )
        )
        t.start()
        threads.append(t)
        wait_until(
            lambda: ready(router)["held_requests"] == i + 1, 10, msg=f"{i + 1} requests held"
        )
    assert not results  # nobody answered: they wait

    value = wait_until(lambda: r.get(rl.demand_key(model_name)), 5, msg="demand key")
    assert t_first - 1 <= float(value) <= time.time() + 1
    assert 0 < r.ttl(rl.demand_key(model_name)) <= rl.DEMAND_TTL_S
    assert metric(router.url, "kvmesh_router_held_requests") == 3
    # the key is refreshed while requests wait, at most once a second
    wait_until(
        lambda: float(r.get(rl.demand_key(model_name))) > float(value), 5, msg="demand refreshed"
    )

    stubs, _ = mesh(1)  # an engine (and its sidecar) comes up
    endpoints.add("pod-0", stubs[0].url)
    for t in threads:
        t.join(30)
    held_for = time.time() - t_first
    assert [results[i].status_code for i in range(3)] == [200, 200, 200], [
        results[i].text for i in results
    ]
    assert all(results[i].headers["x-kvmesh-pod"] == "pod-0" for i in range(3))
    assert stubs[0].stats()["request_ids"] == ["held-0", "held-1", "held-2"]  # arrival order
    assert metric(router.url, "kvmesh_router_held_requests") == 0
    assert metric(router.url, "kvmesh_router_scale_from_zero_total", outcome="dispatched") == 3
    assert (
        metric(router.url, "kvmesh_router_scale_from_zero_wait_seconds_count", outcome="dispatched")
        == 3
    )
    signals = metric(router.url, "kvmesh_router_demand_signals_total")
    assert 2 <= signals <= math.ceil(held_for) + 1
    body = ready(router)
    assert body["pods"] == 1 and body["held_requests"] == 0
    # with an engine up, requests go straight through (nothing held)
    assert post(router.url, "hello").status_code == 200
    assert metric(router.url, "kvmesh_router_scale_from_zero_total", outcome="dispatched") == 3


def test_a_held_request_times_out_with_503_and_retry_after(
    redis_server, router_factory, model_name, tmp_path
):
    router = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        scale_from_zero_timeout=0.5,
        **Endpoints(tmp_path).kw,
    )
    t0 = time.monotonic()
    resp = post(router.url, "is anyone there?")
    assert time.monotonic() - t0 >= 0.5
    assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1
    err = resp.json()["error"]
    assert (
        err["type"] == "service_unavailable"
        and err["code"] == "no_ready_engine"
        and "0.5 s" in err["message"]
    )
    assert metric(router.url, "kvmesh_router_scale_from_zero_total", outcome="timeout") == 1
    assert metric(router.url, "kvmesh_router_held_requests") == 0
    assert (
        metric(router.url, "kvmesh_router_requests_total", route="/v1/completions", status="503")
        == 1
    )
    assert redis_server.client().exists(rl.demand_key(model_name))  # it did ask for an engine


def test_full_queue_is_503_and_a_client_that_leaves_frees_its_place(
    redis_server, router_factory, model_name, tmp_path
):
    router = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        max_pending_requests=1,
        scale_from_zero_timeout=60,
        **Endpoints(tmp_path).kw,
    )
    gave_up = threading.Event()

    def impatient():
        try:
            post(router.url, "first", timeout=2)
        except httpx.TimeoutException:
            gave_up.set()  # the client hangs up while its request is held

    t = threading.Thread(target=impatient)
    t.start()
    wait_until(lambda: ready(router)["held_requests"] == 1, 10, msg="first request held")
    full = post(router.url, "second")
    assert full.status_code == 503 and int(full.headers["retry-after"]) >= 1
    assert (
        full.json()["error"]["code"] == "no_ready_engine"
        and "1 requests already wait" in full.json()["error"]["message"]
    )
    assert metric(router.url, "kvmesh_router_scale_from_zero_total", outcome="queue_full") == 1
    t.join(10)
    assert gave_up.is_set()
    wait_until(
        lambda: ready(router)["held_requests"] == 0, 10, msg="the abandoned request left the queue"
    )
    wait_until(
        lambda: (
            metric(router.url, "kvmesh_router_scale_from_zero_total", outcome="disconnect") == 1
        ),
        5,
    )
    assert metric(router.url, "kvmesh_router_held_requests") == 0


def test_holding_off_answers_503_at_once_and_is_not_ready(
    redis_server, router_factory, model_name, tmp_path
):
    router = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        max_pending_requests=0,
        **Endpoints(tmp_path).kw,
    )
    resp = post(router.url, "hello")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(router.url + "/ready").status_code == 503
    assert not redis_server.client().exists(rl.demand_key(model_name))
