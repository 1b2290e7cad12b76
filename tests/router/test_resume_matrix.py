"""The router's side of mid-stream resume over every request shape it resumes, pinned exactly.

Scripted engines (tests/router/scripted_engine.py: the engine's resume contract, a deterministic
"model", failures on cue) behind the real router on loopback HTTP. Each shape (chat and
completions, n = 1 and 2, a batch of prompts, echo, logprobs, a stop string, greedy and seeded,
the usage chunk, the client's own token ids, a finish reason in a chunk of its own) is cut at
every point of its stream: before the status line, after each event (a chat role chunk, k tokens,
the last token, the usage chunk), before [DONE]; by a connection's end, an engine's error event,
a drain's abort. For each, the client's whole stream (every choice's chunks: text, logprobs,
finish reason, token ids; the usage; one id, one `created`, one [DONE]) equals the uninterrupted
run's through the router, and the router sent exactly the continuation the rules give: the
original body with `return_token_ids` and `resume` listing the ids the client had (max_tokens,
n, seed, stop unchanged: the engine counts the ids as output), the request again as it was when
nothing was generated, nothing when the output was complete.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.router.scripted_engine import ABORT, CUT, ERROR, Failure, Script, ScriptedEngine
from tests.router.test_router import metric

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def script():
    return Script()


@pytest.fixture(scope="module")
def engines(script):
    servers = [ScriptedEngine(script, f"e{i}").serve() for i in range(3)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def router(engines):
    from kvmesh.router.app import RouterConfig
    from tests.conftest import RouterThread

    rt = RouterThread(
        RouterConfig(
            model="tiny",
            redis_url=None,
            static_backends=[f"{e.name}={e.url}" for e in engines],
            scale_from_zero_timeout=0,
            resume_timeout=0,
            max_resumes=2,
            refresh_interval=0.1,
        )
    )
    yield rt
    rt.stop()


@pytest.fixture
def run(script, router, engines):
    """One client request through the router, its upstream requests failing as `failures` says:
    (the client's events, the bodies the engines received)."""

    def go(path: str, body: dict, failures=(), send_ids=True, finish_apart=False):
        script.failures = list(failures)
        script.bodies.clear()
        script.send_ids, script.finish_apart = send_ids, finish_apart
        events = sse(router.url, path, body)
        return events, list(script.bodies)

    go.engine_url = engines[0].url
    return go


def sse(url: str, path: str, body: dict) -> list:
    with httpx.stream("POST", url + path, json=body, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return [
            "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
            for line in resp.iter_lines()
            if line.startswith("data: ")
        ]


def upstream(engine_url: str, path: str, body: dict) -> list:
    """The stream the engine sends the router: the body with return_token_ids (no failure)."""
    return sse(engine_url, path, {**body, "return_token_ids": True})


# -- the client's view of a stream ---------------------------------------------------------------
def view(events: list) -> dict:
    """The client's whole stream: per choice index its chunks (all but the index), in order; the
    chunks' other fields; the usage chunks. Checks one [DONE], last, and one id and created."""
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert not [e for e in chunks if "error" in e], [e for e in chunks if "error" in e]
    assert len({(e["id"], e["created"]) for e in chunks}) == 1, chunks
    per_choice: dict[int, list] = {}
    for e in chunks:
        for c in e["choices"]:
            per_choice.setdefault(c["index"], []).append(
                {k: v for k, v in c.items() if k != "index"}
            )
    return {
        "choices": per_choice,
        "fields": [sorted(set(e) - {"usage"}) for e in chunks if e["choices"]],
        "prompt_token_ids": [e["prompt_token_ids"] for e in chunks if "prompt_token_ids" in e],
        "usage": [e["usage"] for e in chunks if e.get("usage")],
    }


def same_stream(got: list, want: list) -> None:
    g, w = view(got), view(want)
    assert sorted(g["choices"]) == sorted(w["choices"])
    for i in w["choices"]:
        assert g["choices"][i] == w["choices"][i], i
    assert g["usage"] == w["usage"]
    assert g["prompt_token_ids"] == w["prompt_token_ids"]
    assert sorted(map(tuple, g["fields"])) == sorted(map(tuple, w["fields"]))


# -- what the router must send after a failure ---------------------------------------------------
def expected_continuation(
    first: dict, delivered: list, num_choices: int, budget: int
) -> dict | None:
    """The body the router sends after the client got `delivered` (the engine's events, ids on):
    the request again when nothing was generated, None when the output is complete, else the
    continuation of the choices still running (a choice that generated its budget is ended by
    the router)."""
    ids: dict[int, list[int]] = {}
    finished = set()
    for e in delivered:
        for c in e.get("choices") or ():
            ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
            if c.get("finish_reason") not in (None, "abort"):
                finished.add(c["index"])
    if not any(ids.values()) and not finished:
        return first
    running = [i for i in range(num_choices) if i not in finished and len(ids.get(i, [])) < budget]
    if not running:
        return None
    if num_choices == 1:
        resume = {"output_token_ids": ids.get(0, [])}
    else:
        resume = {"choices": [{"index": i, "output_token_ids": ids.get(i, [])} for i in running]}
    return {**first, "resume": resume}


PROMPT = "the keeper of the lighthouse wrote down every ship"
OTHER = "a harbour at dawn with seven boats"
CHAT = [{"role": "user", "content": "Tell me about the lighthouse keeper"}]

# name: (path, body). Together they cross route x n x batch x echo x logprobs x stop x sampling x
# usage x the client's own ids; each is cut at every point of its stream.
SHAPES = {
    "completion greedy": ("/v1/completions", {"prompt": PROMPT, "temperature": 0}),
    "completion seeded logprobs usage": (
        "/v1/completions",
        {"prompt": PROMPT, "seed": 7, "logprobs": 1, "usage": True},
    ),
    "completion echo logprobs": (
        "/v1/completions",
        {"prompt": PROMPT, "temperature": 0, "echo": True, "logprobs": 1},
    ),
    "completion stop usage": (
        "/v1/completions",
        {"prompt": PROMPT, "seed": 3, "stop": "STOP", "usage": True},
    ),
    "completion client ids": (
        "/v1/completions",
        {"prompt": PROMPT, "temperature": 0, "return_token_ids": True, "usage": True},
    ),
    "completion n=2 seeded usage": (
        "/v1/completions",
        {"prompt": PROMPT, "seed": 11, "n": 2, "usage": True},
    ),
    "completion n=2 greedy logprobs": (
        "/v1/completions",
        {"prompt": PROMPT, "temperature": 0, "n": 2, "logprobs": 1},
    ),
    "completion batch x n=2 seeded stop usage": (
        "/v1/completions",
        {"prompt": [PROMPT, OTHER], "seed": 5, "n": 2, "stop": "STOP", "usage": True},
    ),
    "completion batch greedy echo usage": (
        "/v1/completions",
        {"prompt": [PROMPT, OTHER], "temperature": 0, "echo": True, "usage": True},
    ),
    "completion batch client ids": (
        "/v1/completions",
        {"prompt": [PROMPT, OTHER], "seed": 9, "return_token_ids": True, "usage": True},
    ),
    "chat greedy": ("/v1/chat/completions", {"messages": CHAT, "temperature": 0}),
    "chat seeded logprobs usage": (
        "/v1/chat/completions",
        {"messages": CHAT, "seed": 2, "logprobs": True, "usage": True},
    ),
    "chat stop": ("/v1/chat/completions", {"messages": CHAT, "seed": 4, "stop": ["STOP"]}),
    "chat n=2 seeded usage": (
        "/v1/chat/completions",
        {"messages": CHAT, "seed": 8, "n": 2, "usage": True},
    ),
    "chat n=2 greedy stop logprobs": (
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": 0, "n": 2, "stop": "STOP", "logprobs": True},
    ),
    "chat client ids usage": (
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": 0, "return_token_ids": True, "usage": True},
    ),
    "chat max_completion_tokens": (
        "/v1/chat/completions",
        {"messages": CHAT, "seed": 1, "max_completion_tokens": 3, "usage": True},
    ),
}


def request_body(name: str, engine_url: str) -> tuple[str, dict]:
    """The shape's client body; a "STOP" placeholder becomes a stop string that ends the first
    choice at its third token (the others, seeded, run on)."""
    path, body = SHAPES[name]
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, **body, "stream": True}
    if body.pop("usage", False):
        body["stream_options"] = {"include_usage": True}
    stop = body.get("stop")
    if stop:
        plain = {k: v for k, v in body.items() if k != "stop"}
        ids = [
            t
            for e in upstream(engine_url, path, plain)[:-1]
            for c in e["choices"]
            if c["index"] == 0
            for t in c.get("token_ids") or []
        ]
        from tests.router.scripted_engine import token_text

        word = next(token_text(t) for k, t in enumerate(ids) if k >= 2 and t not in ids[:k])
        body["stop"] = word if isinstance(stop, str) else [word]
    return path, body


def budget(body: dict, chat: bool) -> int:
    return (body.get("max_completion_tokens") if chat else None) or body["max_tokens"]


def num_choices(body: dict) -> int:
    prompts = body.get("prompt")
    return (len(prompts) if isinstance(prompts, list) else 1) * body.get("n", 1)


def check_cuts(run, path: str, body: dict, how: str, finish_apart: bool = False) -> None:
    """Every cut of the stream, checked."""
    chat = path.endswith("chat/completions")
    reference, bodies = run(path, body, finish_apart=finish_apart)
    assert len(bodies) == 1
    first = bodies[0]
    assert first == {**body, "return_token_ids": True}  # the client's body, ids asked for
    events = upstream_events(run, path, body, finish_apart)
    for after in range(0 if how == CUT else 1, len(events) + (1 if how != ABORT else 0)):
        want = expected_continuation(first, events[:after], num_choices(body), budget(body, chat))
        got, sent = run(path, body, [Failure(after, how)], finish_apart=finish_apart)
        try:
            same_stream(got, reference)
            assert sent[1:] == ([] if want is None else [want])
        except AssertionError as exc:
            raise AssertionError(
                f"cut after {after} of {len(events)} events ({how}): {exc}"
            ) from exc


def upstream_events(run, path: str, body: dict, finish_apart: bool) -> list:
    """What the engine sends the router for this body, [DONE] aside."""
    run(path, body, finish_apart=finish_apart)  # the script's options set
    return upstream(run.engine_url, path, body)[:-1]


@pytest.mark.parametrize("how", [CUT, ERROR, ABORT])
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_cut_of_every_shape_gives_the_client_the_uninterrupted_stream(
    name, how, run, engines
):
    path, body = request_body(name, engines[0].url)
    check_cuts(run, path, body, how)


@pytest.mark.parametrize(
    "name",
    [
        "completion seeded logprobs usage",
        "chat n=2 seeded usage",
        "completion batch x n=2 seeded stop usage",
    ],
)
def test_a_choice_that_generated_its_budget_without_its_finish_is_ended_by_the_router(
    name, run, engines
):
    """The finish reason in a chunk of its own after the last id, and the engine dies between:
    the router ends the choice with "length" itself; no continuation for a choice with nothing
    left to generate."""
    path, body = request_body(name, engines[0].url)
    check_cuts(run, path, body, CUT, finish_apart=True)


def test_two_failures_in_a_row_go_on_from_what_the_client_had_each_time(run, engines, router):
    path, body = request_body("completion batch x n=2 seeded stop usage", engines[0].url)
    reference, bodies = run(path, body)
    first = bodies[0]
    before = metric(router.url, "kvmesh_router_resumed_requests_total", phase="mid_stream")
    got, sent = run(path, body, [Failure(3, CUT), Failure(2, CUT)])
    same_stream(got, reference)
    assert len(sent) == 3
    assert (
        metric(router.url, "kvmesh_router_resumed_requests_total", phase="mid_stream") == before + 2
    )
    # the second continuation: the first's resume, plus what the client got of the second
    assert {k: v for k, v in sent[2].items() if k != "resume"} == first
    done = {c["index"]: c["output_token_ids"] for c in sent[1]["resume"]["choices"]}
    after = {c["index"]: c["output_token_ids"] for c in sent[2]["resume"]["choices"]}
    assert set(after) <= set(done)
    for i in after:
        assert after[i][: len(done[i])] == done[i] and len(after[i]) >= len(done[i])
    assert (
        sum(len(after[i]) - len(done[i]) for i in after) + sum(1 for i in done if i not in after)
        >= 1
    )  # the second engine's two events carried ids or ended a choice


def test_a_third_failure_is_past_the_limit_and_ends_with_the_error_event(run, engines, router):
    path, body = request_body("completion greedy", engines[0].url)
    before = metric(router.url, "kvmesh_router_resume_given_up_total", reason="limit")
    got, sent = run(path, body, [Failure(1, CUT), Failure(1, CUT), Failure(1, CUT)])
    assert len(sent) == 3
    assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == "upstream_failed"
    assert [c["text"] for e in got[:-2] for c in e["choices"]] == [
        c["text"] for e in upstream(engines[0].url, path, body)[:3] for c in e["choices"]
    ]
    assert metric(router.url, "kvmesh_router_resume_given_up_total", reason="limit") == before + 1


def test_an_engine_that_sends_no_ids_is_not_resumed_once_events_went_out(run, engines, router):
    path, body = request_body("completion greedy", engines[0].url)
    before = metric(router.url, "kvmesh_router_resume_given_up_total", reason="no_token_ids")
    got, sent = run(path, body, [Failure(2, CUT)], send_ids=False)
    assert len(sent) == 1
    assert len(got) == 4 and got[-2]["error"]["code"] == "upstream_failed" and got[-1] == "[DONE]"
    assert (
        metric(router.url, "kvmesh_router_resume_given_up_total", reason="no_token_ids")
        == before + 1
    )
    # before its first event, the same engine's request goes again whole
    reference, _ = run(path, body, send_ids=False)
    got, sent = run(path, body, [Failure(0, CUT)], send_ids=False)
    same_stream(got, reference)
    assert sent[1] == sent[0]


def test_best_of_is_not_resumed(run, engines, router):
    path, body = request_body("completion greedy", engines[0].url)
    body = {**body, "best_of": 2, "n": 1}
    got, sent = run(path, body, [Failure(2, CUT)])
    assert len(sent) == 1 and "return_token_ids" not in sent[0]  # not asked: never resumed
    assert got[-2]["error"]["code"] == "upstream_failed" and got[-1] == "[DONE]"
    assert len(got) == 4


@pytest.mark.parametrize("name", ["completion batch x n=2 seeded stop usage", "chat greedy"])
def test_a_non_streamed_request_goes_again_whole(name, script, engines, router):
    """Nothing reached the client: the request goes again, as it was, and its answer is the
    uninterrupted one."""
    path, body = request_body(name, engines[0].url)
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    script.failures, script.send_ids, script.finish_apart = [], True, False
    want = httpx.post(router.url + path, json=body, timeout=30).json()
    script.failures = [Failure(1, CUT)]
    script.bodies.clear()
    resp = httpx.post(router.url + path, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
    assert script.bodies == [body, body]
