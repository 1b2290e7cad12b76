"""Mid-stream resume in the engine: a request continued from its first k output ids (a
continuation, as the router sends after a replica died) goes on exactly as the uninterrupted run:
greedy and seeded alike, its text picking up where the streamed text stopped (multi-byte
characters split at the seam included), stop strings over the whole output (one straddling the
seam), logprobs for the new tokens only. Seeded draws are a function of (seed, position)."""

from __future__ import annotations

import pytest

from kvmesh.engine import LLM, SamplingParams
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.model_limits import RESUME_PARAM
from kvmesh.engine.sampler import seeded_uniform
from kvmesh.engine.sampling_params import InvalidParameter
from tests.engine.conftest import random_prompts

PROMPT = random_prompts(1, 12, 12, seed=41)[0]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=128)


def run(
    llm: LLM, params: SamplingParams, resume: list[int] | None = None, prompt: list[int] = PROMPT
):
    """The request's final output and its text deltas, one per step (as a stream sends them)."""
    rid = llm.engine.add_request(prompt, params, resume_token_ids=resume)
    deltas, final = [], None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id == rid:
                deltas.append((list(out.delta_token_ids), out.delta_text))
                final = out if out.finished else final
    return final, deltas


def streamed_text(deltas, k: int) -> str:
    """The text a client had when the stream broke after its k-th token."""
    text, n = "", 0
    for ids, delta in deltas:
        if n >= k:
            break
        n += len(ids)
        text += delta
    return text


PARAMS = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, seed=1234),
    "seeded-top-p-penalties": dict(
        temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.5, repetition_penalty=1.2
    ),
}


@pytest.mark.parametrize("kind", list(PARAMS))
def test_a_continuation_from_any_point_equals_the_uninterrupted_run(llm, kind):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, **PARAMS[kind])
    whole, deltas = run(llm, params)
    ids = whole.token_ids
    assert len(ids) == MAX_TOKENS
    for k in (1, 2, 5, MAX_TOKENS - 1):
        cont, cont_deltas = run(llm, params, resume=ids[:k])
        assert ids[:k] + cont.token_ids == ids, (kind, k)
        # no duplicated or missing text at the seam: the stream before + the continuation's
        assert streamed_text(deltas, k) + "".join(d for _, d in cont_deltas) == streamed_text(
            deltas, MAX_TOKENS
        )
        assert cont.text == "".join(d for _, d in cont_deltas)
        assert cont.finish_reason == "length"
        # logprobs of the new tokens only, as the uninterrupted run scored them
        assert [lp.token_id for lp in cont.outputs[0].logprobs] == ids[k:]
        for got, want in zip(cont.outputs[0].logprobs, whole.outputs[0].logprobs[k:]):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_min_tokens_counts_the_resumed_output(llm):
    """min_tokens bans EOS over the whole output: resumed past it, EOS is allowed again."""
    eos = next(iter(llm.engine.core.eos_token_ids))
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, logit_bias={eos: 100.0})
    whole, _ = run(llm, params)
    assert len(whole.token_ids) == 4 and whole.token_ids[-1] == eos  # EOS as soon as allowed
    cont, _ = run(llm, params, resume=whole.token_ids[:2])
    assert whole.token_ids[:2] + cont.token_ids == whole.token_ids
    cont, _ = run(llm, params, resume=whole.token_ids[:3])
    assert cont.token_ids == [eos] and cont.finish_reason == "stop"


def test_a_stop_string_straddling_the_seam_stops_the_continuation(llm):
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    _, deltas = run(llm, plain)
    # a stop string made of the end of one token's text and the start of the next's
    at = next(
        i for i in range(3, len(deltas) - 1) if deltas[i][1].strip() and deltas[i + 1][1].strip()
    )
    stop = deltas[at][1][-1] + deltas[at + 1][1][0]
    for include in (False, True):
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        whole, whole_deltas = run(llm, params)
        assert whole.finish_reason == "stop" and whole.outputs[0].stop_reason == stop
        ids = whole.token_ids
        k = len(ids) - 1  # the break falls inside the stop string: its last token is still to come
        seen = streamed_text(whole_deltas, k)
        assert llm.tokenizer.decode(ids[:k]).endswith(
            stop[0]
        )  # the stop string begins before the seam
        assert (
            seen.endswith(stop[0]) == include
        )  # ... held back from the client unless it is output
        cont, cont_deltas = run(llm, params, resume=ids[:k])
        assert cont.token_ids == ids[k:]
        assert cont.finish_reason == "stop" and cont.outputs[0].stop_reason == stop
        assert seen + "".join(d for _, d in cont_deltas) == streamed_text(whole_deltas, len(ids))
        assert cont.text == (stop[1:] if include else "")


@pytest.mark.parametrize("stop", [[], ["é ☕"], ["ï"]])
def test_the_detokenizer_resumes_at_any_id_without_duplicating_or_losing_text(llm, stop):
    """Byte-level ids split multi-byte characters: at a seam inside one, its text was not sent
    before the break; the continuation sends it, once. A stop string may start before the seam."""
    tok = llm.tokenizer
    prompt, ids = tok.encode("Say:"), tok.encode("naïve café ☕ done, ok")
    assert any(
        tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids))
    )  # a split character

    def feed(detok, rest):
        out = []
        for t in rest:
            delta, matched = detok.update([t])
            out.append(delta)
            if matched:
                return out
        return out + [detok.flush()]  # ended by its length: the held-back end goes out

    whole = feed(IncrementalDetokenizer(tok, prompt, stop), ids)
    for k in range(1, len(whole)):
        resumed = IncrementalDetokenizer(tok, prompt, stop, emitted_token_ids=ids[:k])
        assert resumed.num_sent == len(
            "".join(whole[:k])
        )  # what the client had, from the ids alone
        assert "".join(whole[:k]) + "".join(feed(resumed, ids[k:])) == "".join(whole), k


