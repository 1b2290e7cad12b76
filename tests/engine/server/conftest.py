"""Shared fixtures: a tiny model, and a real server on loopback in a background thread."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import httpx
import pytest

from kvmesh.common.ports import free_port
from tests.tiny_models import build_tiny_model


class ThreadServer:
    """`kvmesh serve` in a thread of the test process (same code path, minus signal handling)."""

    def __init__(self, argv: list[str], core_loop: type | None = None):
        """In fp32 unless ``argv`` holds --dtype. ``core_loop``: a CoreLoop subclass for the engine
        core, e.g. kvmesh_testing.core_hooks's HookedCoreLoop for a test that calls hooks in the
        core."""
        from kvmesh.engine.server import cli
        from kvmesh.engine.server.api import build_app

        self.port = free_port()
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        # fp32 unless a test asks otherwise: the tests compare outputs with transformers' fp32 run
        # and across batchings (dtype auto is bf16 on a CPU with avx512_bf16)
        dtype = [] if "--dtype" in argv else ["--dtype", "float32"]
        self.args = parser.parse_args(
            list(argv) + dtype + ["--host", "127.0.0.1", "--port", str(self.port)]
        )
        self.state = cli.build_state(self.args)
        if core_loop is not None:  # before the engine starts (the app's startup)
            self.state.engine.core_loop = core_loop
        self.app = build_app(self.state)
        self.server = cli._make_server(self.app, "127.0.0.1", self.port, "warning")
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def start(self, timeout: float = 180.0) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.engine.load_error is not None:
                raise RuntimeError(f"engine failed to load: {self.state.engine.load_error}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        if self.state.engine.kv_publisher is not None:
            self.state.engine.kv_publisher.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "tiny-llama-plain"))


@pytest.fixture(scope="module")
def hermes_tool_server(tiny_model):
    """`kvmesh serve` of the tiny model as "tiny", with auto tool choice in the Hermes format."""
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "256",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
    ).start()
    yield srv
    srv.stop()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
