"""Sampling parameters at the far ends of their range, end to end over HTTP: a top_p or min_p
so small it rounds to zero in float32 still samples the top token (the nucleus always holds
it), so with a seed and any temperature the answer is the greedy one, token for token."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.server.conftest import ThreadServer

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "64",
            "--max-num-seqs",
            "8",
        ]
    ).start()
    yield srv
    srv.stop()


def _tokens(url: str, prompt: str, **params) -> list[str]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "logprobs": 0, **params},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize(
    "params",
    [
        dict(top_p=1e-300),
        dict(top_p=1e-46),
        dict(top_p=5e-324, temperature=2.0),
        dict(top_p=1e-300, min_p=5e-324),
        dict(min_p=1.0, top_p=2.2e-308),
    ],
)
def test_tiny_top_p_returns_the_greedy_tokens(server, params):
    for i, prompt in enumerate(PROMPTS):
        greedy = _tokens(server.url, prompt, temperature=0)
        assert _tokens(server.url, prompt, seed=i, **{"temperature": 1.0, **params}) == greedy, (
            prompt,
            params,
        )
