"""The engine's continuation (``resume``) over every resumable request shape, pinned exactly: chat
and completions, n = 1 and n > 1, a batch of prompts, with and without logprobs, with a stop string,
greedy and seeded. Each choice cut after its first k ids (k in 1, the middle, the last but one)
continues to the uninterrupted run's remainder: the same ids, text, logprobs and finish reason, and
a usage counting the continued choices' whole outputs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import pytest

from tests.engine.server.conftest import ThreadServer

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "256",
            "--max-num-seqs",
            "8",
            "--engine-mode",
            "thread",
        ]
    ).start()
    yield srv
    srv.stop()


@dataclass
class Part:
    """One output chunk of one choice: its ids, text, logprob entries (token, value) and finish."""

    ids: list[int]
    text: str
    lps: list[tuple[str, float]]
    finish: str | None


@dataclass
class Choice:
    parts: list[Part] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [t for p in self.parts for t in p.ids]

    @property
    def finish(self) -> str | None:
        return next((p.finish for p in reversed(self.parts) if p.finish), None)

    def upto(self, k: int) -> int:
        """How many chunks hold the first k ids (the client had these when the stream broke)."""
        n = 0
        for i, p in enumerate(self.parts):
            n += len(p.ids)
            if n >= k:
                return i + 1
        raise AssertionError(k)

    def text(self, start: int = 0, end: int | None = None) -> str:
        return "".join(p.text for p in self.parts[start:end])

    def lps(self, start: int = 0) -> list[tuple[str, float]]:
        return [e for p in self.parts[start:] for e in p.lps]


def logprob_entries(c: dict, chat: bool) -> list[tuple[str, float]]:
    lp = c.get("logprobs")
    if not lp:
        return []
    if chat:
        return [(e["token"], e["logprob"]) for e in lp["content"]]
    return list(zip(lp["tokens"], lp["token_logprobs"]))


def stream(server, path: str, body: dict, chat: bool) -> tuple[dict[int, Choice], dict, list]:
    """Per choice index what a streaming client assembled, the final usage, and the raw chunks."""
    chunks = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    seen: dict[int, Choice] = {}
    for ch in chunks:
        for c in ch["choices"]:
            role_only = chat and "role" in c["delta"] and not c["delta"].get("content")
            if role_only and not c.get("token_ids") and not c["finish_reason"]:
                continue  # chat's role chunk: no output
            text = (c["delta"].get("content") or "") if chat else c["text"]
            part = Part(
                list(c.get("token_ids") or []),
                text,
                logprob_entries(c, chat),
                c["finish_reason"],
            )
            seen.setdefault(c["index"], Choice()).parts.append(part)
    return seen, chunks[-1]["usage"], chunks


def cut_points(n_ids: int) -> list[int]:
    """The first id, the middle, the last but one (none: a one-id output has nothing to resume)."""
    return sorted(k for k in {1, n_ids // 2, n_ids - 1} if 1 <= k < n_ids)


# (path, the request's shape, chat, choices per prompt, prompts)
SHAPES = {
    "completions": ("/v1/completions", dict(prompt="The quick brown fox"), False),
    "completions n=2": ("/v1/completions", dict(prompt="The quick brown fox", n=2), False),
    "completions batch": (
        "/v1/completions",
        dict(prompt=["The quick brown fox", "Once upon a time there"]),
        False,
    ),
    "completions batch n=2": (
        "/v1/completions",
        dict(prompt=["The quick brown fox", "Once upon a time there"], n=2),
        False,
    ),
    "chat": ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Tell me"}]), True),
    "chat n=3": (
        "/v1/chat/completions",
        dict(messages=[{"role": "user", "content": "Tell me a story"}], n=3),
        True,
    ),
}
SAMPLING = {"greedy": dict(temperature=0), "seeded": dict(temperature=1.0, seed=1234)}
LOGPROBS = {
    "no-logprobs": ({}, {}),
    "logprobs": (dict(logprobs=2), dict(logprobs=True, top_logprobs=2)),
}


def stop_string(server, path: str, body: dict, chat: bool) -> str:
    """Two characters across a chunk boundary in the middle of choice 0's uninterrupted text:
    a stop string that ends the run early (and one straddling a seam somewhere)."""
    seen, _, _ = stream(server, path, body, chat)
    parts = seen[0].parts
    for i in range(3, len(parts) - 1):
        a, b = parts[i].text, parts[i + 1].text
        if a.strip() and b.strip():
            return a[-1] + b[0]
    pytest.skip("no two text chunks to straddle")


@pytest.mark.parametrize("stop", ["no-stop", "stop"])
@pytest.mark.parametrize("lp", list(LOGPROBS))
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_choice_continued_from_its_first_k_ids_is_the_uninterrupted_remainder(
    server, shape, sampling, lp, stop
):
    path, body, chat = SHAPES[shape]
    body = {
        **body,
        **SAMPLING[sampling],
        **LOGPROBS[lp][chat],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    if stop == "stop":
        body["stop"] = [stop_string(server, path, body, chat)]
    whole, usage, _ = stream(server, path, body, chat)
    indices = sorted(whole)
    assert indices == list(range(len(indices))) and len(indices) >= 1
    if stop == "stop":
        assert whole[0].finish == "stop" and len(whole[0].ids) < MAX_TOKENS
    assert usage["completion_tokens"] == sum(len(whole[i].ids) for i in indices)
    if sampling == "seeded" and len(indices) > 1 and stop == "no-stop":
        # seed + j: the samples of one prompt differ, so a wrong index shows
        assert len({tuple(whole[i].ids) for i in indices}) == len(indices)
    single = len(indices) == 1
    for turn in range(3):
        # each choice its own cut (rotated), so choices swapped at the seam show even when greedy
        plan = {}
        for i in indices:
            cuts = cut_points(len(whole[i].ids))
            if cuts:
                plan[i] = cuts[(turn + i) % len(cuts)]
        if turn == 1 and len(plan) > 1:
            del plan[min(plan)]  # as if it finished before the break: the others keep their indices
        if single:
            resume = {"output_token_ids": whole[0].ids[: plan[0]]}
        else:
            resume = {
                "choices": [
                    {"index": i, "output_token_ids": whole[i].ids[:k]} for i, k in plan.items()
                ]
            }
        cont, cont_usage, cont_chunks = stream(server, path, {**body, "resume": resume}, chat)
        assert sorted(cont) == sorted(plan), (turn, plan)
        for i, k in plan.items():
            w, c = whole[i], cont[i]
            n = w.upto(k)
            where = (shape, sampling, lp, stop, i, k)
            assert w.ids[:k] + c.ids == w.ids, where
            assert w.text(0, n) + c.text() == w.text(), where
            assert c.finish == w.finish, where
            assert [t for t, _ in c.lps()] == [t for t, _ in w.lps(n)], where
            for (_, got), (_, want) in zip(c.lps(), w.lps(n)):
                assert got == pytest.approx(want, abs=1e-4), where
        # the continued choices' whole outputs (the resumed ids count as generated)
        assert cont_usage["completion_tokens"] == sum(len(whole[i].ids) for i in plan), plan
        if len(plan) == len(indices):
            assert cont_usage["prompt_tokens"] == usage["prompt_tokens"], plan
        assert all(
            "role" not in c.get("delta", {}) and "prompt_token_ids" not in c
            for ch in cont_chunks
            for c in ch["choices"]
        )
