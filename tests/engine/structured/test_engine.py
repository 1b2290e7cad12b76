"""Constrained decoding through the engine (LLM.generate) on a tiny random-weight model, where only
the grammar can make the output valid: every kind under greedy and sampled decoding, batched with
unconstrained requests (whose tokens do not change), with chunked prefill, prefix hits,
preemption, speculation and n > 1; a bad spec refused before anything runs; a grammar that is
slow to compile holds back only its own request, and one past its deadline fails alone."""

import json
import re
import threading
import time

import pytest

from kvmesh.engine import LLM, InvalidParameter, SamplingParams
from kvmesh.engine.structured import StructuredOutputsParams as SOP
from kvmesh.engine.structured import bitmask, compiler
from kvmesh.engine.structured.matcher import StructuredState
from tests.engine.structured.specs import CHOICES, PERSON, REGEX, check_json, check_regex

EBNF = 'root ::= "(" num ("," num)? ("," num)? ")"\nnum ::= [0-9] | [1-9] [0-9]'
EBNF_RE = r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9])){0,2}\)"

SPECS = {
    "json": SOP(json=PERSON),
    "regex": SOP(regex=REGEX),
    "choice": SOP(choice=CHOICES),
    "grammar": SOP(grammar=EBNF),
    "json_object": SOP(json_object=True),
}
# Prompts long enough to take several prefill chunks (max_num_batched_tokens=32); the JSON example
# in them gives n-gram speculation drafts that the grammar allows.
PROMPTS = [
    f"Record {i}: " + 'a person as JSON {"name":"ann","age":41,"kind":"a"} and one more, ' * 4
    for i in range(4)
]


def check_valid(kind: str, text: str) -> None:
    if kind == "json":
        check_json(text, PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        check_regex(text)
    elif kind == "choice":
        assert text in CHOICES
    else:
        check_regex(text, EBNF_RE)


def follows(llm, spec: SOP, token_ids: list[int]) -> bool:
    """Every output token is one the grammar allows (a fresh matcher takes them all)."""
    core = llm.engine.core
    state = StructuredState(
        core.structured_backend().cache.compile_now(spec), sorted(core.eos_token_ids)
    )
    return state.accept(list(token_ids)) == len(token_ids)


def check_output(llm, kind: str, out) -> None:
    o = out.outputs[0]
    assert follows(llm, SPECS[kind], o.token_ids)
    if kind == "json_object" and o.finish_reason == "length":
        return  # free-form keys and strings: a random model may run to max_tokens, on the grammar still
    assert o.finish_reason == "stop", (kind, o.text)
    check_valid(kind, o.text)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=32,
        async_scheduling=False,
    )


def params(kind=None, **kw):
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(structured_outputs=SPECS[kind] if kind else None, **kw)


@pytest.mark.parametrize("sampled", [False, True])
def test_every_kind_batched_with_unconstrained(llm, sampled):
    kinds = list(SPECS)
    plain = llm.generate(PROMPTS, params(max_tokens=24))
    extra = {"temperature": 1.0, "seed": 11} if sampled else {}
    mixed = llm.generate(
        PROMPTS + PROMPTS[:1] * len(kinds),
        [params(max_tokens=24)] * len(PROMPTS) + [params(k, **extra) for k in kinds],
    )
    for a, b in zip(plain, mixed[: len(PROMPTS)]):
        assert (
            a.outputs[0].token_ids == b.outputs[0].token_ids
        )  # the constrained rows change nothing else
    for kind, out in zip(kinds, mixed[len(PROMPTS) :]):
        check_output(llm, kind, out)


