"""Adapter traffic end to end: stub engines serving a LoRA adapter, their sidecars, a real Redis and
the router. An adapter's prompt comes back to the replica that served it with a prefix hit (the
router's prediction equal to the engine's report, labelled by adapter); base traffic with the same
text shares none of the adapter's blocks; /v1/models through the router lists the adapter."""

from __future__ import annotations

import httpx

from kvmesh.common.lora import MODEL_CARD_DIGEST
from kvmesh.mesh.stub_lora import stub_digest
from tests.conftest import wait_until
from tests.router.test_router import blocks_in_redis, metric, router_sees, text, wait_blocks_settled


def complete(base: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(
        base + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 4},
        timeout=20,
    )


def cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_adapter_traffic_hits_its_replica_and_base_traffic_is_unaffected(
    mesh, router_factory, redis_server, model_name, tmp_path
):
    path = str(tmp_path / "sql")
    stubs, _ = mesh(2, "--lora-modules", f"sql={path}", "--max-loras", "2")
    digest = stub_digest("sql", path)
    card = httpx.get(stubs[0].url + "/v1/models", timeout=5).json()["data"][1]
    assert (card["id"], card["parent"], card[MODEL_CARD_DIGEST]) == ("sql", model_name, digest)
    router = router_factory(model=model_name, redis_url=redis_server.url)
    for pod in ("pod-0", "pod-1"):
        wait_until(
            lambda pod=pod: router_sees(router, pod, adapters={"sql": digest}, max_loras=2),
            10,
            msg=f"{pod}'s adapters",
        )
    models = httpx.get(router.url + "/v1/models", timeout=5).json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [(model_name, None), ("sql", model_name)]

    r = redis_server.client()
    prompt = text(3, 200)
    first = complete(router.url, "sql", prompt)
    assert cached(first) == 0 and first.json()["model"] == "sql"
    pod = first.headers["x-kvmesh-pod"]
    wait_blocks_settled(r, model_name, pod)
    again = complete(router.url, "sql", prompt + " and the next turn of it")
    assert again.headers["x-kvmesh-pod"] == pod
    hit = cached(again)
    assert hit >= 10 * 16
    assert metric(router.url, "kvmesh_router_predicted_cached_tokens_total", adapter="sql") == hit
    assert metric(router.url, "kvmesh_router_engine_cached_tokens_total", adapter="sql") == hit

    # The same text on the base model: none of the adapter's blocks, on either replica.
    held = blocks_in_redis(r, model_name, pod)
    base = complete(router.url, model_name, prompt)
    assert cached(base) == 0
    assert metric(router.url, "kvmesh_router_predicted_cached_tokens_total", adapter="") == 0
    base_pod = base.headers["x-kvmesh-pod"]
    wait_until(lambda: blocks_in_redis(r, model_name, base_pod) > 0, 5, msg="base blocks")
    if base_pod == pod:
        wait_until(lambda: blocks_in_redis(r, model_name, pod) > held, 5, msg="base blocks")
    wait_blocks_settled(r, model_name, base_pod)
    base_again = complete(router.url, model_name, prompt + " continued")
    assert base_again.headers["x-kvmesh-pod"] == base_pod and cached(base_again) >= 10 * 16

    # An adapter no replica serves: the engine's 404, counted under "other".
    missing = complete(router.url, "nobody", prompt)
    assert missing.status_code == 404, missing.text
