import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from kvmesh.common.parent_death import env_for_children, wrap
from tests.conftest import ROOT, child_env, free_port, wait_until


def _engine_importable() -> bool:
    try:
        import kvmesh.engine.server  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


class UpProcess:
    def __init__(self, tmp_path, *extra: str):
        self.port = free_port()
        self.state = tmp_path / "up.json"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            # the mesh, and through it its engines, end with this test run even if it is killed
            wrap(
                [
                    sys.executable,
                    "-m",
                    "kvmesh.cli",
                    "up",
                    "--port",
                    str(self.port),
                    "--state-file",
                    str(self.state),
                    *extra,
                ]
            ),
            cwd=ROOT,
            env=env_for_children(child_env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout: float):
        wait_until(
            lambda: (
                any("kvmesh is up" in line for line in self.lines) or self.proc.poll() is not None
            ),
            timeout,
            msg="kvmesh up",
        )
        assert self.proc.poll() is None, "\n".join(self.lines[-50:])

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def test_up_with_stub_engines_serves_reports_status_and_shuts_down(tmp_path):
    up = UpProcess(tmp_path, "--replicas", "2", "--engine-command", "stub")
    try:
        up.wait_up(60)
        # OpenAI client against the router
        from openai import OpenAI

        client = OpenAI(base_url=up.url + "/v1", api_key="unused")
        msgs = [
            {"role": "system", "content": "You are a helpful assistant. " * 10},
            {"role": "user", "content": "Hi"},
        ]
        first = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs)
        assert first.choices[0].message.content
        wait_until(
            lambda: (
                json.loads(_status(up, "--json"))["replicas"][0]["blocks_indexed"]
                + json.loads(_status(up, "--json"))["replicas"][1]["blocks_indexed"]
                > 0
            ),
            10,
            msg="indexed",
        )
        second = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs)
        assert (
            second.usage.prompt_tokens_details.cached_tokens > 0
        )  # routed to the replica holding the prefix
        table = _status(up)
        assert "replica-0" in table and "replica-1" in table and "HIT RATE" in table
        rows = wait_until(
            lambda: [
                r
                for r in [json.loads(_status(up, "--json"))["replicas"]]
                if any((x["prefix_hit_rate"] or 0) > 0 for x in r)
            ],
            5,
            msg="hit rate",
        )[0]
        assert {r["state"] for r in rows} == {"ready"}
        prefixes = {line.split("]")[0] + "]" for line in up.lines if line.startswith("[")}
        assert {"[up]", "[router]", "[engine-0]", "[sidecar-1]"} <= prefixes
    finally:
        rc = up.stop()
    assert rc == 0, "\n".join(up.lines[-40:])
    assert any("[up] stopped" in line for line in up.lines)
    assert not up.state.exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(up.url + "/health", timeout=1)


def test_up_restarts_a_crashed_engine(tmp_path):
    up = UpProcess(tmp_path, "--replicas", "1", "--engine-command", "stub")
    try:
        up.wait_up(60)
        pid = httpx.get(_engine_url(up, 0) + "/stub/stats", timeout=2).json()["pid"]
        import os

        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: any("engine-0 exited" in line for line in up.lines), 10)
        wait_until(
            lambda: (
                httpx.post(
                    up.url + "/v1/completions", json={"prompt": "hello"}, timeout=5
                ).status_code
                == 200
            ),
            30,
            msg="served again after restart",
        )
    finally:
        assert up.stop() == 0


def _engine_url(up, i):
    rows = json.loads(_status(up, "--json"))["replicas"]
    return next(r["url"] for r in rows if r["pod"] == f"replica-{i}")


def _status(up, *extra) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "status", "--state-file", str(up.state), *extra],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not _engine_importable(), reason="the engine server (kvmesh.engine.server) is not available yet"
)
def test_up_with_the_real_engine(tmp_path):
    """The real thing: two `kvmesh serve` replicas of the built-in model behind the router (each
    with a 256 MiB KV cache, ~360 blocks, not the 4 GiB default: the test needs a few blocks,
    and two suites on one machine must both fit)."""
    up = UpProcess(tmp_path, "--replicas", "2", "--engine-args", "--kv-cache-memory 256MiB")
    try:
        up.wait_up(600)
        from openai import OpenAI

        client = OpenAI(base_url=up.url + "/v1", api_key="unused")
        msgs = [
            {
                "role": "system",
                "content": "You are a concise assistant who answers in one sentence. " * 6,
            },
            {"role": "user", "content": "What is a KV cache?"},
        ]
        first = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=msgs, max_tokens=8
        )
        assert first.choices[0].message.content is not None
        wait_until(
            lambda: (
                sum(r["blocks_indexed"] for r in json.loads(_status(up, "--json"))["replicas"]) > 0
            ),
            20,
        )
        second = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=msgs, max_tokens=8
        )
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        chunks = list(
            client.completions.create(
                model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=8, stream=True
            )
        )
        assert chunks
        # The router's figures are values only a real prefix hit produces (the metrics themselves are
        # registered at start-up): the engine's reported cached tokens, summed, and the router's
        # prediction of them from the sidecars' block sets (a router that landed on the pod by its
        # tie-break alone, with nothing indexed, would predict 0).
        from kvmesh.common.engine_load import parse_prometheus

        totals: dict[str, float] = {}
        for name, labels, value in parse_prometheus(httpx.get(up.url + "/metrics", timeout=5).text):
            key = name + (f"{{reason={labels['reason']}}}" if "reason" in labels else "")
            totals[key] = totals.get(key, 0.0) + value
        cached = (
            first.usage.prompt_tokens_details.cached_tokens
            + second.usage.prompt_tokens_details.cached_tokens
        )
        assert cached > 0
        assert totals["kvmesh_router_engine_cached_tokens_total"] == cached
        assert totals["kvmesh_router_predicted_cached_tokens_total"] == cached
        assert totals.get("kvmesh_router_decisions_total{reason=prefix_match}", 0) >= 1
    finally:
        assert up.stop() == 0


def test_up_autoscale_adds_a_replica_under_kv_pressure(tmp_path):
    up = UpProcess(
        tmp_path,
        "--replicas",
        "1",
        "--engine-command",
        "stub",
        "--engine-args",
        "--num-blocks 8",
        "--autoscale",
        "--min-replicas",
        "1",
        "--max-replicas",
        "2",
        "--target-kv-usage",
        "0.5",
        "--scale-interval",
        "0.5",
        "--scale-up-window",
        "0.5",
    )
    try:
        up.wait_up(60)
        assert (
            httpx.post(
                up.url + "/v1/completions", json={"prompt": "word " * 200}, timeout=10
            ).status_code
            == 200
        )
        wait_until(lambda: any("adding a replica" in line for line in up.lines), 20, msg="scale up")
        wait_until(
            lambda: len(json.loads(_status(up, "--json"))["replicas"]) == 2,
            30,
            msg="second replica",
        )
    finally:
        assert up.stop() == 0
