"""The router's drain on SIGTERM (router/server.py): requests in flight finish, idle and stalled
connections do not hold the exit, nothing new is accepted, and the exit comes within the drain
timeout even when a stream outlives it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvmesh.common.ports import free_port
from tests.conftest import ROOT, RouterThread, child_env, wait_until

pytestmark = pytest.mark.timeout(120)

DRAIN_S = 3.0


class RouterProc:
    """`kvmesh router` in its own process, ready; killed on exit if still alive. `patch`: Python
    run at its start-up (a sitecustomize), to make a part of it hang."""

    def __init__(
        self, backend: str, tmp_path, drain_timeout: float = DRAIN_S, patch: str | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "router.log"
        env = child_env()
        if patch is not None:
            site = tmp_path / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(patch)
            # (never an empty entry: that would put the working directory, this repository, on the path)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
        cmd = [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            "smollm2-135m-instruct",
            "--redis-url",
            "none",
            "--static-backends",
            f"e0={backend}",
            "--drain-timeout",
            str(drain_timeout),
            "--log-format",
            "text",
            "--log-level",
            "INFO",
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )
        self.t_term: float | None = None

    def __enter__(self) -> RouterProc:
        try:
            wait_until(
                lambda: httpx.get(self.url + "/ready", timeout=0.5).status_code == 200,
                30,
                msg=f"router ready (log: {self.log})",
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def sigterm(self) -> None:
        self.t_term = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> tuple[int, float, str]:
        """(exit code, seconds from SIGTERM to the exit, the log)."""
        rc = self.proc.wait(timeout=timeout)
        return rc, time.monotonic() - self.t_term, self.log.read_text()


class Stream(threading.Thread):
    """One streamed completion through the router, read to the end (or to the cut)."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.events: list[str] = []
        self.status: int | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = {"model": "m", "prompt": "drain me", "max_tokens": self.max_tokens, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=30) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.first.set()

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


