"""Sampling defaults from the model's generation_config.json (vLLM's --generation-config)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.generation_defaults import load_sampling_defaults
from tests.engine.server.conftest import ThreadServer

MAX_LEN = 64


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-with-defaults") / "model"
    shutil.copytree(tiny_model, path)
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": 2,
                "do_sample": False,
                "temperature": 0.0,
                "max_new_tokens": 5,
                "repetition_penalty": 1.3,
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def server(model_with_defaults):
    srv = ThreadServer(
        [
            "--model",
            str(model_with_defaults),
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            str(MAX_LEN),
        ]
    ).start()
    yield srv
    srv.stop()


def chat(server, **body):
    return httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hello there"}], "ignore_eos": True, **body},
    )


def complete(server, prompt, **body):
    return httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt, "ignore_eos": True, **body},
    )


def test_defaults_come_from_the_model_and_requests_override_them(server):
    # temperature 0 from the model: different seeds, same text; max_new_tokens caps the reply.
    a, b = chat(server, seed=1), chat(server, seed=2)
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()["usage"]["completion_tokens"] == 5
    assert (
        a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]
    )
    # The request's own values win.
    assert chat(server, max_tokens=3).json()["usage"]["completion_tokens"] == 3
    hot = [
        chat(server, temperature=1.0, seed=s, max_tokens=12).json()["choices"][0]["message"][
            "content"
        ]
        for s in (1, 2, 3)
    ]
    assert len(set(hot)) > 1


def test_a_default_max_tokens_is_fitted_to_the_context_but_an_explicit_one_is_refused(server):
    prompt = list(
        range(10, 10 + MAX_LEN - 2)
    )  # room for 2 more tokens, the model's default asks for 5
    chat_like = complete(server, prompt, max_tokens=None)
    assert chat_like.status_code == 200, chat_like.text
    assert chat_like.json()["usage"]["completion_tokens"] == 2
    refused = complete(server, prompt, max_tokens=5)
    assert (
        refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    )


def test_generation_config_sources(model_with_defaults, tmp_path, tiny_model):
    model_defaults = {
        "temperature": 0.0,
        "max_tokens": 5,
        "repetition_penalty": 1.3,
    }  # do_sample is not one
    assert load_sampling_defaults("auto", model_with_defaults) == model_defaults
    assert load_sampling_defaults("vllm", model_with_defaults) == {}
    assert load_sampling_defaults(str(model_with_defaults), tiny_model) == model_defaults
    (tmp_path / "model").mkdir()
    assert load_sampling_defaults("auto", tmp_path / "model") == {}  # no file: OpenAI defaults
    with pytest.raises(ValueError, match="holds none"):
        load_sampling_defaults(str(tmp_path), tiny_model)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(
        ValueError, match=r"generation_config\.json: invalid sampling default: top_p"
    ):
        load_sampling_defaults(str(tmp_path), tiny_model)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_sampling_defaults(str(tmp_path), tiny_model)


def test_offline_llm_uses_the_model_defaults(model_with_defaults):
    from kvmesh.engine import LLM
    from kvmesh.engine.config import EngineArgs

    llm = LLM(str(model_with_defaults), num_kv_blocks=32)
    params = llm.get_default_sampling_params()
    assert params.temperature == 0.0 and params.max_tokens == 5 and params.repetition_penalty == 1.3
    out = llm.generate([[5, 6, 7, 8]])[0]
    assert len(out.outputs[0].token_ids) <= 5
    assert (
        LLM.from_engine_args(
            EngineArgs(model=str(model_with_defaults), num_kv_blocks=32, generation_config="vllm")
        )
        .get_default_sampling_params()
        .max_tokens
        == 16
    )
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        EngineArgs(model=str(model_with_defaults), generation_config="/nonexistent").validate()
