"""Adapters at runtime against the API emulator: the real operator loads an added adapter on
each ready replica once, unloads a removed one, reports a failed load with its reason, and
never changes the engine pod template (stub engines stand for the replicas)."""

from __future__ import annotations

import base64

import pytest_asyncio

from kvmesh.operator import render
from tests.operator.adapter_engines import AdapterHeartbeats, StubEngines
from tests.operator.conftest import (
    CONFIGMAPS,
    DEPLOYMENTS,
    JOBS,
    MD,
    SECRETS,
    OperatorRunner,
    assert_within_rbac,
    eventually,
    md_body,
)
from tests.operator.test_operator_runtime import add_pod, after_ticks

MODEL = "smollm2-135m-instruct"


@pytest_asyncio.fixture()
async def engines():
    stub = StubEngines()
    await stub.start()
    yield stub
    await stub.stop()


@pytest_asyncio.fixture()
async def beats(redis_url, engines):
    hb = AdapterHeartbeats(redis_url, MODEL, engines)
    yield hb
    await hb.close()


@pytest_asyncio.fixture()
async def lora_operator(k8s, redis_url, clock):
    runner = OperatorRunner(
        k8s,
        redis_url,
        clock,
        adapter_interval=0.2,
        adapter_settle_seconds=1.0,
        adapter_retry_seconds=60.0,
    )
    await runner.start()
    try:
        yield runner
    finally:
        await runner.stop()
    assert_within_rbac(k8s)


def adapter(name):
    return {"name": name, "source": {"path": f"/srv/adapters/{name}"}}


def md_status(k8s):
    return (k8s.fetch_object(MD, "ns", "demo") or {}).get("status") or {}


def adapter_status(k8s, name):
    return next((a for a in md_status(k8s).get("adapters") or [] if a["name"] == name), {})


async def start_with(k8s, clock, beats, pods, adapters):
    await k8s.put_object(MD, md_body(replicas=len(pods), lora={"maxLoras": 2}, adapters=adapters))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    for pod in pods:
        await add_pod(k8s, clock, pod)
    beats.pods = list(pods)
    beats.start()


async def set_adapters(k8s, adapters):
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["adapters"] = adapters
    await k8s.put_object(MD, md)


def template(k8s):
    return k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["template"]


async def test_adding_an_adapter_loads_it_on_each_ready_pod_once(
    k8s, lora_operator, clock, engines, beats
):
    pods = ["demo-engine-a", "demo-engine-b"]
    await start_with(k8s, clock, beats, pods, [adapter("sql")])
    await add_pod(k8s, clock, "demo-engine-c", ready=False)  # not ready: left alone
    await eventually(lambda: adapter_status(k8s, "sql")["state"] == "Loaded", timeout=15)
    assert engines.count("load_lora_adapter", "sql") == {p: 1 for p in pods}
    before = template(k8s)
    config = k8s.fetch_object(CONFIGMAPS, "ns", "demo-adapters")
    assert config["data"]["lora-modules"] == "sql=/srv/adapters/sql\n"

    await set_adapters(k8s, [adapter("sql"), adapter("chat")])
    await eventually(lambda: md_status(k8s).get("adaptersReady") == "2/2", timeout=15)
    await after_ticks(k8s, n=5, plural="modeldeployments", name="demo")
    assert engines.count("load_lora_adapter", "chat") == {p: 1 for p in pods}
    assert engines.count("load_lora_adapter", "sql") == {p: 1 for p in pods}
    assert engines.paths[("demo-engine-a", "chat")] == "/srv/adapters/chat"
    # The engine's key, as the router sends it.
    key = base64.b64decode(
        k8s.fetch_object(SECRETS, "ns", "demo-engine-api-key")["data"]["api-key"]
    ).decode()
    assert engines.auth == {f"Bearer {key}"}
    # A new replica would start with the whole list; the running ones were not rolled.
    config = k8s.fetch_object(CONFIGMAPS, "ns", "demo-adapters")
    assert config["data"]["lora-modules"] == "sql=/srv/adapters/sql\nchat=/srv/adapters/chat\n"
    assert template(k8s) == before
    status = adapter_status(k8s, "chat")
    assert status["loadedReplicas"] == 2
    assert [r["pod"] for r in status["replicas"]] == pods


async def test_removing_an_adapter_unloads_it(k8s, lora_operator, clock, engines, beats):
    pods = ["demo-engine-a", "demo-engine-b"]
    await start_with(k8s, clock, beats, pods, [adapter("sql"), adapter("chat")])
    await eventually(lambda: md_status(k8s).get("adaptersReady") == "2/2", timeout=15)
    before = template(k8s)

    await set_adapters(k8s, [adapter("sql")])
    await eventually(lambda: md_status(k8s).get("adaptersReady") == "1/1", timeout=15)
    await eventually(lambda: all("chat" not in engines.serves[p] for p in pods), timeout=15)
    await after_ticks(k8s, n=5, plural="modeldeployments", name="demo")
    assert engines.count("unload_lora_adapter", "chat") == {p: 1 for p in pods}
    assert engines.count("unload_lora_adapter", "sql") == {}
    assert template(k8s) == before
    config = k8s.fetch_object(CONFIGMAPS, "ns", "demo-adapters")
    assert config["data"]["lora-modules"] == "sql=/srv/adapters/sql\n"