def _idle_keepalive(port: int) -> socket.socket:
    """A connection that served one request and stays open (HTTP/1.1 keep-alive)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(4096)
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 "), head
    length = int(
        next(
            h.split(b":")[1]
            for h in head.split(b"\r\n")
            if h.lower().startswith(b"content-length:")
        )
    )
    while len(body) < length:  # the whole response read: what comes next can only be the close
        body += s.recv(4096)
    assert body == b'{"status": "ok"}', body
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(4096) == b""
    except TimeoutError:
        return False
    except OSError:  # reset: closed as well
        return True


def test_sigterm_drains_requests_in_flight_and_exits_within_the_drain_timeout(
    stub_factory, model_name, tmp_path
):
    # The stub streams up to 400 tokens, 20 ms apart: a 50-token stream ends well inside the
    # drain; a 400-token one (8 s) outlives it and is cut.
    (stub,) = stub_factory(
        model_name, 1, "--response-tokens", "400", "--token-delay", "0.02", events=False
    )
    with RouterProc(stub.url, tmp_path) as router:
        url, port = router.url, router.port
        idle = _idle_keepalive(port)
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)  # connected, never sends
        short, long_ = Stream(url, 50), Stream(url, 400)
        for s in (short, long_):
            s.start()
            assert s.first.wait(10) and s.status == 200, (s.status, s.error)

        router.sigterm()
        # Idle connections are closed at once; the listener too: new connections are refused.
        assert _closed_within(idle, 2.0), "an idle keep-alive connection stayed open after SIGTERM"
        assert _closed_within(silent, 2.0), (
            "a connection that never sent a request stayed open after SIGTERM"
        )
        wait_until(lambda: _refused(port), 2.0, msg="the listener closed")

        short.join(10)
        assert short.done and short.error is None, (short.events[-3:], short.error)
        assert len(short.events) == 50 + 2  # 50 tokens, the final chunk, [DONE]

        rc, exited_after, text = router.wait(DRAIN_S + 10)
        assert rc in (0, -signal.SIGTERM), text[-2000:]  # uvicorn re-raises the signal it handled
        # Plain uvicorn waited up to 30 s for the stream; the drain ends it after DRAIN_S.
        assert DRAIN_S - 0.5 < exited_after < DRAIN_S + 4, (exited_after, text[-2000:])
        long_.join(10)
        # Cut at the drain timeout, and told so: an error event, then [DONE].
        assert long_.done and long_.error is None, (long_.events[-3:], long_.error)
        assert len(long_.events) < 400, "the 8 s stream cannot have finished within a 3 s drain"
        err = json.loads(long_.events[-2])["error"]
        assert err["code"] == "router_shutdown" and "shutting down" in err["message"], err
        assert (
            "drain timeout" in text
            and "1 requests still in flight are cut: /v1/completions for" in text
        ), text
        assert "Traceback" not in text, text


def test_requests_cut_before_their_engine_answered_get_a_503(stub_factory, model_name, tmp_path):
    # The stub waits 5 s before each token: at the 3 s drain timeout a non-streamed request has no
    # status line from its engine yet, and a stream has its status line but no first event. Both
    # are answered, not dropped: a 503 the client may retry, and the engine's work is cancelled.
    (stub,) = stub_factory(model_name, 1, "--token-delay", "5", events=False)
    with RouterProc(stub.url, tmp_path) as router:
        got: dict = {}

        def call(kind: str) -> None:
            body = {"model": "m", "prompt": "slow", "max_tokens": 2, "stream": kind == "stream"}
            try:
                got[kind] = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
            except httpx.HTTPError as exc:
                got[kind] = exc

        threads = [
            threading.Thread(target=call, args=(k,), daemon=True) for k in ("plain", "stream")
        ]
        for t in threads:
            t.start()
        wait_until(lambda: stub.stats()["running"] == 2, 10, msg="both requests at the engine")
        router.sigterm()
        rc, exited_after, text = router.wait(DRAIN_S + 10)
        for t in threads:
            t.join(10)
        assert rc in (0, -signal.SIGTERM), text[-2000:]
        assert DRAIN_S - 0.5 < exited_after < DRAIN_S + 4, (exited_after, text[-2000:])
        for kind in ("plain", "stream"):
            r = got[kind]
            assert isinstance(r, httpx.Response), f"{kind}: no answer: {r!r}"
            assert r.status_code == 503 and r.headers["retry-after"] == "1", (
                kind,
                r.status_code,
                r.text,
            )
            assert r.json()["error"]["code"] == "router_shutdown", (kind, r.text)
            assert r.headers.get("connection") == "close", kind
        wait_until(lambda: stub.stats()["cancelled"] == 2, 5, msg="the engine's work cancelled")
        assert "Traceback" not in text, text


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return True
    return False


def test_an_idle_router_exits_at_once_on_sigterm(stub_factory, model_name, tmp_path):
    (stub,) = stub_factory(model_name, 1, events=False)
    with RouterProc(stub.url, tmp_path) as router:
        conns = [
            _idle_keepalive(router.port),
            socket.create_connection(("127.0.0.1", router.port), timeout=5),
        ]
        router.sigterm()
        rc, exited_after, text = router.wait(DRAIN_S + 10)
        assert rc in (0, -signal.SIGTERM)
        assert exited_after < 1.5, "open connections without a request held the exit"
        assert "drained: every request finished" in text
        for c in conns:
            c.close()


def test_while_draining_responses_close_their_connection_and_ready_fails(stub_factory, model_name):
    from kvmesh.router.app import RouterConfig

    (stub,) = stub_factory(model_name, 1, events=False)
    rt = RouterThread(
        RouterConfig(
            model=model_name,
            tokenizer="smollm2-135m-instruct",
            redis_url=None,
            static_backends=[f"e0={stub.url}"],
        )
    )
    try:
        with httpx.Client(base_url=rt.url, timeout=10) as c:
            body = {"model": model_name, "prompt": "hi", "max_tokens": 2}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.headers.get("connection") != "close"
            assert c.get("/ready").status_code == 200
            rt.router.drain.draining = True
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.headers.get("connection") == "close"
            assert json.loads(r.text)["choices"][0]["text"]
            ready = c.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"].startswith("draining")
            assert ready.headers.get("connection") == "close"
    finally:
        rt.stop()


def test_after_the_cut_no_engine_is_tried(stub_factory, model_name):
    # A request that reaches the proxy once the drain has timed out (between two tries, or
    # routed just then) is refused with the cut's 503; no engine receives it.
    from kvmesh.router.app import RouterConfig

    (stub,) = stub_factory(model_name, 1, events=False)
    rt = RouterThread(
        RouterConfig(
            model=model_name,
            tokenizer="smollm2-135m-instruct",
            redis_url=None,
            static_backends=[f"e0={stub.url}"],
        )
    )
    try:
        rt.router.drain.cutting = True
        r = httpx.post(
            rt.url + "/v1/completions",
            json={"model": model_name, "prompt": "hi", "max_tokens": 2},
            timeout=10,
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "router_shutdown", r.text
        assert stub.stats()["completed"] == 0 and stub.stats()["running"] == 0
    finally:
        rt.stop()


def test_a_request_held_for_an_engine_gets_503_when_the_drain_times_out(tmp_path, model_name):
    from kvmesh.router.app import RouterConfig

    backends = tmp_path / "backends"
    backends.write_text("")  # zero engines: requests are held (scale from zero)
    rt = RouterThread(
        RouterConfig(
            model=model_name,
            tokenizer="smollm2-135m-instruct",
            redis_url=None,
            backends_file=str(backends),
            scale_from_zero_timeout=60,
        ),
        drain_timeout=1.0,
    )
    got: dict = {}

    def client():
        got["resp"] = httpx.post(
            rt.url + "/v1/completions", json={"prompt": "anyone?", "max_tokens": 2}, timeout=30
        )

    t = threading.Thread(target=client, daemon=True)
    t.start()
    try:
        wait_until(lambda: rt.router.metrics.held._value.get() == 1, 10, msg="the request held")
        t_stop = time.monotonic()
        rt.stop()
        t.join(10)
        resp = got["resp"]
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1", resp.text
        assert resp.json()["error"]["code"] == "router_shutdown", resp.text
        assert resp.headers.get("connection") == "close"
        assert time.monotonic() - t_stop < 5.0  # the 1 s drain, not the 60 s hold
        assert rt.router.metrics.held_outcomes.labels("shutdown")._value.get() == 1
    finally:
        rt.stop()


HANG_DISCOVERY_STOP = """
import asyncio
import kvmesh.router.discovery as d
async def _never(self):
    await asyncio.sleep(3600)
