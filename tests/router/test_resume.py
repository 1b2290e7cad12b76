"""Streams survive their replica: an engine killed (SIGKILL) in the middle of a request, and the
router goes on with another replica. Real engines (`kvmesh serve`, a tiny random-weight
checkpoint) as their own processes, the router in this process with them as static backends.

For greedy and seeded sampling the client's output must equal an uninterrupted run on a
surviving engine, with nothing duplicated or lost; every stream keeps one id and `created` and
ends with one [DONE]; a request whose every replica dies, or that used its resumes, gets the
error event as before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvmesh.common.ports import free_port
from tests.conftest import wait_until
from tests.router.test_router import metric
from tests.tiny_models import build_tiny_model

PROMPT = "The history of the printing press begins"
CHAT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
LONG = {"max_tokens": 300, "ignore_eos": True}
# For tests that act on a request from outside its stream (a metrics poll, a drain's timeout): the
# tiny model writes 300 tokens in ~0.2 s (a few metrics polls, or the drain's 0.2 s); this one runs
# for over a second (the tiny model's context is 2048 tokens)
LONGER = {"max_tokens": 1900, "ignore_eos": True}


class Engine:
    """`kvmesh serve` in its own process group, so that SIGKILL takes all of it at once."""

    def __init__(self, model_dir: str, name: str, log_path):
        self.model_dir = model_dir
        self.name = name
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = log_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, same_port: bool = False) -> Engine:
        """Started (again); on a new port unless `same_port` (a restart in place, as a pod's)."""
        if not same_port:
            self.port = free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "serve",
                "--model",
                self.model_dir,
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--num-kv-blocks",
                "256",
                # a resumed stream recomputes its text as a prompt: equal to the uninterrupted
                # run's only where prefill and decode round alike (fp32; not so in bf16)
                "--dtype",
                "float32",
                "--engine-mode",
                "thread",
                # a drain (SIGTERM) cuts what still runs after 0.2 s: the drain test's streams outlive it
                "--drain-timeout",
                "0.2",
                "--log-level",
                "warning",
            ],
            stdout=open(self.log_path, "a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self) -> None:
        def ready():
            assert self.proc.poll() is None, f"engine {self.name} exited"
            try:
                return httpx.get(self.url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 180, interval=0.2, msg=f"engine {self.name} ready (log: {self.log_path})")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        """SIGTERM: the engine drains (0.2 s), aborts what still runs, and exits."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-resume"), "tiny-llama-plain"))


@pytest.fixture(scope="module")
def engines(tiny_dir, tmp_path_factory):
    """Two engines, restarted (on new ports) before each test if a test killed them."""
    logs = tmp_path_factory.mktemp("engine-logs")
    pool = [Engine(tiny_dir, f"e{i}", logs / f"e{i}.log") for i in range(2)]
    yield pool
    for e in pool:
        e.kill()


@pytest.fixture
def live(engines):
    dead = [e for e in engines if not e.alive]
    for e in dead:
        e.start()
    for e in dead:
        e.wait_ready()
    return engines


@pytest.fixture
def router(router_factory, live):
    def start(pods=None, **kw):
        pods = live if pods is None else pods
        return router_factory(
            model="tiny",
            redis_url=None,
            static_backends=[f"{e.name}={e.url}" for e in pods],
            scale_from_zero_timeout=0,
            **kw,
        )

    return start


def sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def stream(
    url: str, path: str, body: dict, kill_after: int | None = None, engines=(), kill_when=None
) -> tuple[list, str | None]:
    """The events of a stream; with `kill_after`, the engine that answers (X-Kvmesh-Pod) is
    killed once that many events arrived (or, with `kill_when`, once it holds for the events so
    far). Returns (events, the killed pod)."""
    if kill_when is not None:
        kill_after = 1
    events, killed = [], None
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        pod = resp.headers.get("x-kvmesh-pod")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if (
                kill_after is not None
                and killed is None
                and len(events) >= kill_after
                and (kill_when is None or kill_when(events))
            ):
                next(e for e in engines if e.name == pod).kill()
                killed = pod
    return events, killed


def text_of(events: list, chat: bool) -> str:
    parts = []
    for ev in events:
        if ev == "[DONE]" or "error" in ev:
            continue
        for c in ev["choices"]:
            parts.append(
                (c.get("delta") or {}).get("content") or "" if chat else c.get("text") or ""
            )
    return "".join(parts)


def logprob_tokens(events: list) -> list:
    out = []
    for ev in events:
        if ev != "[DONE]" and "error" not in ev:
            for c in ev["choices"]:
                out += (c.get("logprobs") or {}).get("tokens") or []
    return out


def check_one_stream(events: list) -> None:
    """One [DONE], last; one id and created; no token ids the client did not ask for."""
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events if e != "[DONE]"]
    assert not [e for e in chunks if "error" in e], [e for e in chunks if "error" in e]
    assert len({(e["id"], e["created"]) for e in chunks}) == 1, {
        (e["id"], e["created"]) for e in chunks
    }
    for e in chunks:
        assert "prompt_token_ids" not in e and all("token_ids" not in c for c in e["choices"]), e


def usage_of(events: list) -> dict:
    return next(e["usage"] for e in reversed(events) if e != "[DONE]" and e.get("usage"))


CASES = {
    "greedy completion, logprobs, stop": (
        "/v1/completions",
        {"prompt": PROMPT, "temperature": 0, "logprobs": 2},
    ),
    "seeded chat": ("/v1/chat/completions", {"messages": CHAT, "temperature": 1.0, "seed": 1234}),
    "greedy chat": ("/v1/chat/completions", {"messages": CHAT, "temperature": 0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_whose_engine_is_killed_goes_on_as_if_nothing_happened(case, router, live):
    path, body = CASES[case]
    chat = path.endswith("chat/completions")
    # LONGER: the engine writes 300 tokens faster than the client reads 4 events, and a stream it
    # finished before the kill has nothing to resume
    body = {"model": "tiny", **body, **LONGER, "stream_options": {"include_usage": True}}
    reference, _ = stream(live[0].url, path, body)  # straight to an engine, uninterrupted
    ref_text = text_of(reference, chat)
    if (
        "stop" in case
    ):  # a stop string well after the kill (its first occurrence): both runs end there
        at = next(
            k
            for k in range(len(ref_text) * 3 // 4, len(ref_text) - 8)
            if ref_text[k : k + 8] not in ref_text[: k + 7]
        )
        body["stop"] = [ref_text[at : at + 8]]
        reference, _ = stream(live[0].url, path, body)
        ref_text = text_of(reference, chat)
    rt = router()
    events, killed = stream(rt.url, path, body, kill_after=4, engines=live)
    assert killed is not None
    check_one_stream(events)
    assert text_of(events, chat) == ref_text
    if "logprobs" in case:
        assert logprob_tokens(events) == logprob_tokens(reference)
    finish = [
        c["finish_reason"]
        for e in events
        if e != "[DONE]"
        for c in e["choices"]
        if c.get("finish_reason")
    ]
    assert finish == [
        c["finish_reason"]
        for e in reference
        if e != "[DONE]"
        for c in e["choices"]
        if c.get("finish_reason")
    ]
    assert usage_of(events)["completion_tokens"] == usage_of(reference)["completion_tokens"]
    assert usage_of(events)["prompt_tokens"] == usage_of(reference)["prompt_tokens"]
    assert metric(rt.url, "kvmesh_router_resumed_requests_total", phase="mid_stream") == 1
    assert metric(rt.url, "kvmesh_router_resumed_tokens_total") > usage_of(events)["prompt_tokens"]


def test_an_unseeded_stream_goes_on_with_the_whole_budget_once(router, live):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 1.0,
        **LONG,
        "stream_options": {"include_usage": True},
    }
    rt = router()
    events, killed = stream(rt.url, "/v1/completions", body, kill_after=4, engines=live)
    assert killed is not None
    check_one_stream(events)
    assert usage_of(events)["completion_tokens"] == LONG["max_tokens"]
    assert [
        c["finish_reason"]
        for e in events
        if e != "[DONE]"
        for c in e["choices"]
        if c.get("finish_reason")
    ] == ["length"]
    assert metric(rt.url, "kvmesh_router_resumed_requests_total") == 1


def test_the_client_asking_for_token_ids_gets_them_all_once(router, live):
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, **LONG, "return_token_ids": True}
    reference, _ = stream(live[0].url, "/v1/completions", body)
    rt = router()
    events, killed = stream(rt.url, "/v1/completions", body, kill_after=4, engines=live)
    assert killed is not None

    def ids(evs):
        return [
            t for e in evs if e != "[DONE]" for c in e["choices"] for t in c.get("token_ids") or []
        ]

    assert ids(events) == ids(reference) and len(ids(events)) == LONG["max_tokens"]


NON_STREAMED = {
    "greedy chat": ("/v1/chat/completions", {"messages": CHAT, "temperature": 0}),
    "seeded batch of 2 prompts x n=2": (
        "/v1/completions",
        {
            "prompt": [PROMPT, "Once upon a time in a harbour"],
            "temperature": 1.0,
            "seed": 11,
            "n": 2,
        },
    ),
}


@pytest.mark.parametrize("case", list(NON_STREAMED))
def test_a_non_streamed_request_whose_engine_is_killed_is_answered_by_another(case, router, live):
    """Nothing reached the client: the request goes again, whole, to the other replica, and its
    answer is the uninterrupted one (every choice, seeded ones too)."""
    path, body = NON_STREAMED[case]
    body = {"model": "tiny", **body, **LONGER}
    # 4 choices x 1,900 tokens, twice over when resent whole: minutes on a busy 2-core machine
    reference = httpx.post(live[0].url + path, json=body, timeout=600).json()
    rt = router()
    result = {}
    import threading

    t = threading.Thread(
        target=lambda: result.setdefault("resp", httpx.post(rt.url + path, json=body, timeout=600))
    )
    t.start()

    def running():
        for e in live:
            if e.alive and "num_requests_running" in (
                m := httpx.get(e.url + "/metrics", timeout=2).text
            ):
                if any(
                    line.startswith("vllm:num_requests_running") and not line.endswith(" 0.0")
                    for line in m.splitlines()
                ):
                    return e
        return None

    busy = wait_until(running, 30, interval=0.01, msg="the request running on an engine")
    busy.kill()
    t.join(600)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    out = resp.json()
    content = (
        (lambda c: c["message"]["content"])
        if path.endswith("chat/completions")
        else (lambda c: c["text"])
    )
    assert len(out["choices"]) == len(reference["choices"])
    assert sorted((c["index"], content(c)) for c in out["choices"]) == sorted(
        (c["index"], content(c)) for c in reference["choices"]
    )
    assert out["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
    assert metric(rt.url, "kvmesh_router_resumed_requests_total") == 1


def test_a_stream_cut_by_its_engines_drain_goes_on_with_another(router, live):
    """A draining engine (a scale-down, a rollout) aborts the streams still running at its drain
    timeout (finish_reason "abort"): the router goes on with another replica instead of ending them."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 0,
        **LONGER,
        "stream_options": {"include_usage": True},
    }
    reference, _ = stream(live[0].url, "/v1/completions", body)
    rt = router()
    events = []
    with httpx.stream(
        "POST", rt.url + "/v1/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        pod = resp.headers["x-kvmesh-pod"]
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if len(events) == 4:
                    next(e for e in live if e.name == pod).terminate()
    drained = next(e for e in live if e.name == pod)
    assert drained.proc.wait(30) == 0  # it drained and exited by itself
    check_one_stream(events)
    assert text_of(events, False) == text_of(reference, False)
    finish = [
        c["finish_reason"]
        for e in events
        if e != "[DONE]"
        for c in e["choices"]
        if c.get("finish_reason")
    ]
    assert finish == ["length"]  # never "abort": the client does not see the cut
    assert usage_of(events)["completion_tokens"] == LONGER["max_tokens"]
    assert metric(rt.url, "kvmesh_router_resumed_requests_total", phase="mid_stream") == 1


def test_a_stream_whose_every_replica_died_gets_the_error_event(router, live):
    rt = router(
        pods=live[:1], resume_timeout=1.0
    )  # one replica, not back within the second it waits
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, **LONG}
    t0 = time.monotonic()
    events, killed = stream(rt.url, "/v1/completions", body, kill_after=4, engines=live)
    assert killed == live[0].name
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "upstream_failed", events[-3:]
    assert time.monotonic() - t0 < 30
    assert metric(rt.url, "kvmesh_router_resume_given_up_total", reason="no_replica") == 1
    assert metric(rt.url, "kvmesh_router_resumed_requests_total") == 0


