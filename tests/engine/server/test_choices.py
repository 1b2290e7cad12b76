"""n choices per prompt and batched prompts: one engine request each, merged into one response."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine.server.conftest import ThreadServer, wait_for


@pytest.fixture(scope="module")
def server(tiny_model):
    # capacity: 4 running + 4 waiting = 8 engine requests
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "256",
            "--max-num-seqs",
            "4",
            "--max-waiting",
            "4",
        ]
    ).start()
    yield srv
    srv.stop()


def post(server, path, **body):
    r = httpx.post(server.url + path, json={"ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path, **body) -> list[dict]:
    chunks = []
    with httpx.stream(
        "POST", server.url + path, json={"ignore_eos": True, "stream": True, **body}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_n_samples_are_seeded_per_choice_and_share_the_prompt(server):
    body = dict(prompt="the quick brown fox", max_tokens=8, temperature=1.0, seed=7)
    r = post(server, "/v1/completions", n=3, **body)
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert len(set(texts)) > 1
    # choice j is the request with seed + j
    assert [
        post(server, "/v1/completions", **{**body, "seed": 7 + j})["choices"][0]["text"]
        for j in range(3)
    ] == texts
    single = post(server, "/v1/completions", **body)["usage"]
    assert r["usage"]["prompt_tokens"] == single["prompt_tokens"]  # counted once per prompt
    assert r["usage"]["completion_tokens"] == 3 * 8


def test_batched_prompts_answer_like_single_requests(server):
    prompts = ["alpha beta gamma", "delta epsilon", "zeta"]
    r = post(server, "/v1/completions", prompt=prompts, max_tokens=6, temperature=0)
    singles = [
        post(server, "/v1/completions", prompt=p, max_tokens=6, temperature=0) for p in prompts
    ]
    assert [c["text"] for c in r["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert r["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert r["usage"]["completion_tokens"] == 18
    # token-id batches work too, and n applies per prompt: index = prompt * n + sample
    r = post(
        server, "/v1/completions", prompt=[[11, 12, 13], [21, 22]], n=2, max_tokens=4, temperature=0
    )
    texts = [c["text"] for c in r["choices"]]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3]
    mixed = httpx.post(
        server.url + "/v1/completions", json={"prompt": ["text", [1, 2]]}, timeout=30
    )
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"


def test_streamed_choices_add_up_to_the_full_response(server):
    body = dict(
        prompt=["one two three", "four five"],
        n=2,
        max_tokens=7,
        temperature=1.0,
        seed=3,
        stream_options={"include_usage": True},
    )
    full = post(
        server, "/v1/completions", **{k: v for k, v in body.items() if k != "stream_options"}
    )
    chunks = stream(server, "/v1/completions", **body)
    texts, finishes = {}, {}
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finishes[c["index"]] = finishes.get(c["index"], []) + [c["finish_reason"]]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert finishes == {i: ["length"] for i in range(4)}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_chat_n_streams_a_role_and_content_per_choice(server):
    msgs = [{"role": "user", "content": "say something"}]
    full = post(
        server, "/v1/chat/completions", messages=msgs, n=2, max_tokens=5, temperature=1.0, seed=11
    )
    assert [c["index"] for c in full["choices"]] == [0, 1]
    chunks = stream(
        server, "/v1/chat/completions", messages=msgs, n=2, max_tokens=5, temperature=1.0, seed=11
    )
    roles = [
        c["index"] for ch in chunks for c in ch["choices"] if c["delta"].get("role") == "assistant"
    ]
    assert sorted(roles) == [0, 1]
    content = {}
    for ch in chunks:
        for c in ch["choices"]:
            content[c["index"]] = content.get(c["index"], "") + c["delta"].get("content", "")
    assert content == {c["index"]: c["message"]["content"] for c in full["choices"]}


def test_choices_past_capacity_are_refused_and_nothing_is_admitted(server):
    # more than the server could ever admit at once: 400, not a 429 that no retry would cure
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hi", "n": 9, "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    # more than there is room for now: 429, and none of the choices is admitted
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=60,
        json={"prompt": "busy", "n": 5, "max_tokens": 300, "ignore_eos": True, "stream": True},
    ) as busy:
        wait_for(lambda: server.state.engine.num_in_flight == 5, timeout=15)
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "hi", "n": 4, "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert server.state.engine.num_in_flight == 5
        busy.close()
    wait_for(lambda: server.state.engine.num_in_flight == 0, timeout=15)


def test_client_leaving_a_stream_aborts_every_choice(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=60,
        json={
            "prompt": ["a long one", "another"],
            "n": 2,
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    wait_for(lambda: server.state.engine.num_in_flight == 0, timeout=15)
    wait_for(
        lambda: server.state.engine.snapshot()["num_running"] == 0, timeout=15
    )  # the engine dropped them


def test_continuous_usage_stats_on_every_chunk(server):
    body = dict(
        prompt="count with me",
        max_tokens=6,
        temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = stream(server, "/v1/completions", **body)
    assert all(ch["usage"] is not None for ch in chunks)
    done = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert done == sorted(done) and done[-1] == 6 and done[0] >= 1
    plain = stream(server, "/v1/completions", **{**body, "stream_options": {"include_usage": True}})
    assert (
        all(ch["usage"] is None for ch in plain[:-1]) and plain[-1]["usage"] == chunks[-1]["usage"]
    )