d.Discovery.stop = _never
"""

HANG_SHUTDOWN = """
import time
import kvmesh.router.app as a
async def _stuck(self):
    time.sleep(3600)  # blocks the event loop itself: only the watchdog can end this
a.Router.shutdown = _stuck
"""


def test_a_clean_up_step_that_hangs_is_left_behind(stub_factory, model_name, tmp_path):
    (stub,) = stub_factory(model_name, 1, events=False)
    with RouterProc(stub.url, tmp_path, drain_timeout=1, patch=HANG_DISCOVERY_STOP) as router:
        router.sigterm()
        rc, exited_after, text = router.wait(15)
        assert rc in (0, -signal.SIGTERM), text
        assert exited_after < 6, text  # the 2 s bound, not the hour
        assert "closing the discovery took over 2s; left behind" in text, text


# The watchdog's delay in the test's router: the shutdown hangs at once, so nothing bounded needs
# the real delay's room (checked against the bounded steps below)
WATCHDOG_TEST_S = 2.0


def test_the_watchdog_waits_past_every_bounded_shutdown_step():
    from kvmesh.router.server import CUT_GRACE_S, WATCHDOG_AFTER_S

    # the cut, uvicorn's wait (2 s), the lifespan shutdown (3 steps of at most 2 s), with room
    assert WATCHDOG_AFTER_S >= 1.5 * (CUT_GRACE_S + 2 + 3 * 2)


def test_a_router_stuck_in_its_shutdown_dumps_its_stacks_and_exits(
    stub_factory, model_name, tmp_path
):
    (stub,) = stub_factory(model_name, 1, events=False)
    patch = HANG_SHUTDOWN + (
        f"import kvmesh.router.server as server\nserver.WATCHDOG_AFTER_S = {WATCHDOG_TEST_S}\n"
    )
    with RouterProc(stub.url, tmp_path, drain_timeout=1, patch=patch) as router:
        router.sigterm()
        rc, exited_after, text = router.wait(1 + WATCHDOG_TEST_S + 15)
        assert rc == 1, (rc, text[-3000:])
        assert exited_after >= 1 + WATCHDOG_TEST_S - 1
        assert "Timeout (0:00:" in text and "in _stuck" in text, text[-3000:]  # faulthandler's dump
