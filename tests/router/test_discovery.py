"""Contract 3's trust rule: where a pod is reachable comes from the platform (EndpointSlices, a
static list, kvmesh up's backends file), never from Redis; a heartbeat only adds load,
readiness and a block set to a pod the router already knows."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from urllib.parse import parse_qs

import httpx
import pytest
import uvicorn

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex
from kvmesh.common.engine_load import parse_prometheus
from kvmesh.router.discovery import (
    Discovery,
    Endpoint,
    EndpointSlices,
    FileEndpoints,
    StaticEndpoints,
    normalize_url,
    parse_backend,
)
from kvmesh.router.metrics import RouterMetrics
from tests.conftest import free_port, shared_encoder, wait_until

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def text(seed: int, n: int = 80) -> str:
    return " ".join(
        WORDS[(seed * 5 + i * (seed % 3 + 1)) % len(WORDS)] + str(seed) for i in range(n)
    )


def complete(base: str, prompt: str) -> httpx.Response:
    return httpx.post(
        base + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=20
    )


def metric(base: str, name: str, **labels) -> float:
    return sum(
        v
        for n, lab, v in parse_prometheus(httpx.get(base + "/metrics", timeout=5).text)
        if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def rogue_heartbeat(r, model: str, pod: str, url: str, keys: list[str] = ()) -> None:
    """What anyone with write access to Redis can do: claim to be a ready, idle pod holding every block."""
    hb = rl.Heartbeat(pod=pod, url=url, model=model)
    r.hset(rl.heartbeat_key(model, pod), mapping=hb.to_mapping())
    r.sadd(rl.pods_key(model), pod)
    if keys:
        r.sadd(rl.blocks_key(model, pod), *keys)


# -- endpoint sources ------------------------------------------------------------------------------
def test_backend_entries_and_url_normalisation():
    assert parse_backend("pod-1=http://10.0.0.1:8000/") == Endpoint("pod-1", "http://10.0.0.1:8000")
    assert parse_backend(" http://h:9/x?a=b ") == Endpoint(None, "http://h:9/x?a=b")
    for bad in ("=http://h", "pod=ftp://h", "pod=", "not a url", "http://"):
        with pytest.raises(ValueError):
            parse_backend(bad)
    with pytest.raises(ValueError, match="duplicate"):
        StaticEndpoints(["a=http://h:1", "a=http://h:2"])
    assert (
        normalize_url("HTTP://Host:80/")
        == normalize_url("http://host")
        != normalize_url("http://host:81")
    )
    assert (
        normalize_url("https://h") == ("https", "h", 443, "") and normalize_url("redis://h") is None
    )


def test_backends_file_is_reread_when_it_changes_and_a_bad_write_keeps_the_last_list(tmp_path):
    path = tmp_path / "backends"
    src = FileEndpoints(str(path))
    assert src.endpoints() is None and src.error  # not written yet
    path.write_text("# kvmesh up\nreplica-0=http://127.0.0.1:9000\n")
    assert src.endpoints() == [Endpoint("replica-0", "http://127.0.0.1:9000")]
    path.write_text("replica-0=http://127.0.0.1:9000\nreplica-1 = http://127.0.0.1:9001  # new\n")
    assert [e.name for e in src.endpoints()] == ["replica-0", "replica-1"]
    path.write_text("replica-0=http://127.0.0.1:9000\nreplica-2=gopher://x\n")
    assert [e.name for e in src.endpoints()] == ["replica-0", "replica-1"] and "gopher" in src.error


def test_heartbeats_only_score_known_pods_and_unknown_ones_are_counted(redis_server, model_name):
    """Matched by name (same URL required) or, for an unnamed static backend, by URL. Everything
    else is ignored and counted; the URL routed to is always the platform's."""
    r = redis_server.client()
    rogue_heartbeat(
        r, model_name, "a", "http://10.0.0.1:8000/"
    )  # named, same URL (normalised): accepted
    rogue_heartbeat(
        r, model_name, "b", "http://10.0.0.2:8000"
    )  # unnamed static URL: accepted by URL
    rogue_heartbeat(r, model_name, "c", "http://10.0.0.9:8000")  # nobody: unknown
    rogue_heartbeat(
        r, model_name, "d", "http://evil:8000"
    )  # named d below, but another URL: mismatch
    rogue_heartbeat(
        r, model_name, "e", "http://10.0.0.1:8000"
    )  # a's URL under another name: unknown
    r.hset(rl.heartbeat_key(model_name, "a"), mapping={"running": "3", "state": "ready"})
    r.hset(
        rl.heartbeat_key(model_name, "b"), mapping={"state": "weird"}
    )  # an unknown state: not routed

    async def scenario():
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_server.url)
        metrics = RouterMetrics()
        d = Discovery(
            model_name,
            client,
            metrics,
            [
                "a=http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "d=http://10.0.0.4:8000",
                "f=http://10.0.0.6:8000",
                "http://10.0.0.7:8000",
            ],
        )
        await d.refresh()
        await d.refresh()  # a second refresh counts nothing new
        await client.aclose()
        return d, metrics

    d, metrics = asyncio.run(scenario())
    assert {n: (p.url, p.state, p.has_blocks) for n, p in d.pods.items()} == {
        "a": ("http://10.0.0.1:8000", "ready", True),
        "b": ("http://10.0.0.2:8000", "unknown", True),
        "d": ("http://10.0.0.4:8000", "no_heartbeat", False),  # its heartbeat was ignored
        "f": (
            "http://10.0.0.6:8000",
            "no_heartbeat",
            False,
        ),  # named, no sidecar heartbeat: not routed
        "http://10.0.0.7:8000": (
            "http://10.0.0.7:8000",
            "ready",
            False,
        ),  # unnamed, no heartbeat: by load
    }
    assert d.pods["a"].running == 3
    assert sorted(p.name for p in d.routable()) == ["a", "http://10.0.0.7:8000"]
    assert sorted(d.ignored) == [("c", "unknown_pod"), ("d", "url_mismatch"), ("e", "unknown_pod")]
    text_ = metrics.render().decode()
    samples = {(n, tuple(sorted(lab.items()))): v for n, lab, v in parse_prometheus(text_)}
    assert samples[("kvmesh_router_ignored_heartbeats_total", (("reason", "unknown_pod"),))] == 2
    assert samples[("kvmesh_router_ignored_heartbeats_total", (("reason", "url_mismatch"),))] == 1
    assert samples[("kvmesh_router_ignored_heartbeats_current", (("reason", "unknown_pod"),))] == 2
    assert samples[("kvmesh_router_known_pods", ())] == 5
    assert d.detail()["ignored_heartbeats"] == 3 and d.detail()["redis"] == "ok" and d.redis_fresh