def test_seeded_draws_are_a_function_of_seed_and_position():
    draws = [seeded_uniform(5, p) for p in range(2000)]
    assert draws == [seeded_uniform(5, p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03  # about uniform
    assert sum(u < 0.1 for u in draws) == pytest.approx(200, abs=45)
    assert draws[:50] != [seeded_uniform(6, p) for p in range(50)]
    assert seeded_uniform(5, 3, stream=1) != seeded_uniform(5, 3)
    assert (
        0.0 <= seeded_uniform(-(2**63), 0) < 1.0 and 0.0 <= seeded_uniform(2**64 - 1, 10**9) < 1.0
    )


@pytest.mark.parametrize(
    "resume, max_tokens, param, words",
    [
        ([], 8, RESUME_PARAM, "at least one"),
        ([10**9], 8, RESUME_PARAM, "outside the vocabulary"),
        ([5] * 8, 8, RESUME_PARAM, "nothing is left"),
        ("fill", None, RESUME_PARAM, "context length"),
        ([5], dict(n=2), "n", "n must be 1"),
    ],
)
def test_bad_continuations_are_refused_naming_the_field(llm, resume, max_tokens, param, words):
    if resume == "fill":  # prompt + resumed ids fill the context
        resume = [5] * (llm.engine.max_model_len - len(PROMPT))
    params = (
        SamplingParams(**max_tokens)
        if isinstance(max_tokens, dict)
        else SamplingParams(max_tokens=max_tokens)
    )
    with pytest.raises(InvalidParameter) as err:
        llm.engine.core.limits.validate_resume(PROMPT, resume, params)
    assert err.value.param == param and words in str(err.value)
    if param != "n":  # the engine's own entry point refuses it too, leaving nothing behind
        with pytest.raises(InvalidParameter):
            llm.engine.add_request(PROMPT, params, resume_token_ids=resume)
        assert not llm.engine.states


def test_seeded_tokens_are_the_same_with_async_scheduling_and_resumed_there(llm, tiny_llama_dir):
    """Async scheduling samples a step before the previous step's token is known: the position of
    each draw comes from the schedule, so seeded requests draw exactly as in synchronous steps."""
    ahead = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=128, async_scheduling=True)
    assert ahead.engine.core.async_scheduling
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=31, ignore_eos=True)
    whole, _ = run(llm, params)
    async_whole, _ = run(ahead, params)
    assert async_whole.token_ids == whole.token_ids
    cont, _ = run(ahead, params, resume=whole.token_ids[:5])
    assert whole.token_ids[:5] + cont.token_ids == whole.token_ids


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=3)])
def test_a_constrained_request_resumes_under_its_grammar(llm, sampling):
    """Structured outputs: the continuation's matcher starts past the resumed ids (it is synced to
    the output), so the output goes on under the grammar exactly as uninterrupted."""
    from kvmesh.engine.structured.params import StructuredOutputsParams

    params = SamplingParams(
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex="(ab|cd)[a-z]{6,9}!"),
        **sampling,
    )
    whole, _ = run(llm, params)
    ids = whole.token_ids
    assert whole.finish_reason == "stop" and whole.text.endswith("!") and len(ids) >= 4
    for k in (1, 3, len(ids) - 1):
        cont, _ = run(llm, params, resume=ids[:k])
        assert ids[:k] + cont.token_ids == ids, k
        assert cont.finish_reason == "stop"


def test_a_step_scheduled_ahead_carries_the_output_positions_it_samples(tiny_llama_dir):
    """Async scheduling: step N+1 is prepared before step N's token is known, so the request's
    output length is behind at that point; the rows carry the position each draw is for."""
    ahead = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=128, async_scheduling=True)
    core = ahead.engine.core
    ahead.engine.add_request(
        PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=2, ignore_eos=True)
    )
    seen = []
    for _ in range(3):
        core.step()
        seen.append(core._in_flight[-1].prepared.sample_positions if core._in_flight else None)
    assert seen[:3] == [[0], [1], [2]]
    req = next(iter(core.scheduler.requests.values()))
    assert req.num_output_tokens < 3  # the last step's position was ahead of the known output
    while ahead.engine.has_unfinished_requests():
        ahead.engine.step()


def test_llm_generate_resumes_each_prompt_after_its_ids(llm):
    prompts = random_prompts(2, 6, 10, seed=8)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    whole = [o.token_ids for o in llm.generate(prompts, params)]
    cont = llm.generate(prompts, params, resume_token_ids=[whole[0][:3], whole[1][:7]])
    assert [whole[0][:3] + cont[0].token_ids, whole[1][:7] + cont[1].token_ids] == whole
    with pytest.raises(InvalidParameter) as err:  # checked before anything is queued
        llm.generate(prompts, params, resume_token_ids=[whole[0][:3], whole[1]])
    assert err.value.param == RESUME_PARAM and not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def real(smollm2_dir):
    return LLM(smollm2_dir, dtype="float32", num_kv_blocks=64)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=17)]
)
def test_the_builtin_model_resumes_a_chat_answer(real, sampling):
    """The real tokenizer and weights: a chat answer continued from any point is the same answer."""
    prompt = real.engine.apply_chat_template(
        [{"role": "user", "content": "Name three fruits, then say ¡adiós!"}]
    )
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=["\n\n\n"], **sampling)
    whole, deltas = run(real, params, prompt=prompt)
    ids = whole.token_ids
    for k in (1, 6, len(ids) - 1):
        cont, _ = run(real, params, resume=ids[:k], prompt=prompt)
        assert ids[:k] + cont.token_ids == ids, k
        assert streamed_text(deltas, k) + cont.text == whole.text, k
