"""A real `kvmesh serve` keeps answering /health, /ready and /metrics within milliseconds while
four ~4 MB requests arrive at once (a text completion, a chat, a token-id list, a /tokenize):
their JSON, validation, chat template, tokenisation and answer run off the event loop
(engine/server/off_loop.py), the tokenizer without the GIL. The prompts are far over the context
and are refused; the work before the refusal is what used to stall the loop for seconds and get
the pod's heartbeat withdrawn."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.engine.server.conftest import free_port, wait_for
from tests.loop_probe import big_bodies, check_latencies, probe_during


def test_probes_stay_fast_under_four_4mb_requests(tiny_model):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "kvmesh.cli",
            "serve",
            "--model",
            tiny_model,
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-kv-blocks",
            "64",
            "--log-level",
            "warning",
            "--attention-backend",
            "torch",
        ],  # the frontend is under test: no wait for a kernel build
        env={**os.environ, "KVMESH_CPU_KERNELS": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def ready() -> bool:
            assert proc.poll() is None, "kvmesh serve exited"
            try:
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=300, interval=0.2)
        latencies, failures, answers = probe_during(
            url, ("/health", "/ready", "/metrics"), big_bodies()
        )
        # the work was done: the generations refused over the context, the tokenization answered
        assert sorted(a[1] for a in answers) == [200, 400, 400, 400], answers
        assert all(
            "maximum context length" in text for _, status, text in answers if status == 400
        ), answers
        assert not failures, failures
        check_latencies(latencies)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
