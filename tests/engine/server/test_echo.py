"""echo and prompt logprobs over HTTP: what evaluation harnesses (lm-eval's local-completions)
send to score a continuation, and vLLM's prompt_logprobs."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine.server.conftest import ThreadServer
from tests.engine.test_prompt_logprobs import hf_prompt_logprobs


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "128",
            "--max-num-batched-tokens",
            "32",
        ]
    ).start()
    yield srv
    srv.stop()


def post(server, path, **body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_loglikelihood_request_like_lm_eval(server, tiny_model):
    prompts = [
        [11, 22, 33, 44, 55, 66, 77],
        [
            101,
            102,
            103,
            104,
            105,
            106,
            107,
            108,
            109,
            110,
            111,
            112,
            113,
            114,
            115,
            116,
            117,
            118,
            119,
            120,
            121,
            122,
            123,
            124,
            125,
            126,
            127,
            128,
            129,
            130,
            131,
            132,
            133,
            134,
            135,
            136,
            137,
            138,
            139,
            140,
        ],
    ]
    r = post(
        server,
        "/v1/completions",
        model="tiny",
        prompt=prompts,
        max_tokens=1,
        temperature=0,
        logprobs=1,
        echo=True,
        seed=1234,
    )
    assert r.status_code == 200, r.text
    decode = server.state.engine.tokenizer.decode
    for prompt, choice in zip(prompts, r.json()["choices"]):
        lps = choice["logprobs"]
        assert choice["text"].startswith(decode(prompt))
        assert len(lps["tokens"]) == len(prompt) + 1 and lps["token_logprobs"][0] is None
        assert lps["top_logprobs"][0] is None and all(len(t) == 1 for t in lps["top_logprobs"][1:])
        ref = hf_prompt_logprobs(tiny_model, tuple(prompt))
        for pos in range(1, len(prompt)):
            assert lps["token_logprobs"][pos] == pytest.approx(
                float(ref[pos - 1, prompt[pos]]), abs=2e-4
            )
        assert lps["text_offset"] == sorted(lps["text_offset"])


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(server):
    r = post(
        server,
        "/v1/completions",
        prompt="score this sentence please",
        max_tokens=0,
        echo=True,
        logprobs=0,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == "score this sentence please" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == body["usage"]["prompt_tokens"]
    bad = post(server, "/v1/completions", prompt="x", max_tokens=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_equals_the_full_response(server):
    body = dict(
        prompt="the stream echoes",
        max_tokens=5,
        temperature=0,
        echo=True,
        logprobs=1,
        ignore_eos=True,
    )
    full = post(server, "/v1/completions", **body).json()["choices"][0]
    text, tokens = "", []
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                tokens += c["logprobs"]["tokens"]
    assert text == full["text"] and tokens == full["logprobs"]["tokens"]


def test_prompt_logprobs_field_on_completions_and_chat(server):
    r = post(
        server, "/v1/completions", prompt=[5, 6, 7, 8, 9], max_tokens=2, prompt_logprobs=2
    ).json()
    field = r["choices"][0]["prompt_logprobs"]
    assert len(field) == 5 and field[0] is None
    # each entry holds the prompt token itself and the top 2 (which may include it)
    assert all(
        str(tok) in entry and 2 <= len(entry) <= 3 for tok, entry in zip([6, 7, 8, 9], field[1:])
    )
    assert field[2]["7"]["rank"] >= 1 and "decoded_token" in field[2]["7"]
    chat = post(
        server,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        prompt_logprobs=0,
    ).json()
    plp = chat["choices"][0]["prompt_logprobs"]
    assert (
        len(plp) == chat["usage"]["prompt_tokens"]
        and plp[0] is None
        and all(len(e) == 1 for e in plp[1:])
    )
    assert (
        "prompt_logprobs"
        not in post(server, "/v1/completions", prompt="x", max_tokens=1).json()["choices"][0]
    )
    assert post(server, "/v1/completions", prompt="x", prompt_logprobs=50).status_code == 400