def test_unconstrained_output_is_not_valid_without_the_grammar(llm):
    """The tiny model alone does not write these: the grammar is what makes the tests above pass."""
    outs = llm.generate(PROMPTS[:2], params(max_tokens=24))
    for out in outs:
        with pytest.raises(Exception):
            check_valid("json", out.outputs[0].text)


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate(PROMPTS[:1], params("json", n=3, temperature=1.0, seed=5))[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        check_json(o.text, PERSON)


def test_prefix_hit_gives_the_same_output(llm):
    first = llm.generate(PROMPTS[3:], params("json"))[0]
    again = llm.generate(PROMPTS[3:], params("json"))[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    check_output(llm, "json", again)


def test_preemption_replays_the_matcher(llm, tiny_llama_dir):
    kinds = ["json", "regex", "grammar", "choice"]
    ps = [params(k, max_tokens=64) for k in kinds] * 2
    prompts = [f"Entry {i}. " + PROMPTS[i % 4] for i in range(8)]  # ~4 blocks each, none shared
    calm = llm.generate(prompts, ps)
    tight = LLM(
        tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=14,
        max_num_batched_tokens=32,
        async_scheduling=False,
    )
    outs = tight.generate(prompts, ps)
    assert tight.stats().num_preemptions > 0
    for kind, a, b in zip(kinds * 2, calm, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        check_output(tight, kind, b)


SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "acceptance_threshold": 0.0,
    "disable_by_batch_size": None,
}


@pytest.fixture(scope="module")
def spec_llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        speculative_config=SPEC,
    )


def spy_drafts(monkeypatch) -> dict[bool, list[int]]:
    """Draft counts of the verifying rows of each step, by whether the request is constrained."""
    drafted: dict[bool, list[int]] = {True: [], False: []}
    real = bitmask.for_step

    def spy(plain_rows, spec_rows, vocab):
        for r, d in spec_rows:
            drafted[r.structured is not None].append(len(d))
        return real(plain_rows, spec_rows, vocab)

    monkeypatch.setattr(bitmask, "for_step", spy)
    return drafted


def test_speculation_verifies_drafts_under_the_mask(llm, spec_llm, monkeypatch):
    kinds = ["json", "regex", "grammar", "json_object"]
    ps = [params(k) for k in kinds] + [params(max_tokens=24)]
    prompts = PROMPTS[: len(ps)] + PROMPTS[:1]
    plain = llm.generate(prompts, ps)
    drafted = spy_drafts(monkeypatch)
    outs = spec_llm.generate(prompts, ps)
    assert sum(drafted[True]) > 0  # constrained rows verified drafts
    for a, b in zip(plain, outs):  # greedy: token for token what plain decoding emits
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for kind, out in zip(kinds, outs):
        check_output(spec_llm, kind, out)
    sampled = spec_llm.generate(
        prompts[: len(kinds)], [params(k, temperature=1.0, seed=3) for k in kinds]
    )
    for kind, out in zip(kinds, sampled):
        check_output(spec_llm, kind, out)


@pytest.mark.parametrize("order", ["UCUC", "UUCC", "CUUC", "UCCU", "CCUU"])
def test_speculation_with_constrained_requests_anywhere_in_the_batch(
    llm, spec_llm, monkeypatch, order
):
    """Constrained and unconstrained requests drafting together, in each order: every output is
    what plain greedy decoding writes, each under its own grammar or none. Biased toward "#", then
    "%": an unconstrained request writes "#" and drafts it every step, one constrained to ``%+``
    writes and drafts "%" only under its mask; an unbiased ``json`` one mostly takes a plain row
    beside them, where a mask meant for another row would refuse its JSON."""
    tok = llm.engine.tokenizer
    [hash_, percent] = [tok.encode(c, add_special_tokens=False)[0] for c in "#%"]
    bias = {hash_: 100.0, percent: 50.0}
    specs = iter([SOP(regex="%+"), SPECS["json"]])
    wanted = [next(specs) if k == "C" else None for k in order]
    ps = [
        SamplingParams(
            structured_outputs=spec,
            max_tokens=32,
            temperature=0.0,
            logit_bias=None if spec is SPECS["json"] else bias,
        )
        for spec in wanted
    ]
    prompts = [f"{i} " + PROMPTS[i % 4] for i in range(len(order))]
    plain = llm.generate(prompts, ps)
    drafted = spy_drafts(monkeypatch)
    outs = spec_llm.generate(prompts, ps)
    assert sum(drafted[True]) > 0 and sum(drafted[False]) > 0
    for spec, a, b in zip(wanted, plain, outs):
        o = b.outputs[0]
        assert a.outputs[0].token_ids == o.token_ids, (order, spec)
        if spec is None:
            assert set(o.text) == {"#"}
        elif spec is SPECS["json"]:
            check_output(spec_llm, "json", b)
        else:
            assert set(o.text) == {"%"} and follows(spec_llm, spec, o.token_ids)


@pytest.mark.parametrize(
    "spec, param",
    [
        (SOP(regex="[a-"), "structured_outputs.regex"),
        (SOP(json={"type": "integer", "minimum": 5, "maximum": 1}), "structured_outputs.json"),
        (SOP(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    ],
)
def test_bad_spec_refused_before_anything_runs(llm, spec, param):
    with pytest.raises(InvalidParameter) as err:
        llm.generate(PROMPTS[:2], [params(), SamplingParams(structured_outputs=spec)])
    assert err.value.param == param
    assert not llm.engine.has_unfinished_requests()


def _run(core, request_ids):
    """Step the core until these requests finish: {request id: (finish reason, tokens, error)}."""
    done, tokens = {}, {rid: [] for rid in request_ids}
    deadline = time.monotonic() + 60
    while len(done) < len(request_ids) and time.monotonic() < deadline:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = (out.finish_reason, tokens[out.request_id], out.error)
    return done


def test_slow_grammar_holds_back_its_request_only(llm, monkeypatch):
    core = llm.engine.core
    release = threading.Event()
    real = compiler.compile_spec

    def slow(comp, spec):
        if spec.regex == "slow[a-z]{3}":
            release.wait(30)
        return real(comp, spec)

    monkeypatch.setattr(compiler, "compile_spec", slow)
    ids = llm.engine.tokenizer.encode(PROMPTS[0])
    core.add_request(
        "slow",
        ids,
        SamplingParams(
            max_tokens=16, temperature=0.0, structured_outputs=SOP(regex="slow[a-z]{3}")
        ),
    )
    core.add_request("plain", ids, SamplingParams(max_tokens=8, temperature=0.0))
    done = _run(core, ["plain"])
    assert done["plain"][0] == "length"  # finished while the other's grammar compiles
    assert (
        "slow" in core.scheduler.requests
        and core.scheduler.requests["slow"].num_computed_tokens == 0
    )
    release.set()
    done = _run(core, ["slow"])
    assert done["slow"][0] == "stop"
    assert re.fullmatch(
        "slow[a-z]{3}", llm.engine.tokenizer.decode(done["slow"][1], skip_special_tokens=True)
    )


def test_grammar_past_its_deadline_fails_alone(llm, monkeypatch):
    core = llm.engine.core
    release = threading.Event()
    real = compiler.compile_spec

    def stuck(comp, spec):
        if spec.regex == "stuck":
            release.wait(30)
        return real(comp, spec)

    monkeypatch.setattr(compiler, "compile_spec", stuck)
    monkeypatch.setattr(core.structured_backend().cache, "timeout_s", 0.3)
    ids = llm.engine.tokenizer.encode(PROMPTS[1])
    core.add_request(
        "stuck", ids, SamplingParams(max_tokens=8, structured_outputs=SOP(regex="stuck"))
    )
    core.add_request(
        "fine",
        ids,
        SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=SPECS["choice"]),
    )
    core.add_request("plain", ids, SamplingParams(max_tokens=8, temperature=0.0))
    try:
        done = _run(core, ["stuck", "fine", "plain"])
    finally:
        release.set()
    assert done["stuck"][0] == "error" and "deadline" in done["stuck"][2]
    assert done["plain"][0] == "length"
    assert done["fine"][0] == "stop"
    assert llm.engine.tokenizer.decode(done["fine"][1], skip_special_tokens=True) in CHOICES


def test_async_scheduling_steps_constrained_requests_synchronously(llm, tiny_llama_dir):
    """A constrained request's mask needs its previous token on the host: while one runs, the
    async engine takes synchronous steps, with the same outputs."""
    kinds = ["json", "choice"]
    prompts = PROMPTS[:3]
    ps = [params(k) for k in kinds] + [params(max_tokens=24)]
    sync = llm.generate(prompts, ps)
    overlapped = LLM(
        tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=32,
        async_scheduling=True,
    )
    outs = overlapped.generate(prompts, ps)
    assert overlapped.engine.core.num_sync_steps > 0
    for a, b in zip(sync, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    plain = overlapped.generate(prompts[2:], [params(max_tokens=8)])[
        0
    ]  # none constrained: async again
    assert plain.outputs[0].token_ids == sync[2].outputs[0].token_ids[:8]
    assert overlapped.engine.core.num_async_steps > 0


def test_resumed_output_rebuilds_the_matcher(llm):
    """A continuation (mid-stream resume) arrives with output the matcher never saw: it is replayed
    into the matcher, and the continuation is what the uninterrupted run wrote; output the grammar
    refuses fails that request alone."""
    core, tok = llm.engine.core, llm.engine.tokenizer
    ids = tok.encode(PROMPTS[2])
    whole = llm.generate([ids], params("json"))[0].outputs[0].token_ids
    core.add_request("resumed", ids, params("json"), resumed_token_ids=list(whole[:5]))
    core.add_request(
        "off-grammar",
        ids,
        params("json"),
        resumed_token_ids=tok.encode("hello", add_special_tokens=False),
    )
    core.add_request("plain", ids, params(max_tokens=4))
    done = _run(core, ["resumed", "off-grammar", "plain"])
    assert done["resumed"][0] == "stop" and list(whole[:5]) + done["resumed"][1] == list(whole)
    assert done["off-grammar"][0] == "error" and done["plain"][0] == "length"
