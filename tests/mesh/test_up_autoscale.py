"""`kvmesh up --autoscale` with stub engines: the operator's decide() over local processes,
scale to zero when idle, and back to a replica on a router's demand (contract 3's demand key)."""

import json
import time
from pathlib import Path

import httpx
import pytest
import redis

from kvmesh.common.redis_layout import demand_key
from tests.conftest import ROOT, wait_until
from tests.mesh.test_up import UpProcess, _status

MODEL = "smollm2-135m-instruct"
FAST = [
    "--engine-command",
    "stub",
    "--autoscale",
    "--scale-interval",
    "0.3",
    "--scale-up-window",
    "0",
    "--scale-down-window",
    "1",
]


def _router_holds_requests() -> bool:
    """The router's side of scale from zero (hold queue + demand key) is built separately."""
    return any(
        "demand_key" in p.read_text()
        for p in (ROOT / "router").glob("*.py")
        if p.name != "up_cli.py"
    )


def _replicas(up) -> int:
    return len(json.loads(up.state.read_text())["replicas"])


def _log_count(up, text) -> int:
    return sum(text in line for line in list(up.lines))


def test_up_scales_to_zero_when_idle_and_back_on_demand(tmp_path):
    up = UpProcess(
        tmp_path,
        "--replicas",
        "1",
        *FAST,
        "--min-replicas",
        "0",
        "--max-replicas",
        "2",
        "--scale-to-zero-idle",
        "2",
    )
    try:
        up.wait_up(60)
        assert (
            httpx.post(up.url + "/v1/completions", json={"prompt": "hello"}, timeout=10).status_code
            == 200
        )
        # Idle (nothing running, waiting or held) for 2 s: the last replica stops.
        wait_until(lambda: _log_count(up, "scaling to zero") == 1, 30, msg="scale to zero")
        wait_until(lambda: _replicas(up) == 0, 10, msg="state file at 0 replicas")
        wait_until(
            lambda: json.loads(_status(up, "--json"))["replicas"] == [],
            15,
            msg="no replica in Redis",
        )
        assert _log_count(up, "starting a replica") == 0  # nobody asked

        # A router holding a request sets the demand key: one replica starts at once.
        redis_url = json.loads(up.state.read_text())["redis_url"]
        r = redis.Redis.from_url(redis_url)
        r.set(demand_key(MODEL), time.time(), ex=60)
        wait_until(
            lambda: (
                _log_count(up, "a request is waiting at zero replicas: starting a replica") == 1
            ),
            15,
            msg="scale from zero",
        )
        wait_until(
            lambda: httpx.get(up.url + "/ready", timeout=2).json()["pods"] == 1,
            60,
            msg="replica ready",
        )
        assert (
            httpx.post(up.url + "/v1/completions", json={"prompt": "hello"}, timeout=10).status_code
            == 200
        )
        assert _replicas(up) == 1
        r.delete(demand_key(MODEL))
    finally:
        assert up.stop() == 0, "\n".join(up.lines[-40:])


def test_up_can_start_at_zero_replicas(tmp_path):
    up = UpProcess(tmp_path, "--replicas", "0", *FAST, "--min-replicas", "0", "--max-replicas", "1")
    try:
        up.wait_up(60)
        assert any(
            "0 replicas of" in line and "the first request starts one" in line for line in up.lines
        )
        assert _replicas(up) == 0
        assert httpx.get(up.url + "/ready", timeout=2).json()["pods"] == 0
    finally:
        assert up.stop() == 0, "\n".join(up.lines[-40:])


@pytest.mark.skipif(
    not _router_holds_requests(), reason="the router's hold queue / demand key is not merged yet"
)
def test_up_first_request_at_zero_is_held_then_served(tmp_path):
    """The whole path: 0 replicas, a request arrives, the router holds it and signals demand,
    `up` starts an engine, the held request is served once the engine is ready."""
    up = UpProcess(tmp_path, "--replicas", "0", *FAST, "--min-replicas", "0", "--max-replicas", "1")
    try:
        up.wait_up(60)
        t0 = time.time()
        resp = httpx.post(
            up.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=120
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] is not None
        assert _log_count(up, "starting a replica") == 1 and _replicas(up) == 1
        assert time.time() - t0 < 120
    finally:
        assert up.stop() == 0, "\n".join(up.lines[-40:])


def test_up_rejects_bad_autoscale_bounds(tmp_path):
    import subprocess
    import sys

    from tests.conftest import child_env

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "up",
            "--engine-command",
            "stub",
            "--autoscale",
            "--replicas",
            "3",
            "--min-replicas",
            "0",
            "--max-replicas",
            "2",
            "--state-file",
            str(tmp_path / "up.json"),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "--replicas must be within" in (out.stdout + out.stderr)
    assert not Path(tmp_path / "up.json").exists()


def test_up_counts_requests_waiting_at_the_router_as_waiting(redis_server, model_name):
    """Flow control's queue at the router is demand for `kvmesh up --autoscale` too, as the
    engines' waiting requests are (the same signal the operator reads)."""
    from types import SimpleNamespace

    from kvmesh.common import redis_layout as rl
    from kvmesh.mesh.up import Mesh

    mesh = Mesh.__new__(Mesh)  # only what observe() reads
    mesh.redis_url, mesh.served = redis_server.url, model_name
    mesh.replicas = [SimpleNamespace(pod="replica-0", started=time.time())]
    r = redis_server.client()
    beat = rl.Heartbeat(pod="replica-0", url="http://x", model=model_name, running=2, waiting=1)
    r.hset(rl.heartbeat_key(model_name, "replica-0"), mapping=beat.to_mapping())
    r.hset(rl.flow_queued_key(model_name), "router-1", rl.queued_entry(7, time.time()))
    obs, _ = mesh.observe(time.time())
    assert (obs.waiting, obs.running) == (1 + 7, 2)