def test_a_one_replica_stream_waits_for_its_engine_to_restart_and_goes_on(router, live):
    """The only engine is killed and comes back on the same address (a pod's container restarted in
    place): the stream waits for it, kept alive with SSE comments, and goes on as if uninterrupted."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 0,
        **LONG,
        "stream_options": {"include_usage": True},
    }
    engine = live[0]
    reference, _ = stream(engine.url, "/v1/completions", body)
    rt = router(pods=[engine])  # static: the router sees no health; it asks the engine itself
    events, comments = [], []
    with httpx.stream(
        "POST", rt.url + "/v1/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith(":"):
                comments.append(line)
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if len(events) == 4:
                engine.kill()
                time.sleep(6)  # down longer than one keep-alive period
                engine.start(same_port=True)
    check_one_stream(events)
    assert text_of(events, False) == text_of(reference, False)
    assert (
        usage_of(events)["completion_tokens"]
        == usage_of(reference)["completion_tokens"]
        == LONG["max_tokens"]
    )
    assert comments and set(comments) == {": waiting for a replica to go on with this stream"}, (
        comments
    )
    assert metric(rt.url, "kvmesh_router_resumed_requests_total", phase="mid_stream") == 1
    assert metric(rt.url, "kvmesh_router_resume_given_up_total", reason="no_replica") == 0


def test_the_resume_limit_holds(router, live):
    rt = router(max_resumes=1)
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, **LONG}
    events, killed = [], []
    with httpx.stream(
        "POST", rt.url + "/v1/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if len(events) in (
                4,
                40,
            ):  # kill whichever engine is answering now: first one, then the other
                victim = next(e for e in live if e.alive and e.name not in killed)
                if len(events) == 4:
                    victim = next(e for e in live if e.name == resp.headers["x-kvmesh-pod"])
                victim.kill()
                killed.append(victim.name)
    assert len(killed) == 2
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "upstream_failed", events[-3:]
    assert metric(rt.url, "kvmesh_router_resumed_requests_total") == 1
    assert metric(rt.url, "kvmesh_router_resume_given_up_total", reason="limit") == 1


# -- several choices: n > 1, a batch of prompts (choice index = prompt index * n + j) -----------------
def per_choice(events: list, chat: bool) -> dict[int, dict]:
    """Per choice index: its text and finish reasons, as the client assembles them."""
    out: dict[int, dict] = {}
    for ev in events:
        if ev == "[DONE]" or "error" in ev:
            continue
        for c in ev["choices"]:
            one = out.setdefault(c["index"], {"text": "", "finish": []})
            one["text"] += (
                ((c.get("delta") or {}).get("content") or "") if chat else (c.get("text") or "")
            )
            if c.get("finish_reason"):
                one["finish"].append(c["finish_reason"])
    return out


def finished(events: list, indices) -> bool:
    return set(indices) <= {
        c["index"] for e in events if e != "[DONE]" for c in e["choices"] if c.get("finish_reason")
    }


MULTI = {
    "greedy chat n=2": ("/v1/chat/completions", {"messages": CHAT, "temperature": 0, "n": 2}),
    "seeded chat n=3": (
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": 1.0, "seed": 77, "n": 3},
    ),
    "greedy completions n=2": ("/v1/completions", {"prompt": PROMPT, "temperature": 0, "n": 2}),
    "seeded completions n=3": (
        "/v1/completions",
        {"prompt": PROMPT, "temperature": 1.0, "seed": 5, "n": 3},
    ),
    "seeded batch of 2 prompts x n=2": (
        "/v1/completions",
        {
            "prompt": [PROMPT, "Once upon a time in a harbour"],
            "temperature": 1.0,
            "seed": 11,
            "n": 2,
        },
    ),
}


def check_same_as(events: list, reference: list, chat: bool) -> None:
    """Per choice the same text and finish reason (once) as the uninterrupted run, and the same usage."""
    check_one_stream(events)
    got, want = per_choice(events, chat), per_choice(reference, chat)
    assert sorted(got) == sorted(want)
    for i in want:
        assert got[i]["text"] == want[i]["text"], i
        assert got[i]["finish"] == want[i]["finish"] and len(want[i]["finish"]) == 1, (
            i,
            got[i]["finish"],
        )
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage_of(events)[f] for f in counts] == [usage_of(reference)[f] for f in counts]


@pytest.mark.parametrize("case", list(MULTI))
def test_a_stream_of_several_choices_whose_engine_is_killed_loses_none(case, router, live):
    path, body = MULTI[case]
    chat = path.endswith("chat/completions")
    body = {"model": "tiny", **body, **LONG, "stream_options": {"include_usage": True}}
    reference, _ = stream(live[0].url, path, body)
    if "seeded" in case:  # seeded choices differ: each one's own draws are checked
        texts = [c["text"] for c in per_choice(reference, chat).values()]
        assert len(set(texts)) == len(texts)
    rt = router()
    events, killed = stream(rt.url, path, body, kill_after=8, engines=live)
    assert killed is not None
    check_same_as(events, reference, chat)
    assert metric(rt.url, "kvmesh_router_resumed_requests_total", phase="mid_stream") == 1
    # every choice ran at the kill: each re-prefills its prompt (usage counts a prompt once) and its ids
    prompts_per_choice = usage_of(reference)["prompt_tokens"] * body["n"]
    assert metric(rt.url, "kvmesh_router_resumed_tokens_total") > prompts_per_choice


def early_stop(texts: dict[int, str], early: list[int]) -> list[str]:
    """Stop strings that end each of the `early` choices a few tokens in and no other choice."""
    stops = []
    for i in early:
        others = [t for j, t in texts.items() if j != i]
        at = next(
            k
            for k in range(20, len(texts[i]) - 6)
            if texts[i][k] == " "
            and texts[i][k + 1 : k + 6].strip()
            and texts[i][k : k + 6] not in texts[i][: k + 5]
            and not any(texts[i][k : k + 6] in t for t in others)
        )
        stops.append(texts[i][at : at + 6])
    return stops


@pytest.mark.parametrize(
    "case, early",
    [
        ("seeded chat n=3", [1]),
        (
            "seeded batch of 2 prompts x n=2",
            [0, 1],
        ),  # prompt 0's every choice: its prompt is not run again
    ],
)
def test_choices_that_finished_before_the_kill_are_not_run_again(case, early, router, live):
    """Some choices end (a stop string) before the engine is killed, the others after: the
    continuation runs the others only, and the client's stream is the uninterrupted one's."""
    path, body = MULTI[case]
    chat = path.endswith("chat/completions")
    body = {"model": "tiny", **body, **LONG, "stream_options": {"include_usage": True}}
    plain, _ = stream(live[0].url, path, body)
    body["stop"] = early_stop({i: c["text"] for i, c in per_choice(plain, chat).items()}, early)
    reference, _ = stream(live[0].url, path, body)
    ref = per_choice(reference, chat)
    assert [ref[i]["finish"] for i in early] == [["stop"]] * len(early)
    assert all(ref[i]["finish"] == ["length"] for i in ref if i not in early)
    rt = router()
    events, killed = stream(
        rt.url, path, body, engines=live, kill_when=lambda evs: finished(evs, early)
    )
    assert killed is not None
    check_same_as(events, reference, chat)
    assert metric(rt.url, "kvmesh_router_resumed_requests_total", phase="mid_stream") == 1