def test_without_redis_every_known_pod_is_routed_by_load():
    d = Discovery("m", None, RouterMetrics(), ["a=http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    assert sorted(p.name for p in d.routable()) == ["a", "http://10.0.0.2:8000"]
    assert not any(p.has_blocks for p in d.pods.values()) and not d.redis_fresh
    assert d.detail()["redis"] == "off" and d.detail()["fallback"] is None


# -- the router as a whole ---------------------------------------------------------------------------
def test_rogue_heartbeats_in_redis_never_redirect_requests(
    mesh, router_factory, redis_server, stub_factory, model_name, mesh_backends
):
    stubs, _ = mesh(2)
    (attacker,) = stub_factory(model_name, 1, events=False)  # an engine someone else controls
    r = redis_server.client()
    prompts = [text(i) for i in range(8)]
    encoder = shared_encoder()
    every_key = [key_hex(k) for p in prompts for k in block_keys(encoder.encode(p), model_name)]
    rogue_heartbeat(
        r, model_name, "evil", attacker.url, every_key
    )  # unknown pod, claims every prefix
    rogue_heartbeat(r, model_name, "pod-9", attacker.url, every_key)  # a known name, another URL
    rogue_heartbeat(
        r, model_name, "pod-0-twin", stubs[0].url, every_key
    )  # a known URL, another name
    router = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        static_backends=mesh_backends + ["pod-9=http://127.0.0.1:1"],
    )
    results = [complete(router.url, p) for p in prompts]
    assert all(x.status_code == 200 for x in results), [x.text for x in results]
    assert {x.headers["x-kvmesh-pod"] for x in results} <= {"pod-0", "pod-1"}
    assert attacker.stats()["requests"] == 0
    assert metric(router.url, "kvmesh_router_ignored_heartbeats_total", reason="unknown_pod") == 2
    assert metric(router.url, "kvmesh_router_ignored_heartbeats_total", reason="url_mismatch") == 1
    ready = httpx.get(router.url + "/ready").json()
    assert ready["pods"] == 2 and ready["discovery"]["ignored_heartbeats"] == 3
    # Redis still scores the known pods: a repeated prompt goes where its prefix is.
    first = results[0].headers["x-kvmesh-pod"]
    wait_until(
        lambda: r.scard(rl.blocks_key(model_name, first)) > 0, 5, msg="blocks of the first prompt"
    )
    again = complete(router.url, prompts[0])
    assert again.headers["x-kvmesh-pod"] == first
    assert metric(router.url, "kvmesh_router_decisions_total", reason="prefix_match") >= 1


def test_unnamed_static_backends_are_matched_to_heartbeats_by_url(
    mesh, router_factory, redis_server, model_name
):
    stubs, _ = mesh(2)
    router = router_factory(
        model=model_name, redis_url=redis_server.url, static_backends=[s.url for s in stubs]
    )
    wait_until(
        lambda: set(router.router.discovery.pods) == {"pod-0", "pod-1"},
        5,
        msg="heartbeats matched by URL",
    )
    p = text(40)
    pod = complete(router.url, p).headers["x-kvmesh-pod"]
    wait_until(
        lambda: redis_server.client().scard(rl.blocks_key(model_name, pod)) > 0, 5, msg="blocks"
    )
    assert complete(router.url, p).headers["x-kvmesh-pod"] == pod


def test_backends_file_adds_and_removes_pods_while_running(
    mesh, router_factory, redis_server, model_name, tmp_path
):
    stubs, _ = mesh(2)
    path = tmp_path / "backends"
    path.write_text(f"pod-0={stubs[0].url}\n")
    router = router_factory(model=model_name, redis_url=redis_server.url, backends_file=str(path))
    assert {complete(router.url, text(50 + i)).headers["x-kvmesh-pod"] for i in range(6)} == {
        "pod-0"
    }
    path.write_text(f"pod-0={stubs[0].url}\npod-1={stubs[1].url}\n")
    wait_until(lambda: len(router.router.discovery.routable()) == 2, 5, msg="pod-1 added")
    path.write_text(f"pod-1={stubs[1].url}\n")
    wait_until(
        lambda: [p.name for p in router.router.discovery.routable()] == ["pod-1"],
        5,
        msg="pod-0 removed",
    )
    assert {complete(router.url, text(60 + i)).headers["x-kvmesh-pod"] for i in range(6)} == {
        "pod-1"
    }
    assert httpx.get(router.url + "/ready").json()["discovery"]["sources"][0]["kind"] == "file"


# -- Kubernetes EndpointSlices ----------------------------------------------------------------------
class FakeKube:
    """The slice of the Kubernetes API the router uses: list and watch EndpointSlices."""

    def __init__(self):
        self.slices: dict[str, dict] = {}
        self.rv = 100
        self.events: list[tuple[int, dict]] = []
        self.requests: list[tuple[str, dict, str | None]] = []
        self.gone_next_watch = False
        self.lock = threading.Lock()
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                self, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
            )
        )
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, msg="fake kube API")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(5)

    def slice(self, name: str, port: int, endpoints: list[tuple[str, str, bool]]) -> dict:
        with self.lock:
            self.rv += 1
            return {
                "metadata": {
                    "name": name,
                    "resourceVersion": str(self.rv),
                    "labels": {"kubernetes.io/service-name": "engine"},
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
                "endpoints": [
                    {
                        "addresses": [ip],
                        "conditions": {"ready": ready},
                        "targetRef": {"kind": "Pod", "name": pod, "namespace": "ns1"},
                    }
                    for pod, ip, ready in endpoints
                ],
            }

    def put(self, name: str, port: int, endpoints, event: str = "MODIFIED"):
        obj = self.slice(name, port, endpoints)
        with self.lock:
            self.slices[name] = obj
            self.events.append((self.rv, {"type": event, "object": obj}))

    def delete(self, name: str):
        with self.lock:
            obj = self.slices.pop(name)
            self.rv += 1
            self.events.append(
                (
                    self.rv,
                    {
                        "type": "DELETED",
                        "object": {
                            **obj,
                            "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)},
                        },
                    },
                )
            )

    def push(self, event: dict):
        with self.lock:
            self.rv += 1
            self.events.append((self.rv, event))

    def count(self, kind: str) -> int:
        return sum(1 for k, _, _ in self.requests if k == kind)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        params = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        auth = dict(scope["headers"]).get(b"authorization")
        kind = "watch" if params.get("watch") else "list"
        self.requests.append((kind, params, auth.decode() if auth else None))
        assert scope["path"] == "/apis/discovery.k8s.io/v1/namespaces/ns1/endpointslices", scope[
            "path"
        ]
        assert params["labelSelector"] == "kubernetes.io/service-name=engine"
        headers = [(b"content-type", b"application/json")]
        if kind == "list":
            with self.lock:
                body = {
                    "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.rv)},
                    "items": list(self.slices.values()),
                }
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            return await send({"type": "http.response.body", "body": json.dumps(body).encode()})
        if self.gone_next_watch:
            self.gone_next_watch = False
            await send({"type": "http.response.start", "status": 410, "headers": headers})
            return await send(
                {"type": "http.response.body", "body": b'{"kind":"Status","code":410}'}
            )
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        sent = int(params.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(params.get("timeoutSeconds", 300))
        while time.monotonic() < deadline and not self.server.should_exit:
            with self.lock:
                todo = [(rv, ev) for rv, ev in self.events if rv > sent]
            for rv, ev in todo:
                sent = rv
                await send(
                    {
                        "type": "http.response.body",
                        "body": json.dumps(ev).encode() + b"\n",
                        "more_body": True,
                    }
                )
                if ev["type"] == "ERROR":
                    return await send({"type": "http.response.body", "body": b""})
            await asyncio.sleep(0.02)
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def kube():
    k = FakeKube()
    yield k
    k.stop()


class LoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self):
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_endpoint_slices_list_then_watch_relist_on_gone_and_rotated_tokens(kube, tmp_path):
    kube.put("engine-a", 8000, [("pod-0", "10.0.0.1", True), ("pod-1", "10.0.0.2", False)], "ADDED")
    token = tmp_path / "token"
    token.write_text("tok-1")
    slices = EndpointSlices("engine", "ns1", api_url=kube.url, interval=0.1, watch_timeout=5)
    slices.token_file = str(
        token
    )  # as in a pod: re-read for every request (projected tokens rotate)
    loop = LoopThread()
    loop.run(slices.run())
    try:
        wait_until(lambda: slices.endpoints() is not None, 5, msg="listed")
        assert sorted(slices.endpoints(), key=str) == [
            Endpoint("pod-0", "http://10.0.0.1:8000"),
            Endpoint("pod-1", "http://10.0.0.2:8000", ready=False),
        ]
        assert slices.ready_hosts == {"10.0.0.1"}
        wait_until(lambda: kube.count("watch") == 1, 5, msg="watching")
        kube.put("engine-a", 8000, [("pod-0", "10.0.0.1", True), ("pod-1", "10.0.0.2", True)])
        wait_until(
            lambda: all(e.ready for e in slices.endpoints()),
            5,
            msg="a watch event makes pod-1 ready",
        )
        kube.put(
            "engine-b", 9000, [("pod-2", "10.0.0.3", True)], "ADDED"
        )  # another port: its own slice
        wait_until(
            lambda: Endpoint("pod-2", "http://10.0.0.3:9000") in (slices.endpoints() or []), 5
        )
        kube.delete("engine-a")
        wait_until(
            lambda: slices.endpoints() == [Endpoint("pod-2", "http://10.0.0.3:9000")],
            5,
            msg="deleted",
        )
        assert kube.count("list") == 1  # everything since came from the one watch
        # The API ends the watch with 410 Gone (resourceVersion too old): list again, then watch.
        token.write_text("tok-2")
        kube.gone_next_watch = True
        kube.push(
            {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
        )
        wait_until(
            lambda: kube.count("list") >= 3, 5, msg="re-listed after the ERROR event and the 410"
        )
        wait_until(lambda: kube.count("watch") >= 3, 5, msg="watching again")
        assert kube.requests[0][2] == "Bearer tok-1" and kube.requests[-1][2] == "Bearer tok-2"
        watch_params = [p for k, p, _ in kube.requests if k == "watch"]
        assert all(
            p.get("resourceVersion") and p.get("allowWatchBookmarks") == "true"
            for p in watch_params
        )
        # An API outage keeps the last good answer.
        kube.stop()
        wait_until(lambda: slices.last_error is not None, 5, msg="outage noticed")
        assert slices.endpoints() == [Endpoint("pod-2", "http://10.0.0.3:9000")]
    finally:
        loop.stop()


def test_parse_slice_tolerates_odd_objects():
    s = EndpointSlices("engine", "ns1", api_url="http://127.0.0.1:1", token="")
    assert s.endpoints() is None and s.ready_hosts is None
    assert s.parse_slice("junk") == ([], set())
    eps, hosts = s.parse_slice(
        {
            "addressType": "IPv6",
            "ports": [
                {"name": "metrics", "port": 9},
                {"port": "x"},
                {"name": "http", "port": 8000},
            ],
            "endpoints": [
                {"addresses": ["fd00::1"], "targetRef": {"kind": "Pod", "name": "p"}},
                {"addresses": ["fd00::2"], "conditions": {"ready": None}},
                {"addresses": []},
                "junk",
                {"conditions": "junk"},
            ],
        }
    )
    assert eps == [Endpoint("p", "http://[fd00::1]:8000"), Endpoint(None, "http://[fd00::2]:8000")]
    assert hosts == {"fd00::1", "fd00::2"}
    eps, hosts = s.parse_slice({"ports": [], "endpoints": [{"addresses": ["10.1.1.1"]}]})
    assert eps == [] and hosts == {"10.1.1.1"}  # no port: nothing to send requests to


def test_router_on_endpoint_slices_follows_pod_readiness(
    kube, mesh, router_factory, redis_server, model_name
):
    stubs, _ = mesh(2)
    for i, s in enumerate(stubs):
        kube.put(f"engine-{i}", s.port, [(f"pod-{i}", "127.0.0.1", True)], "ADDED")
    rogue_heartbeat(redis_server.client(), model_name, "pod-7", stubs[0].url)  # not in the Service
    router = router_factory(
        model=model_name,
        redis_url=redis_server.url,
        k8s_service="engine",
        k8s_namespace="ns1",
        k8s_api_url=kube.url,
    )
    wait_until(
        lambda: len(router.router.discovery.routable()) == 2, 10, msg="both pods from the slices"
    )
    used = {complete(router.url, text(70 + i)).headers["x-kvmesh-pod"] for i in range(12)}
    assert used == {"pod-0", "pod-1"}
    # Kubernetes marks pod-1 not ready (its readiness probe fails, or it is terminating): its
    # heartbeat is still live in Redis, but the router stops sending it requests at once.
    kube.put("engine-1", stubs[1].port, [("pod-1", "127.0.0.1", False)])
    wait_until(
        lambda: [p.name for p in router.router.discovery.routable()] == ["pod-0"],
        5,
        msg="pod-1 gone",
    )
    assert {complete(router.url, text(90 + i)).headers["x-kvmesh-pod"] for i in range(6)} == {
        "pod-0"
    }
    assert (
        router.router.discovery.pods["pod-1"].state == "not_ready"
    )  # known, so its heartbeat is not ignored
    detail = httpx.get(router.url + "/ready").json()["discovery"]
    assert detail["sources"][0]["kind"] == "k8s" and detail["sources"][0]["synced"]
    assert detail["ignored_heartbeats"] == 1  # pod-7
    assert metric(router.url, "kvmesh_router_ignored_heartbeats_total", reason="unknown_pod") == 1
    # The pod is deleted from the Service: gone from the router, whatever Redis says.
    kube.delete("engine-1")
    wait_until(lambda: "pod-1" not in router.router.discovery.pods, 5, msg="pod-1 deleted")


def test_numbers_from_redis_and_engine_metrics_are_clamped(redis_server, model_name):
    from kvmesh.common.engine_load import engine_load

    load = engine_load(
        "vllm:kv_cache_usage_perc NaN\nvllm:num_requests_running +Inf\n"
        "vllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.25\n"
    )
    assert (load.kv_usage, load.running, load.waiting) == (0.25, 0, 2)
    r = redis_server.client()
    rogue_heartbeat(r, model_name, "a", "http://10.0.0.1:8000")
    r.hset(
        rl.heartbeat_key(model_name, "a"),
        mapping={"kv_usage": "nan", "running": "-50", "waiting": "-1"},
    )

    async def scenario():
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_server.url)
        d = Discovery(model_name, client, RouterMetrics(), ["a=http://10.0.0.1:8000"])
        await d.refresh()
        await client.aclose()
        return d.pods["a"]

    pod = asyncio.run(scenario())
    assert (pod.kv_usage, pod.running, pod.waiting) == (1.0, 0, 0)
