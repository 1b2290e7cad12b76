"""The engine's HTTP side of mid-stream resume, in both engine modes: ``return_token_ids`` (vLLM's
shapes) and the ``resume`` continuation the router sends after a replica died. A client that got
the first k tokens of a stream, then the continuation's chunks, has exactly the uninterrupted
stream's text, ids and logprobs (greedy and seeded; chat and completions; a stop string across the
seam), and the usage counts the whole request once."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine.server.conftest import ThreadServer

RESUME = "resume.output_token_ids"


@pytest.fixture(scope="module", params=["thread", "process"])
def server(tiny_model, request):
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "128",
            "--max-num-seqs",
            "4",
            "--engine-mode",
            request.param,
        ]
    ).start()
    yield srv
    srv.stop()


def stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream(
        "POST",
        server.url + path,
        json={**body, "stream": True},
        timeout=60,
        headers={"X-Request-Id": "resume-test"},
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


class Seen:
    """What a streaming client received of choice 0: per output chunk, its ids, text, logprob entries."""

    def __init__(self, chunks: list[dict], chat: bool):
        self.chunks = [c for c in chunks if c["choices"]]
        self.usage = chunks[-1].get("usage")
        self.parts = []  # (ids, text, logprob entries, finish_reason)
        for ch in self.chunks:
            c = ch["choices"][0]
            if chat and "role" in c["delta"]:
                continue
            text = c["delta"].get("content", "") if chat else c["text"]
            lps = (
                (c["logprobs"] or {}).get("content", [])
                if chat
                else (c["logprobs"] or {}).get("tokens", [])
            )
            self.parts.append((c.get("token_ids"), text, lps, c["finish_reason"], c["logprobs"]))

    def ids(self, upto: int | None = None) -> list[int]:
        return [t for p in self.parts[:upto] for t in p[0]]

    def text(self, upto: int | None = None) -> str:
        return "".join(p[1] for p in self.parts[:upto])

    def chunks_for(self, k: int) -> int:
        """How many output chunks hold the first k ids."""
        n = 0
        for i, p in enumerate(self.parts):
            n += len(p[0])
            if n >= k:
                return i + 1
        raise AssertionError(k)


def lp_tokens(logprobs: dict, chat: bool) -> list[str]:
    return [e["token"] for e in logprobs["content"]] if chat else logprobs["tokens"]


def lp_values(logprobs: dict, chat: bool) -> list[float]:
    return [e["logprob"] for e in logprobs["content"]] if chat else logprobs["token_logprobs"]


CASES = {
    "completions": ("/v1/completions", dict(prompt="The quick brown fox", logprobs=2), False),
    "chat": (
        "/v1/chat/completions",
        dict(
            messages=[{"role": "user", "content": "Tell me a story"}], logprobs=True, top_logprobs=2
        ),
        True,
    ),
}


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=99)])
def test_a_stream_continued_from_its_first_k_tokens_is_the_uninterrupted_stream(
    server, kind, sampling
):
    path, body, chat = CASES[kind]
    body = {
        **body,
        **sampling,
        "max_tokens": 12,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    chunks = stream(server, path, body)
    whole = Seen(chunks, chat)
    ids = whole.ids()
    assert len(ids) == 12 and all(
        len(p[0]) == 1 for p in whole.parts
    )  # every id, in a chunk of its own
    first = chunks[0]
    prompt_ids = first["prompt_token_ids"] if chat else first["choices"][0]["prompt_token_ids"]
    assert (
        whole.usage["prompt_tokens"] == len(prompt_ids) and whole.usage["completion_tokens"] == 12
    )
    for k in (1, 4, 11):
        cont_chunks = stream(server, path, {**body, "resume": {"output_token_ids": ids[:k]}})
        cont = Seen(cont_chunks, chat)
        assert all("prompt_token_ids" not in ch for ch in cont_chunks)
        assert all(
            "role" not in c.get("delta", {}) and "prompt_token_ids" not in c
            for ch in cont_chunks
            for c in ch["choices"]
        )
        assert cont_chunks[0]["id"] == chunks[0]["id"]  # same X-Request-Id, same id
        n = whole.chunks_for(k)
        assert ids[:k] + cont.ids() == ids, k
        assert whole.text(n) + cont.text() == whole.text(), k
        # logprobs of the new tokens only, the same tokens and values as the uninterrupted stream's
        assert [lp_tokens(p[4], chat) for p in cont.parts] == [
            lp_tokens(p[4], chat) for p in whole.parts[n:]
        ]
        for p, q in zip(cont.parts, whole.parts[n:]):
            assert lp_values(p[4], chat) == pytest.approx(lp_values(q[4], chat), abs=1e-4)
        assert cont.parts[-1][3] == "length"
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [cont.usage[f] for f in counts] == [whole.usage[f] for f in counts], (
            k
        )  # the whole request, once
        assert cont.usage["prompt_tokens_details"]["cached_tokens"] <= cont.usage["prompt_tokens"]
        if not chat:  # text_offset goes on from the characters already sent
            assert cont.parts[0][4]["text_offset"][0] == whole.parts[n][4]["text_offset"][0]


def test_a_stop_string_straddling_the_seam_ends_the_continuation(server):
    path = "/v1/completions"
    base = dict(
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
    )
    plain = Seen(stream(server, path, base), chat=False)
    at = next(
        i
        for i in range(3, len(plain.parts) - 1)
        if plain.parts[i][1].strip() and plain.parts[i + 1][1].strip()
    )
    stop = plain.parts[at][1][-1] + plain.parts[at + 1][1][0]
    body = {**base, "stop": [stop]}
    whole = Seen(stream(server, path, body), chat=False)
    assert whole.parts[-1][3] == "stop"
    ids = whole.ids()
    k = len(ids) - 1
    n = whole.chunks_for(k)
    seam_text = post(server, "/detokenize", {"tokens": ids[:k]}).json()["prompt"]
    assert seam_text.endswith(stop[0]) and not whole.text(n).endswith(
        stop[0]
    )  # begun, but held back
    cont = Seen(stream(server, path, {**body, "resume": {"output_token_ids": ids[:k]}}), chat=False)
    assert cont.ids() == ids[k:] and cont.parts[-1][3] == "stop"
    assert whole.text(n) + cont.text() == whole.text()
    assert cont.chunks[-1]["choices"][0]["stop_reason"] == stop


def test_a_whole_response_continuation_holds_the_new_output_and_the_whole_usage(server):
    body = dict(
        prompt=[7, 8, 9, 10],
        max_tokens=10,
        temperature=1.0,
        seed=5,
        ignore_eos=True,
        return_token_ids=True,
    )
    whole = post(server, "/v1/completions", body).json()
    ids = whole["choices"][0]["token_ids"]
    assert whole["choices"][0]["prompt_token_ids"] == [7, 8, 9, 10] and len(ids) == 10
    cont = post(server, "/v1/completions", {**body, "resume": {"output_token_ids": ids[:6]}}).json()
    assert cont["choices"][0]["token_ids"] == ids[6:]
    assert cont["usage"]["completion_tokens"] == 10 and cont["usage"]["prompt_tokens"] == 4
    assert cont["usage"]["prompt_tokens_details"]["cached_tokens"] <= 4
    chat = dict(
        messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, ignore_eos=True
    )
    plain = post(server, "/v1/chat/completions", chat).json()
    assert (
        "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    )  # only when asked
    with_ids = post(server, "/v1/chat/completions", {**chat, "return_token_ids": True}).json()
    assert with_ids["choices"][0]["message"] == plain["choices"][0]["message"]
    assert len(with_ids["choices"][0]["token_ids"]) == 6 and with_ids["prompt_token_ids"]


@pytest.mark.parametrize(
    "path, extra, param, code",
    [
        (
            "/v1/completions",
            {"n": 2},
            "n",
            None,
        ),  # one choice's form; several go on with resume.choices
        ("/v1/completions", {"prompt": ["a b", "c d"]}, "prompt", None),
        ("/v1/chat/completions", {"resume": {"output_token_ids": [1, True]}}, RESUME, None),
        ("/v1/completions", {"resume": [1, 2]}, RESUME, None),
        ("/v1/completions", {"resume": {"output_token_ids": []}}, RESUME, None),
        ("/v1/completions", {"resume": {"output_token_ids": [1, 10**9]}}, RESUME, None),
        (
            "/v1/completions",
            {"resume": {"output_token_ids": [3] * 8}},
            RESUME,
            None,
        ),  # max_tokens reached
        (
            "/v1/completions",
            {"max_tokens": None, "resume": {"output_token_ids": [3] * 2100}},
            RESUME,
            "context_length_exceeded",
        ),
    ],
)
def test_bad_continuations_are_refused_naming_the_field(server, path, extra, param, code):
    body = {"max_tokens": 8, "resume": {"output_token_ids": [3, 4]}}
    body.update(
        {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "hello"}
    )
    body.update(extra)
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == code


def by_choice(chunks: list[dict], chat: bool) -> dict[int, dict]:
    """Per choice index: its ids, text and finish reason, as a streaming client assembles them."""
    seen: dict[int, dict] = {}
    for ch in chunks:
        for c in ch["choices"]:
            one = seen.setdefault(
                c["index"], {"ids": [], "text": "", "finish": None, "role": False}
            )
            one["role"] |= chat and "role" in c["delta"]
            one["ids"] += c.get("token_ids") or []
            one["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            one["finish"] = c["finish_reason"] or one["finish"]
    return seen


MULTI = {
    # a batch of 2 prompts x n = 2: choice index = prompt index * n + j
    "completions batch": (
        "/v1/completions",
        dict(prompt=["The quick brown fox", "Once upon a time there"], n=2),
        False,
    ),
    "chat n=3": (
        "/v1/chat/completions",
        dict(messages=[{"role": "user", "content": "Tell me a story"}], n=3),
        True,
    ),
}


@pytest.mark.parametrize("kind", list(MULTI))
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_several_choices_continue_under_their_own_indices(server, kind, sampling):
    """resume.choices: only the listed choices run, each from its own ids, drawing as in the
    uninterrupted run (seed + j by its index), and the usage counts the listed choices' prompts and
    whole outputs (the router adds what finished before the break)."""
    path, body, chat = MULTI[kind]
    body = {
        **body,
        **sampling,
        "max_tokens": 10,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    chunks = stream(server, path, body)
    whole = by_choice(chunks, chat)
    n_choices = len(whole)
    assert all(len(whole[i]["ids"]) == 10 for i in range(n_choices))
    if sampling.get("seed") is not None:  # seeded choices differ from each other
        assert len({tuple(whole[i]["ids"]) for i in range(n_choices)}) == n_choices
    prompt_lens = {}
    for (
        ch
    ) in chunks:  # completions: on each choice's first chunk; chat: on the response's first chunk
        for c in ch["choices"]:
            if "prompt_token_ids" in c:
                prompt_lens[c["index"] // 2] = len(c["prompt_token_ids"])
        if "prompt_token_ids" in ch:
            prompt_lens[0] = len(ch["prompt_token_ids"])
    # choice 1 finished before the break; the last one had not generated anything yet
    listed = {0: whole[0]["ids"][:3], n_choices - 1: []}
    if n_choices > 3:
        listed[2] = whole[2]["ids"][:9]
    resume = {"choices": [{"index": i, "output_token_ids": ids} for i, ids in listed.items()]}
    cont_chunks = stream(server, path, {**body, "resume": resume})
    cont = by_choice(cont_chunks, chat)
    assert sorted(cont) == sorted(listed)  # choice 1 is not run again
    for i, ids in listed.items():
        assert ids + cont[i]["ids"] == whole[i]["ids"], i
        assert whole[i]["text"].endswith(cont[i]["text"]) and cont[i]["text"], i
        assert cont[i]["finish"] == "length" and not cont[i]["role"]
    # prompt ids only for the choice started from nothing, as in a fresh stream (completions: on
    # its first chunk; chat: on the role chunk, which a continuation does not send)
    fresh = [c["index"] for ch in cont_chunks for c in ch["choices"] if "prompt_token_ids" in c]
    assert fresh == ([] if chat else [n_choices - 1])
    assert all("prompt_token_ids" not in ch for ch in cont_chunks)
    usage = cont_chunks[-1]["usage"]
    prompts = {i // (n_choices if chat else 2) for i in listed}
    assert usage["prompt_tokens"] == sum(prompt_lens[p] for p in prompts)
    assert usage["completion_tokens"] == 10 * len(listed)
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]


@pytest.mark.parametrize(
    "resume, param, code",
    [
        ({"choices": []}, "resume.choices", None),
        ({"choices": {"index": 0}}, "resume.choices", None),
        ({"choices": [5]}, "resume.choices.0", None),
        ({"choices": [{"index": 4, "output_token_ids": [3]}]}, "resume.choices.0.index", None),
        ({"choices": [{"index": -1, "output_token_ids": [3]}]}, "resume.choices.0.index", None),
        ({"choices": [{"index": "1", "output_token_ids": [3]}]}, "resume.choices.0.index", None),
        (
            {
                "choices": [
                    {"index": 1, "output_token_ids": [3]},
                    {"index": 1, "output_token_ids": [4]},
                ]
            },
            "resume.choices.1.index",
            None,
        ),
        (
            {"choices": [{"index": 0, "output_token_ids": "3 4"}]},
            "resume.choices.0.output_token_ids",
            None,
        ),
        ({"choices": [{"index": 0}]}, "resume.choices.0.output_token_ids", None),
        (
            {"choices": [{"index": 0, "output_token_ids": [3, 4.5]}]},
            "resume.choices.0.output_token_ids",
            None,
        ),
        (
            {
                "choices": [
                    {"index": 0, "output_token_ids": [1]},
                    {"index": 3, "output_token_ids": [1, 10**9]},
                ]
            },
            "resume.choices.1.output_token_ids",
            None,
        ),  # outside the vocabulary (the second entry)
        (
            {"choices": [{"index": 2, "output_token_ids": [3] * 8}]},
            "resume.choices.0.output_token_ids",
            None,
        ),
        (
            {"choices": [{"index": 0, "output_token_ids": [3]}], "output_token_ids": [3]},
            "resume",
            None,
        ),
    ],
)
def test_bad_multi_choice_continuations_are_refused_naming_the_field(server, resume, param, code):
    body = {"prompt": ["hello", "world"], "n": 2, "max_tokens": 8, "stream": True, "resume": resume}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["code"] == code


def test_a_multi_choice_continuation_past_the_context_names_its_choice(server):
    body = {
        "prompt": "hello",
        "n": 2,
        "max_tokens": None,
        "stream": True,
        "resume": {"choices": [{"index": 1, "output_token_ids": [3] * 2100}]},
    }
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "resume.choices.0.output_token_ids"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_continuation_echoes_only_what_the_client_has_not_had(server):
    """echo + logprobs, a batch of 2 prompts: choice 0 goes on from 3 ids (no echo again, its
    text_offset after the echoed prompt and the text sent), choice 1 starts from nothing (its echo,
    prompt logprobs and prompt ids as in the uninterrupted stream)."""
    body = {
        "prompt": ["The lighthouse keeper", "A harbour at dawn"],
        "temperature": 0,
        "max_tokens": 6,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 1,
        "return_token_ids": True,
    }

    def per_choice(chunks):
        out: dict[int, dict] = {}
        for ch in chunks:
            for c in ch["choices"]:
                one = out.setdefault(c["index"], {"text": "", "lps": [], "ids": [], "prompt": None})
                one["text"] += c["text"]
                lp = c["logprobs"]
                one["lps"] += list(zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"]))
                one["ids"] += c.get("token_ids") or []
                one["prompt"] = c.get("prompt_token_ids", one["prompt"])
        return out

    whole = per_choice(stream(server, "/v1/completions", body))
    resume = {
        "choices": [
            {"index": 0, "output_token_ids": whole[0]["ids"][:3]},
            {"index": 1, "output_token_ids": []},
        ]
    }
    cont = per_choice(stream(server, "/v1/completions", {**body, "resume": resume}))

    def entries(lps):  # (token, text_offset) exactly; the logprob as a number in another batch
        return [(t, o) for t, _, o in lps], [v for _, v, _ in lps]

    # choice 1: its echo, prompt entries, offsets, ids and prompt ids, as uninterrupted
    assert {k: v for k, v in cont[1].items() if k != "lps"} == {
        k: v for k, v in whole[1].items() if k != "lps"
    }
    assert entries(cont[1]["lps"])[0] == entries(whole[1]["lps"])[0]
    got, want = entries(cont[1]["lps"])[1], entries(whole[1]["lps"])[1]
    assert [v is None for v in got] == [v is None for v in want]
    assert [v for v in got if v is not None] == pytest.approx(
        [v for v in want if v is not None], abs=1e-3
    )
    # choice 0: no echo again; its text_offset counts the echoed prompt and the text sent
    assert whole[0]["text"].endswith(cont[0]["text"]) and cont[0]["prompt"] is None
    assert not cont[0]["text"].startswith("The lighthouse keeper")
    assert entries(cont[0]["lps"])[0] == entries(whole[0]["lps"][-3:])[0]
