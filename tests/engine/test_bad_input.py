"""Bad input fails fast with an error that names the problem, and leaves nothing behind."""

from __future__ import annotations

import pytest

from kvmesh.engine import LLM, InvalidParameter, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=16, max_model_len=128)


def test_empty_prompt(llm):
    for prompt in ("", []):
        with pytest.raises(InvalidParameter, match="empty") as err:
            llm.generate([prompt], SamplingParams(max_tokens=2))
        assert err.value.param == "prompt"


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(InvalidParameter, match=r"200 tokens.*maximum context length is 128") as err:
        llm.generate([[5] * 200], SamplingParams(max_tokens=2))
    assert err.value.param == "prompt"
    assert not llm.engine.has_unfinished_requests()


def test_one_bad_prompt_rejects_the_whole_batch_before_queueing(llm):
    with pytest.raises(InvalidParameter):
        llm.generate([[5, 6, 7], [5] * 500], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats().kv_cache_usage == 0.0


def test_token_id_outside_vocabulary(llm):
    with pytest.raises(InvalidParameter, match="outside the vocabulary"):
        llm.generate([[1, 10**7]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=50), "logprobs"),
    (dict(n=0), "n"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert param in str(err.value)


def test_unknown_engine_argument(tiny_llama_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny_llama_dir, max_num_seq=4)


def test_max_model_len_that_cannot_fit_the_cache(tiny_llama_dir):
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        LLM(tiny_llama_dir, num_kv_blocks=4, max_model_len=512)


def test_unknown_model():
    with pytest.raises(FileNotFoundError, match="neither a built-in model"):
        LLM("/nonexistent/model")


def test_generation_stops_at_max_model_len(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=8, max_model_len=40)
    out = llm.generate([[7] * 30], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