async def test_a_failed_load_shows_in_status_with_its_reason(
    k8s, lora_operator, clock, engines, beats
):
    engines.fail["broken"] = "Loading lora broken failed: No adapter found for /srv/adapters/broken"
    await start_with(k8s, clock, beats, ["demo-engine-a"], [adapter("sql"), adapter("broken")])
    status = await eventually(
        lambda: (s := adapter_status(k8s, "broken"))["state"] == "Failed" and s, timeout=15
    )
    assert status["replicas"] == [
        {
            "pod": "demo-engine-a",
            "state": "failed",
            "reason": "HTTP 400: Loading lora broken failed: No adapter found for "
            "/srv/adapters/broken",
        }
    ]
    await eventually(lambda: adapter_status(k8s, "sql")["state"] == "Loaded", timeout=15)
    assert md_status(k8s)["adaptersReady"] == "1/2"
    # Retried after adapter_retry_seconds, not on every pass.
    await after_ticks(k8s, n=5, plural="modeldeployments", name="demo")
    assert engines.count("load_lora_adapter", "broken") == {"demo-engine-a": 1}


async def test_a_restarted_engine_gets_its_adapters_back(k8s, lora_operator, clock, engines, beats):
    await start_with(k8s, clock, beats, ["demo-engine-a"], [adapter("sql")])
    await eventually(lambda: adapter_status(k8s, "sql")["state"] == "Loaded", timeout=15)
    engines.serves["demo-engine-a"].clear()  # the engine restarted without it
    await eventually(
        lambda: engines.count("load_lora_adapter", "sql") == {"demo-engine-a": 2}, timeout=15
    )
    await eventually(lambda: adapter_status(k8s, "sql")["state"] == "Loaded", timeout=15)


async def test_a_hugging_face_adapter_is_loaded_once_its_fetch_job_succeeded(
    k8s, lora_operator, clock, engines, redis_url
):
    model = {"huggingFace": {"repoId": "o/m", "sharedCache": {"enabled": True}}}
    hf = {"name": "sql", "source": {"huggingFace": {"repoId": "o/sql", "revision": "v1"}}}
    beats = AdapterHeartbeats(redis_url, "o/m", engines)
    try:
        await k8s.put_object(MD, md_body(replicas=1, model=model, adapters=[hf]))
        await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
        await add_pod(k8s, clock, "demo-engine-a")
        beats.pods = ["demo-engine-a"]
        beats.start()
        await eventually(lambda: adapter_status(k8s, "sql")["state"] == "Fetching", timeout=15)
        assert engines.calls == {}
        (job,) = [
            j
            for j in k8s.list_objects(JOBS, "ns")
            if render.LABEL_ADAPTER_DIR in j["metadata"]["labels"]
        ]
        await k8s.patch_status(JOBS, "ns", job["metadata"]["name"], {"succeeded": 1})
        await eventually(lambda: adapter_status(k8s, "sql")["state"] == "Loaded", timeout=15)
        assert engines.count("load_lora_adapter", "sql") == {"demo-engine-a": 1}
        path = engines.paths[("demo-engine-a", "sql")]
        assert path.startswith("/models/kvmesh-adapters/") and path.endswith(
            job["metadata"]["labels"][render.LABEL_ADAPTER_DIR]
        )
    finally:
        await beats.close()


def test_status_counts_an_adapter_ready_only_on_every_ready_replica():
    from kvmesh.operator.adapter_sync import status_patch

    seen = {
        "a": {"p1": ("loaded", ""), "p2": ("loaded", "")},
        "b": {"p1": ("loaded", ""), "p2": ("loading", "")},
        "c": {"p1": ("failed", "HTTP 400: bad rank"), "p2": ("loaded", "")},
        "d": {"p1": ("fetching", ""), "p2": ("fetching", "")},
    }
    patch = status_patch(["a", "b", "c", "d"], seen, 2)
    assert patch["adaptersReady"] == "1/4"
    assert [(a["name"], a["state"], a["loadedReplicas"]) for a in patch["adapters"]] == [
        ("a", "Loaded", 2),
        ("b", "Loading", 1),
        ("c", "Failed", 1),
        ("d", "Fetching", 0),
    ]
    assert patch["adapters"][2]["replicas"][0] == {
        "pod": "p1",
        "state": "failed",
        "reason": "HTTP 400: bad rank",
    }
    # No ready replica: nothing is loaded anywhere yet.
    assert status_patch(["a"], {"a": {}}, 0)["adapters"][0]["state"] == "Loading"


def test_an_engines_error_answer_is_the_reason():
    from kvmesh.operator.adapter_sync import _reason

    assert _reason(400, {"error": {"message": "rank 64 > 16"}}, "") == "HTTP 400: rank 64 > 16"
    assert _reason(400, {"message": "no such path", "type": "x"}, "") == "HTTP 400: no such path"
    assert _reason(500, None, "Internal Server Error\n") == "HTTP 500: Internal Server Error"


async def test_a_heartbeat_url_that_is_not_the_pods_ip_gets_no_call(
    k8s, lora_operator, clock, engines, beats
):
    """Redis is writable by more parties than the API: a heartbeat naming another address than
    the pod's IP (from the API) never receives a load, nor the engine API key."""
    await k8s.put_object(MD, md_body(replicas=2, lora={"maxLoras": 2}, adapters=[adapter("sql")]))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    await add_pod(k8s, clock, "demo-engine-a")
    await add_pod(k8s, clock, "demo-engine-b", ip="10.9.8.7")  # its heartbeat says 127.0.0.1
    beats.pods = ["demo-engine-a", "demo-engine-b"]
    beats.start()
    await eventually(lambda: adapter_status(k8s, "sql").get("loadedReplicas") == 1, timeout=15)
    await after_ticks(k8s, n=5, plural="modeldeployments", name="demo")
    assert engines.count("load_lora_adapter", "sql") == {"demo-engine-a": 1}
    assert [r["pod"] for r in adapter_status(k8s, "sql")["replicas"]] == ["demo-engine-a"]
