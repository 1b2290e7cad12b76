"""vLLM's readiness semantics: nothing under /v1 answers 200 before the model is loaded.

A client that polls /v1/models and then sends (vLLM's benchmark does) must not get 503s for
its requests: /v1/models answers 503 while the model loads, like every /v1 route; /health is
liveness (200 as long as the process lives), /ready readiness.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from kvmesh.engine import llm_engine
from kvmesh.engine.server import core_client
from tests.engine.server.conftest import ThreadServer, wait_for

KEY = "k"


@pytest.fixture(params=["process", "thread"])
def held_server(request, tiny_model, monkeypatch):
    """A server whose engine load waits until the test releases it: in the process mode, the API
    process's side of it (the core process is up, the frontend's text side is held); in the
    thread mode, the engine itself."""
    gate = threading.Event()
    mode = request.param
    if mode == "process":
        module, name = core_client, "FrontendEngine"
    else:
        module, name = llm_engine, "LLMEngine"
    real = getattr(module, name)

    class Held(real):
        def __init__(self, *args):
            assert gate.wait(120), "the test never released the model load"
            super().__init__(*args)

    monkeypatch.setattr(module, name, Held)
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "64",
            "--api-key",
            KEY,
            "--engine-mode",
            mode,
        ]
    )
    srv.thread.start()
    srv.gate = gate
    yield srv
    gate.set()
    srv.stop()


def test_every_v1_route_is_503_until_the_model_is_loaded(held_server):
    url, auth = held_server.url, {"Authorization": f"Bearer {KEY}"}

    def live() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(live, timeout=30)  # liveness: up while the model loads
    assert not held_server.state.engine.loaded.is_set()
    calls = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [5]}),
    ]
    for method, path, body in calls:
        r = httpx.request(method, url + path, json=body, headers=auth, timeout=10)
        assert r.status_code == 503, (path, r.text)
        assert (
            r.json()["error"]["type"] == "service_unavailable"
            and "loading" in r.json()["error"]["message"]
        )
        assert int(r.headers["retry-after"]) >= 1
        # the key is still checked first: no information for a client without one
        assert httpx.request(method, url + path, json=body, timeout=10).status_code == 401
    ready = httpx.get(url + "/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["status"] == "loading"
    assert httpx.get(url + "/health", timeout=10).status_code == 200

    held_server.gate.set()
    wait_for(lambda: httpx.get(url + "/ready", timeout=10).status_code == 200, timeout=120)
    models = httpx.get(url + "/v1/models", headers=auth, timeout=10)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny"]
    # what a client that waited for /v1/models sends next is served
    r = httpx.post(
        url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("held_server", ["process"], indirect=True)
def test_v1_models_is_503_while_draining(held_server):
    held_server.gate.set()
    url, auth = held_server.url, {"Authorization": f"Bearer {KEY}"}
    wait_for(lambda: held_server.state.ready, timeout=120)
    assert httpx.get(url + "/v1/models", headers=auth, timeout=10).status_code == 200
    held_server.state.begin_drain()
    assert httpx.get(url + "/v1/models", headers=auth, timeout=10).status_code == 503
    assert httpx.get(url + "/health", timeout=10).status_code == 200
