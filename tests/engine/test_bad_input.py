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


@pytest.mark.parametrize(
    "kwargs, param",
    [
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
        # every number within what the engine holds: 64-bit seeds, int64 counts, finite floats
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=2**64 - 1, n=2), "seed"),  # sample 1 would be seeded 2**64
        (dict(seed=1.5), "seed"),
        (dict(top_k=10**30), "top_k"),
        (dict(max_tokens=2**63), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(n=2**63), "n"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=float("inf")), "min_p"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(repetition_penalty=10**400), "repetition_penalty"),  # too large for a float
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(temperature="hot"), "temperature"),
        (dict(stop=["ok", "\ud800"]), "stop"),  # a lone surrogate is not text
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert param in str(err.value)


def test_the_edges_of_every_range_are_accepted_and_run(llm):
    vocab = llm.engine.core.model_config.vocab_size
    for kwargs in (
        dict(seed=2**64 - 1),
        dict(seed=-(2**63)),
        dict(seed=2**64 - 2, n=2),
        dict(top_k=vocab),
        dict(top_k=-1),
        dict(temperature=1e-6),
        dict(max_tokens=2**63 - 1, min_tokens=1),
        dict(logit_bias={vocab - 1: -100.0}, logprobs=20),
    ):
        out = llm.generate([[5, 6, 7]], SamplingParams(**{"max_tokens": 2, **kwargs}))[0]
        assert len(out.outputs) == kwargs.get("n", 1) and all(
            c.finish_reason for c in out.outputs
        ), kwargs


def test_model_bounds_are_checked_before_anything_is_queued(llm):
    vocab = llm.engine.core.model_config.vocab_size
    with pytest.raises(InvalidParameter, match=f"vocabulary size {vocab}") as err:
        llm.generate(
            [[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=2), SamplingParams(top_k=vocab + 1)]
        )
    assert err.value.param == "top_k"
    assert not llm.engine.has_unfinished_requests()


def test_invalid_text_is_refused_naming_the_field(llm):
    with pytest.raises(InvalidParameter, match="not valid Unicode") as err:
        llm.generate(["abc\ud800"], SamplingParams(max_tokens=2))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidParameter) as err:
        llm.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "\udfff"}])
    assert err.value.param == "messages.1.content"
    # a surrogate pair is one valid character
    assert (
        llm.generate(["\U0001f600 ok"], SamplingParams(max_tokens=1))[0].finish_reason == "length"
    )


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
    out = llm.generate([[7] * 30], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[
        0
    ]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


@pytest.mark.parametrize("salt", ["\ud800", 7, ""])
def test_bad_cache_salt_is_refused_offline(llm, salt):
    # The server's shared check, also for LLM.generate callers: a lone surrogate would
    # otherwise surface as a UnicodeEncodeError from the block-key root.
    with pytest.raises(InvalidParameter) as err:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), cache_salt=salt)
    assert err.value.param == "cache_salt"
    assert not llm.engine.has_unfinished_requests()
