"""The engine core in its own process: the messages, the two modes agreeing, and a dead core.

- The msgspec messages between the API process and the core round-trip every field.
- The in-thread mode (``--engine-mode thread``) still serves, and answers exactly as the process mode.
- Killing the core process ends every in-flight stream with an error at once, /health and /ready
  turn 503, new requests are refused; a real ``kvmesh serve`` exits non-zero (the pod restarts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvmesh.engine.core_proc import AddRequest, Failure, StepOutputs, UtilityCall, failure_exception
from kvmesh.engine.engine_core import EngineCoreOutput, EngineStats
from kvmesh.engine.sampler import TokenLogprobs
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams
from kvmesh.engine.server.async_engine import EngineStepError
from kvmesh.engine.step_timing import PHASES, overhead_per_step
from kvmesh.engine.threads import core_environment, plan_threads
from kvmesh_testing.core_hooks import HookedCoreLoop
from tests.engine.server.conftest import ThreadServer, free_port, wait_for
from tests.engine.server.test_api import metrics

MODEL = "tiny"
HOOKS = "kvmesh_testing.core_hooks"


# -- messages, no server ------------------------------------------------------------------------------
def test_messages_round_trip():
    enc = msgspec.msgpack.Encoder()
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={3: -100.0, 9: 2.5},
        seed=2**64 - 1,
        min_tokens=2,
        stop=["\n", "end"],
        stop_token_ids=[4, 5],
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    add = AddRequest("r-1", [1, 2, 3], params, "salt", 12.5)
    back = msgspec.msgpack.decode(enc.encode(add), type=AddRequest)
    assert back == add and back.params == params and back.params.logit_bias == {3: -100.0, 9: 2.5}

    lp = TokenLogprobs(11, -0.25, 1, [(11, -0.25), (12, -1.5)])
    out = EngineCoreOutput(
        "r-1",
        [11],
        [lp],
        finish_reason="stop",
        stop_reason=4,
        num_cached_tokens=16,
        num_prompt_tokens=3,
        prompt_logprobs=[None, lp, lp],
    )
    stats = EngineStats(0.5, 1, 2, 64, 32, 100, 50, 3, 1000, 2000, 77, {"request": 1, "batch": 0})
    msg = StepOutputs(
        [out, EngineCoreOutput("r-2", [], finish_reason="error", error="boom")],
        [Failure("r-3", "top_k must be ...", "top_k"), Failure("r-4", "engine step failed")],
        stats,
        {"forward": 0.5, "steps": 3.0},
        [["BlockStored", [2**64 - 1], None, [1, 2], 16, None, None]],
    )
    got = msgspec.msgpack.decode(enc.encode(msg), type=StepOutputs)
    assert got.outputs[0] == out and got.outputs[0].new_logprobs[0].top == [(11, -0.25), (12, -1.5)]
    assert got.outputs[0].finished and got.outputs[1].error == "boom"
    assert got.stats == stats and got.timing == {"forward": 0.5, "steps": 3.0}
    assert got.kv_events[0][1] == [2**64 - 1]
    # a core-side refusal names its field (a 400); anything else is an engine error
    refused, failed = (failure_exception(f) for f in got.failures)
    assert isinstance(refused, InvalidParameter) and refused.param == "top_k"
    assert isinstance(failed, EngineStepError) and "engine step failed" in str(failed)
    assert msgspec.msgpack.decode(
        enc.encode(UtilityCall(1, "hook", ["m:f", 2])), type=UtilityCall
    ).args == ["m:f", 2]


def test_thread_plan():
    cpus = list(range(8))
    plan = plan_threads(None, "auto", cpus, env={})
    assert (plan.core_threads, plan.core_cpus, plan.frontend_cpus) == (7, list(range(1, 8)), [0])
    small = plan_threads(None, "auto", [0, 1], env={})  # 2 CPUs: shared, not pinned
    assert (small.core_threads, small.core_cpus, small.frontend_cpus) == (2, None, None)
    assert plan_threads(None, "auto", [0, 1], env={"OMP_NUM_THREADS": "1"}).core_threads == 1
    assert (
        plan_threads(3, "0", cpus, env={"OMP_NUM_THREADS": "1"}).core_threads == 3
    )  # the flag wins
    assert plan_threads(None, 2, cpus, env={}).core_cpus == list(range(2, 8))
    limited = plan_threads(
        None, "auto", list(range(16)), env={}, cpu_limit=2.5
    )  # a pod's CPU limit of 2.5
    assert (limited.core_threads, limited.core_cpus) == (2, None)
    assert plan_threads(None, "auto", list(range(16)), env={}, cpu_limit=None).core_threads == 15


def test_core_environment_sets_the_openmp_spin_unless_told_otherwise():
    # sharing its CPUs with the frontend alone: the worker stays awake between steps
    plan = plan_threads(None, "auto", [0, 1], env={})
    env = core_environment(plan, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "1000000"}
    for user_choice in (
        {"OMP_WAIT_POLICY": "ACTIVE"},
        {"GOMP_SPINCOUNT": "10000"},
        {"KMP_BLOCKTIME": "1"},
    ):
        assert core_environment(plan, user_choice) == {**user_choice, "OMP_NUM_THREADS": "2"}
    # where its CPUs may be contended: a CPU quota, the core pinned apart (the rest of the node), no plan
    quota = plan_threads(None, "auto", [0, 1, 2, 3], env={}, cpu_limit=2.0)
    assert core_environment(quota, {})["GOMP_SPINCOUNT"] == "100000"
    pinned = plan_threads(None, "auto", list(range(8)), env={})
    assert core_environment(pinned, {})["GOMP_SPINCOUNT"] == "100000"
    assert core_environment(None, {}) == {"GOMP_SPINCOUNT": "100000"}


def test_cgroup_cpu_limit(tmp_path):
    from kvmesh.engine.threads import cgroup_cpu_limit

    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 2.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None
    assert cgroup_cpu_limit(str(tmp_path / "absent")) is None


def test_thread_plan_errors():
    cpus = list(range(8))
    with pytest.raises(ValueError, match="frontend-cores"):
        plan_threads(None, 2, [0, 1], env={})
    with pytest.raises(ValueError, match="omp-threads"):
        plan_threads(0, "auto", cpus, env={})


def test_overhead_per_step():
    snap = {f"decode_{p}": 0.0 for p in PHASES} | {p: 0.0 for p in PHASES}
    snap.update(
        decode_forward=0.8,
        decode_schedule=0.1,
        decode_output=0.1,
        decode_steps=10.0,
        decode_seqs=640.0,
    )
    o = overhead_per_step(snap)
    assert (
        o["forward"] == pytest.approx(80.0)
        and o["overhead"] == pytest.approx(20.0)
        and o["batch"] == 64
    )
    assert overhead_per_step({"decode_steps": 0.0}) == {}


# -- both modes --------------------------------------------------------------------------------------
def _server(tiny_model: str, mode: str) -> ThreadServer:
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
        ],
        core_loop=HookedCoreLoop,
    ).start()


@pytest.fixture(scope="module")
def thread_server(tiny_model):
    srv = _server(tiny_model, "thread")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proc_server(tiny_model):
    srv = _server(tiny_model, "process")
    yield srv
    srv.stop()


REQUESTS = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "logprobs": 2},
    {
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": 9,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
    },
    {"prompt": "seeded", "max_tokens": 6, "temperature": 1.0, "seed": 42, "n": 2},
]


def _strip(body: dict) -> dict:
    return {"choices": body["choices"], "usage": body["usage"]}


def assert_same_answers(url_a: str, url_b: str, bodies: list[dict]) -> None:
    """Each completion request answered with 200 and the same choices and usage by both servers."""
    for body in bodies:
        a = httpx.post(url_a + "/v1/completions", json=body, timeout=60)
        b = httpx.post(url_b + "/v1/completions", json=body, timeout=60)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert _strip(a.json()) == _strip(b.json()), body


def test_the_thread_mode_serves_and_agrees_with_the_process_mode(thread_server, proc_server):
    assert (
        thread_server.state.engine.mode == "thread" and proc_server.state.engine.mode == "process"
    )
    assert proc_server.state.engine.process.pid != os.getpid()
    # libgomp reads its spin count when torch loads: it must be in the core's environment from the start
    environ = (
        open(f"/proc/{proc_server.state.engine.process.pid}/environ", "rb").read().split(b"\0")
    )
    spin = core_environment(proc_server.state.engine.threads).get(
        "GOMP_SPINCOUNT"
    )  # None: the caller chose a policy
    assert spin is None or f"GOMP_SPINCOUNT={spin}".encode() in environ
    assert_same_answers(thread_server.url, proc_server.url, REQUESTS)
    # a stop string (API side) ends the request in the core too: its blocks are freed
    text = httpx.post(proc_server.url + "/v1/completions", json=REQUESTS[0], timeout=60).json()[
        "choices"
    ][0]["text"]
    stop = text.strip()[:3]
    r = httpx.post(
        proc_server.url + "/v1/completions", json={**REQUESTS[0], "stop": [stop]}, timeout=60
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop" and stop not in r["choices"][0]["text"]
    wait_for(
        lambda: (
            proc_server.state.engine.call_utility("hook", f"{HOOKS}:kv_state")["num_running"] == 0
        )
    )


def test_step_phases_are_on_metrics_in_both_modes(thread_server, proc_server):
    for srv in (thread_server, proc_server):
        httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True},
            timeout=60,
        )
        m = metrics(httpx.Client(base_url=srv.url))
        assert m["kvmesh:engine_decode_steps_total"] >= 7
        for phase in PHASES:
            assert m[f"kvmesh:engine_step_phase_seconds_total{{phase={phase}}}"] > 0, (
                srv.state.engine.mode,
                phase,
            )
        assert (
            m["kvmesh:engine_decode_step_phase_seconds_total{phase=forward}"]
            <= m["kvmesh:engine_step_phase_seconds_total{phase=forward}"]
        )


def test_validation_needs_no_round_trip_to_the_core(proc_server):
    """The API process knows the core's limits (sent once at start-up): a prompt past the context
    and an id outside the vocabulary are 400s naming the field, answered without the core."""
    engine = proc_server.state.engine
    vocab, max_len = engine.vocab_size, engine.max_model_len
    assert vocab > 0 and max_len > 0
    for body, param in (
        ({"prompt": [1] * max_len}, "prompt"),
        ({"prompt": [vocab]}, "prompt"),
        ({"prompt": "x", "top_k": vocab + 1}, "top_k"),
        ({"prompt": "x", "logit_bias": {str(vocab): 1}}, "logit_bias"),
    ):
        r = httpx.post(
            proc_server.url + "/v1/completions", json={"max_tokens": 2, **body}, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _stream_events(
    url: str, body: dict, events: list, first: threading.Event, errors: list
) -> None:
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx.HTTPError as exc:
        errors.append(repr(exc))


def test_a_dead_core_ends_every_stream_and_fails_health(proc_server):
    """Last in the module: it kills proc_server's core."""
    url, engine = proc_server.url, proc_server.state.engine
    body = {"prompt": "never ending", "max_tokens": 2000, "ignore_eos": True}
    runs = [([], threading.Event(), []) for _ in range(3)]
    threads = [threading.Thread(target=_stream_events, args=(url, body, *run)) for run in runs]
    for t in threads:
        t.start()
    for _, first, _ in runs:
        assert first.wait(60)
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    killed = time.monotonic()
    os.kill(engine.process.pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert time.monotonic() - killed < 15, "the streams did not end promptly"
    for events, _, errors in runs:
        assert not errors and events[-1] == "[DONE]", (errors, events[-2:])
        err = json.loads(events[-2])["error"]
        assert "engine core process died" in err["message"]
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and "exited" in health.json()["error"]
    assert httpx.get(url + "/ready", timeout=5).status_code == 503
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
    assert r.status_code == 503
    assert engine.num_in_flight == 0


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_serve_exits_nonzero_when_its_core_dies(tiny_model):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "serve",
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-kv-blocks",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def ready():
            assert proc.poll() is None
            try:
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=180, interval=0.1)
        (core_pid,) = _children(proc.pid)
        events, first, errors = [], threading.Event(), []
        t = threading.Thread(
            target=_stream_events,
            args=(
                url,
                {"prompt": "x", "max_tokens": 1000, "ignore_eos": True},
                events,
                first,
                errors,
            ),
        )
        t.start()
        assert first.wait(60), errors
        os.kill(core_pid, signal.SIGKILL)
        assert proc.wait(30) == 3
        t.join(10)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), (errors, events[-2:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert "engine core process died" in out and "exiting so that this replica restarts" in out, (
        out[-2000:]
    )
