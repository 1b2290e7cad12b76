"""`kvmesh serve --async-scheduling`: the server (core process and in-thread modes) answers exactly
as without it, and a stop string or a client leaving mid-stream frees the request's blocks."""

from __future__ import annotations

import httpx
import pytest

from kvmesh_testing.core_hooks import HookedCoreLoop
from tests.engine.server.conftest import ThreadServer, wait_for
from tests.engine.server.test_core_process import (
    HOOKS,
    MODEL,
    REQUESTS,
    _strip,
    assert_same_answers,
)


def _server(tiny_model: str, mode: str, flag: str) -> ThreadServer:
    return ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            "128",
            "--max-num-seqs",
            "8",
            "--engine-mode",
            mode,
            flag,
        ],
        core_loop=HookedCoreLoop,
    ).start()


@pytest.fixture(scope="module")
def sync_server(tiny_model):
    srv = _server(tiny_model, "process", "--no-async-scheduling")
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["process", "thread"])
def async_server(tiny_model, request):
    srv = _server(tiny_model, request.param, "--async-scheduling")
    yield srv
    srv.stop()


def _kv_state(srv):
    return srv.state.engine.call_utility("hook", f"{HOOKS}:kv_state")


def test_async_server_answers_as_the_sync_one(async_server, sync_server):
    assert_same_answers(
        async_server.url,
        sync_server.url,
        REQUESTS
        + [
            {
                "prompt": "Once upon",
                "max_tokens": 10,
                "temperature": 0,
                "min_tokens": 4,
                "frequency_penalty": 0.5,
            }
        ],
    )
    text = httpx.post(async_server.url + "/v1/completions", json=REQUESTS[0], timeout=60).json()[
        "choices"
    ][0]["text"]
    stop = text.strip()[:3]
    body = {**REQUESTS[0], "stop": [stop]}
    a = httpx.post(async_server.url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(sync_server.url + "/v1/completions", json=body, timeout=60).json()
    assert a["choices"][0]["finish_reason"] == "stop" and _strip(a) == _strip(b)
    wait_for(lambda: _kv_state(async_server)["num_running"] == 0)
    state = async_server.state.engine.call_utility("hook", f"{HOOKS}:async_state")
    assert state["async_scheduling"] and state["num_async_steps"] > 0
    assert state["num_sync_steps"] > 0  # the penalty request's steps
    sync_state = sync_server.state.engine.call_utility("hook", f"{HOOKS}:async_state")
    assert not sync_state["async_scheduling"] and sync_state["num_async_steps"] == 0


def test_a_client_leaving_mid_stream_frees_its_blocks(async_server):
    body = {
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", async_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # the client leaves while the request runs
    wait_for(
        lambda: (
            (s := _kv_state(async_server))["num_running"] == 0
            and s["num_free_blocks"] == s["num_blocks"]
        ),
        timeout=30,
    )
    # the engine carries on serving
    r = httpx.post(
        async_server.url + "/v1/completions",
        json={**body, "stream": False, "max_tokens": 5},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
