"""Mid-stream resume, the engine's side, without a model: the checks on a continuation's ids
(EngineLimits), the request it becomes (its output counted from the resumed ids on), and the
request body's two forms of it (docs/mutation.md). test_resume.py checks the same end to end."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvmesh.common.block_keys import block_key, root_key
from kvmesh.common.lora import adapter_identity
from kvmesh.engine.model_limits import RESUME_PARAM, EngineLimits, ResumeTooLong
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams
from kvmesh.engine.server import choices
from kvmesh.engine.server.choices import validate_resume
from kvmesh.engine.server.protocol import CompletionRequest

LIMITS = EngineLimits(max_model_len=8, vocab_size=5)


def refusal(prompt, resumed, **sp) -> InvalidParameter:
    with pytest.raises(InvalidParameter) as err:
        LIMITS.validate_resume(prompt, resumed, SamplingParams(**sp))
    return err.value


# -- EngineLimits.validate_resume -------------------------------------------------------------------
def test_no_resumed_id_is_refused_before_anything_else():
    err = refusal([1], [], n=2)
    assert (err.param, str(err)) == (
        RESUME_PARAM,
        f"{RESUME_PARAM} must hold at least one token id",
    )


def test_a_continuation_of_several_samples_is_refused_before_its_ids_are_read():
    err = refusal([1], [99], n=2)
    assert (err.param, str(err)) == (
        "n",
        "a continuation (resume) continues one choice: n must be 1",
    )


@pytest.mark.parametrize("resumed, bad", [([5], 5), ([-1], -1), ([0, 9, -1], 9)])
def test_ids_outside_the_vocabulary_are_refused_naming_the_first(resumed, bad):
    err = refusal([1], resumed)
    assert (err.param, str(err)) == (
        RESUME_PARAM,
        f"token id {bad} is outside the vocabulary [0, 5)",
    )


@pytest.mark.parametrize("resumed", [[0], [4], [0, 4]])
def test_ids_at_both_ends_of_the_vocabulary_pass(resumed):
    LIMITS.validate_resume([1], resumed, SamplingParams())


def test_prompt_and_ids_one_short_of_the_context_leave_one_token():
    LIMITS.validate_resume([1, 1, 1], [2, 2, 2, 2], SamplingParams(max_tokens=5))


def test_prompt_and_ids_filling_the_context_are_too_long_for_the_context():
    err = refusal([1, 1, 1], [2, 2, 2, 2, 2], max_tokens=5)  # also max_tokens: context first
    assert isinstance(err, ResumeTooLong) and err.context is True
    assert err.param == RESUME_PARAM
    assert str(err) == (
        f"the prompt (3 tokens) and {RESUME_PARAM} (5) fill the model's maximum context length "
        "of 8 tokens: nothing is left to generate"
    )


def test_ids_reaching_max_tokens_leave_a_complete_request():
    err = refusal([1], [2, 2, 2], max_tokens=3)
    assert isinstance(err, ResumeTooLong) and err.context is False
    assert str(err) == (
        f"{RESUME_PARAM} holds 3 tokens, max_tokens is 3: "
        "the request is complete, nothing is left to generate"
    )


@pytest.mark.parametrize("max_tokens", [4, None])
def test_ids_below_max_tokens_pass(max_tokens):
    LIMITS.validate_resume([1], [2, 2, 2], SamplingParams(max_tokens=max_tokens))


# -- choices.validate_resume: the error names the entry of resume.choices -------------------------
class Engine:
    def __init__(self, exc):
        self.exc, self.calls = exc, []

    def validate(self, *args):
        self.calls.append(args)
        if self.exc is not None:
            raise self.exc


def renamed(exc, where) -> InvalidParameter:
    with pytest.raises(InvalidParameter) as err:
        asyncio.run(validate_resume(Engine(exc), [1], SamplingParams(), [2], where))
    return err.value


def test_the_engine_checks_prompt_params_and_ids_in_that_order():
    engine, sample = Engine(None), SamplingParams()
    asyncio.run(validate_resume(engine, [1], sample, [2, 3], "resume.choices.0"))
    assert engine.calls == [([1], sample, [2, 3])]


@pytest.mark.parametrize("context", [True, False])
def test_a_too_long_choice_is_named_by_its_entry(context):
    err = renamed(ResumeTooLong(f"{RESUME_PARAM} holds 3 tokens", context), "resume.choices.1")
    assert type(err) is ResumeTooLong and err.context is context
    assert err.param == "resume.choices.1.output_token_ids"
    assert str(err) == "resume.choices.1.output_token_ids holds 3 tokens"


def test_prompt_and_ids_together_size_the_check(monkeypatch):
    # the size decides whether the check leaves the event loop (off_loop); no real pool here:
    # mutmut forks its test runs, and a pool's threads do not survive a fork
    sizes = []

    async def off_loop(size, fn, *args):
        sizes.append(size)
        return fn(*args)

    monkeypatch.setattr(choices, "off_loop", off_loop)
    asyncio.run(validate_resume(Engine(None), [1, 1, 1], SamplingParams(), [2, 2], None))
    assert sizes == [5]


def test_a_bad_id_of_a_choice_is_named_by_its_entry():
    err = renamed(InvalidParameter(RESUME_PARAM, f"{RESUME_PARAM}: token id 9"), "resume.choices.2")
    assert type(err) is InvalidParameter
    assert (err.param, str(err)) == (
        "resume.choices.2.output_token_ids",
        "resume.choices.2.output_token_ids: token id 9",
    )
    assert err.__suppress_context__ is True


@pytest.mark.parametrize(
    "exc, where",
    [
        (InvalidParameter(RESUME_PARAM, "one choice"), None),
        (InvalidParameter("prompt", "prompt is empty"), "resume.choices.0"),
    ],
)
def test_other_errors_go_through_as_they_are(exc, where):
    assert renamed(exc, where) is exc


# -- the request a continuation becomes -------------------------------------------------------------
def request(resumed=(4, 5), max_len=16, block_size=2, **sp) -> Request:
    return Request(
        "r",
        [1, 2, 3],
        SamplingParams(**{"max_tokens": 10, **sp}),
        {0},
        "m",
        block_size,
        max_len,
        cache_salt="salt",
        arrival_time=7.0,
        resumed_token_ids=list(resumed) if resumed is not None else None,
    )


def test_the_resumed_ids_follow_the_prompt_as_output():
    r = request()
    assert r.prompt_token_ids == [1, 2, 3] and r.num_prompt_tokens == 3
    assert r.all_token_ids == [1, 2, 3, 4, 5] and r.num_tokens == 5
    assert r.output_token_ids == [4, 5] and r.num_output_tokens == 2


def test_without_resumed_ids_the_output_is_empty():
    r = request(resumed=None)
    assert r.all_token_ids == [1, 2, 3] and r.output_token_ids == [] and r.num_output_tokens == 0


def test_the_request_keeps_copies_of_the_lists_it_was_given():
    prompt, resumed = [1, 2], [3]
    r = Request("r", prompt, SamplingParams(), set(), "m", 2, 16, resumed_token_ids=resumed)
    r.append_token(4)
    assert prompt == [1, 2] and resumed == [3] and r.prompt_token_ids == [1, 2]


def test_a_new_request_starts_waiting_with_nothing_computed():
    r = request()
    assert r.status is RequestStatus.WAITING and r.request_id == "r"
    assert (r.num_computed_tokens, r.num_cached_tokens, r.num_preemptions) == (0, -1, 0)
    assert r.stop_reason is None and r.structured is None and r.lora is None
    assert r.spec_token_ids == [] and r.num_output_placeholders == 0
    assert r.block_size == 2 and r.arrival_time == 7.0 and r.prompt_logprobs is None


def test_the_arrival_time_defaults_to_now():
    before = time.time()
    r = Request("r", [1], SamplingParams(), set(), "m", 2, 16)
    assert before <= r.arrival_time <= time.time()


@pytest.mark.parametrize("n", [0, 2])
def test_prompt_logprobs_get_one_place_per_prompt_token(n):
    assert request(prompt_logprobs=n).prompt_logprobs == [None, None, None]


@pytest.mark.parametrize(
    "max_len, max_tokens, want", [(16, 10, 10), (16, 13, 13), (16, 14, 13), (16, None, 13)]
)
def test_the_output_limit_is_max_tokens_capped_by_the_context(max_len, max_tokens, want):
    assert request(max_len=max_len, max_tokens=max_tokens).max_output_tokens == want


def test_eos_and_stop_ids_are_kept_unless_eos_is_ignored():
    r = request(stop_token_ids=[3, 3])
    assert r.eos_token_ids == {0} and r.stop_token_ids == {3}
    assert request(ignore_eos=True).eos_token_ids == set()


def test_block_keys_chain_from_the_salted_root_through_the_resumed_ids():
    root = root_key("m", "salt")
    first = block_key(root, [1, 2])
    assert request().block_keys(2) == [first, block_key(first, [3, 4])]
    assert request().block_keys(1) == [first]
    assert request().block_keys(0) == []


def test_a_key_is_made_only_for_the_blocks_asked_for():
    # a partial block's key, made early, would stay wrong once the block fills
    r = request()  # five tokens: two blocks of two and a partial one
    keys = r.block_keys(2)
    r.append_token(6)
    assert r.block_keys(3) == [*keys, block_key(keys[-1], [5, 6])]


def test_an_adapters_blocks_chain_from_its_own_root():
    lora = SimpleNamespace(name="a", digest="d")
    r = Request("r", [1, 2], SamplingParams(), set(), "m", 2, 16, cache_salt="s", lora=lora)
    root = root_key(adapter_identity("m", "a", "d"), "s")
    assert r.lora is lora and r.block_keys(1) == [block_key(root, [1, 2])]


def test_a_token_appended_reaches_the_grammar():
    r = request()
    seen = []
    r.structured = SimpleNamespace(accept=seen.append, done=False)
    r.append_token(3)
    assert seen == [3] and r.all_token_ids[-1] == 3


# -- when it stops: the resumed ids count as output -------------------------------------------------
@pytest.mark.parametrize("min_tokens, want", [(3, RequestStatus.FINISHED_STOPPED), (4, None)])
def test_the_resumed_ids_count_toward_min_tokens(min_tokens, want):
    r = request(min_tokens=min_tokens)
    r.append_token(0)  # eos, as the third output token
    assert r.check_stop() is want
    assert r.stop_reason is None


def test_a_stop_id_is_the_stop_reason():
    r = request(stop_token_ids=[3])
    r.append_token(3)
    assert r.check_stop() is RequestStatus.FINISHED_STOPPED and r.stop_reason == 3


def test_an_eos_clears_an_earlier_stop_reason():
    r = request()
    r.stop_reason = "x"
    r.append_token(0)
    assert r.check_stop() is RequestStatus.FINISHED_STOPPED and r.stop_reason is None


@pytest.mark.parametrize("max_tokens, want", [(3, RequestStatus.FINISHED_LENGTH), (4, None)])
def test_the_resumed_ids_count_toward_max_tokens(max_tokens, want):
    r = request(max_tokens=max_tokens)
    r.append_token(2)
    assert r.check_stop() is want


def test_a_finished_grammar_stops_the_request_before_min_tokens():
    r = request(min_tokens=9)
    r.stop_reason = "x"
    r.structured = SimpleNamespace(accept=lambda t: None, done=True)
    r.append_token(2)
    assert r.check_stop() is RequestStatus.FINISHED_STOPPED and r.stop_reason is None


def test_an_unfinished_grammar_leaves_the_other_rules():
    r = request(max_tokens=3)
    r.structured = SimpleNamespace(accept=lambda t: None, done=False)
    r.append_token(2)
    assert r.check_stop() is RequestStatus.FINISHED_LENGTH


# -- the request body's two forms -------------------------------------------------------------------
def body(resume, **fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", "resume": resume, **fields})


def body_refusal(resume, call, *args, **fields) -> tuple[str, str]:
    with pytest.raises(InvalidParameter) as err:
        getattr(body(resume, **fields), call)(*args)
    return err.value.param, str(err.value)


ONE_FORM = (
    f'{RESUME_PARAM} must be a non-empty list of token ids (resume: {{"output_token_ids": [...]}})'
)


@pytest.mark.parametrize("resume", [None, {"choices": []}])
def test_no_resume_or_the_choices_form_has_no_one_choice_ids(resume):
    assert body(resume).resume_token_ids() is None


def test_the_one_choice_form_gives_its_ids():
    assert body({"output_token_ids": [3, 1]}).resume_token_ids() == [3, 1]


@pytest.mark.parametrize(
    "resume",
    [[1], {}, {"output_token_ids": []}, {"output_token_ids": 3}, {"output_token_ids": [1, True]}],
)
def test_a_malformed_one_choice_form_is_refused(resume):
    assert body_refusal(resume, "resume_token_ids") == (RESUME_PARAM, ONE_FORM)


def test_the_one_choice_form_with_several_samples_is_refused():
    assert body_refusal({"output_token_ids": [1]}, "resume_token_ids", n=2) == (
        "n",
        "a continuation (resume) continues one choice: n must be 1; "
        "several go on with resume.choices",
    )


@pytest.mark.parametrize("resume", [None, [1], {"output_token_ids": [1]}])
def test_not_the_choices_form_has_no_plan(resume):
    assert body(resume).resume_choices(2) is None


def test_the_choices_form_maps_each_index_to_its_ids_in_order():
    resume = {
        "choices": [{"index": 2, "output_token_ids": [5]}, {"index": 0, "output_token_ids": []}]
    }
    plan = body(resume).resume_choices(3)
    assert plan == {2: [5], 0: []} and list(plan) == [2, 0]


ENTRY = '{"index": i, "output_token_ids": [...]}'


@pytest.mark.parametrize(
    "resume, param, message",
    [
        (
            {"choices": [], "output_token_ids": [1]},
            "resume",
            "resume holds either output_token_ids (one choice) or choices",
        ),
        ({"choices": []}, "resume.choices", f"resume.choices must be a non-empty list of {ENTRY}"),
        ({"choices": {}}, "resume.choices", f"resume.choices must be a non-empty list of {ENTRY}"),
        (
            {"choices": [{"index": 0, "output_token_ids": []}, 1]},
            "resume.choices.1",
            f"resume.choices.1 must be an object {ENTRY}",
        ),
        *(
            (
                {"choices": [{"index": index, "output_token_ids": []}]},
                "resume.choices.0.index",
                "resume.choices.0.index must be a choice index, 0 to 1 (prompts x n)",
            )
            for index in (-1, 2, None, True, 1.0)
        ),
        (
            {
                "choices": [
                    {"index": 1, "output_token_ids": []},
                    {"index": 1, "output_token_ids": []},
                ]
            },
            "resume.choices.1.index",
            "resume.choices.1.index: choice 1 is listed twice",
        ),
        *(
            (
                {"choices": [{"index": 0, "output_token_ids": ids}]},
                "resume.choices.0.output_token_ids",
                "resume.choices.0.output_token_ids must be a list of token ids",
            )
            for ids in (None, 3, [1, 2.0], [False])
        ),
    ],
)
def test_a_malformed_choices_form_is_refused_naming_its_entry(resume, param, message):
    assert body_refusal(resume, "resume_choices", 2) == (param, message)


@pytest.mark.parametrize("index", [0, 1])
def test_both_ends_of_the_index_range_are_choices(index):
    assert body({"choices": [{"index": index, "output_token_ids": [1]}]}).resume_choices(2) == {
        index: [1]
    }
