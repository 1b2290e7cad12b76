"""engine/structured: spec validation, compile errors naming the field, the bounded cache and its
deadline, and decoding under the mask from a random-logit "model" (only the grammar can make its
output valid), with rollback and reset of the matcher."""

import functools
import json
import threading

import pytest
import torch

from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.structured import bitmask, compiler
from kvmesh.engine.structured.compiler import GrammarCache, GrammarTimeout
from kvmesh.engine.structured.matcher import StructuredState
from kvmesh.engine.structured.params import StructuredOutputsParams as SOP
from tests.engine.structured.specs import CHOICES, PERSON, REGEX, check_json, check_regex

EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({}, "structured_outputs"),
        ({"json": PERSON, "regex": "a"}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1]"}, "structured_outputs.json"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"grammar": 3}, "structured_outputs.grammar"),
        (
            {"json": "{", "field_name": "response_format.json_schema.schema"},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_spec_names_the_field(kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        SOP(**kwargs)
    assert err.value.param == param


def test_key_is_canonical():
    assert SOP(json={"a": 2, "b": 1}).key == SOP(json='{"a": 2,  "b": 1}').key  # whitespace aside
    assert (
        SOP(json={"b": 1, "a": 2}).key != SOP(json={"a": 2, "b": 1}).key
    )  # property order is output order
    assert SOP(json={"a": 1}).key != SOP(regex='{"a":1}').key


@pytest.mark.parametrize(
    "spec, param",
    [
        (SOP(regex="[a-"), "structured_outputs.regex"),
        (SOP(grammar='root ::= "unterminated'), "structured_outputs.grammar"),
        (SOP(json={"type": "foo"}), "structured_outputs.json"),
        (SOP(json={"type": "integer", "minimum": 5, "maximum": 1}), "structured_outputs.json"),
    ],
)
def test_uncompilable_spec_is_invalid_parameter(tokenizer_info, spec, param):
    cache = GrammarCache(tokenizer_info)
    with pytest.raises(InvalidParameter) as err:
        cache.compile_now(spec)
    assert err.value.param == param
    assert "cannot be compiled: " in str(err.value) and ".cc:" not in str(err.value)
    assert len(cache) == 0  # a failure is not cached


def test_cache_shares_and_bounds(tokenizer_info):
    cache = GrammarCache(tokenizer_info, max_entries=2)
    first = cache.compile_now(SOP(regex="a+"))
    assert cache.compile_now(SOP(regex="a+")) is first
    cache.compile_now(SOP(regex="b+"))
    cache.compile_now(SOP(regex="c+"))
    assert len(cache) == 2
    assert cache.compile_now(SOP(regex="a+")) is not first  # evicted: compiled again


def test_slow_compile_fails_alone(tokenizer_info, monkeypatch):
    release = threading.Event()
    real = compiler.compile_spec

    def slow(comp, params):
        if params.regex == "slow":
            release.wait(10)
        return real(comp, params)

    monkeypatch.setattr(compiler, "compile_spec", slow)
    cache = GrammarCache(tokenizer_info, timeout_s=0.2)
    slow_handle = cache.submit(SOP(regex="slow"))
    fast = cache.compile_now(SOP(regex="fast"))
    assert fast is not None
    import time

    time.sleep(0.25)
    assert slow_handle.ready()
    with pytest.raises(GrammarTimeout):
        slow_handle.result()
    release.set()


@functools.lru_cache(maxsize=1)
def _closing_tokens(tokenizer):
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([3.0 * any(c in t for c in "})") + 5.0 * ('"' in t) for t in vocab])


def _biased_noise(tokenizer, seed):
    """Random logits with a pull toward closing characters, so a walk ends within a few dozen
    tokens; the text still only parses because of the mask."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(tokenizer), generator=gen) * 2 + _closing_tokens(tokenizer)


def _generate(cache, tokenizer, spec, seed, greedy, max_tokens=200):
    state = StructuredState(cache.compile_now(spec), eos_token_ids=[tokenizer.eos_token_id])
    mask = bitmask.allocate(2, len(tokenizer))
    base = _biased_noise(tokenizer, seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        # Row 0 unconstrained, row 1 constrained: the mask touches row 1 only.
        logits = torch.stack([base, base + torch.randn(len(tokenizer), generator=gen)])
        rows = bitmask.fill(mask, [None, state])
        bitmask.apply(logits, mask, rows, len(tokenizer))
        assert torch.isfinite(logits[0]).all()
        token = (
            int(logits[1].argmax())
            if greedy
            else int(torch.multinomial(logits[1].softmax(-1), 1, generator=gen))
        )
        assert state.accept([token]) == 1
        if state.finished:
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"no end within {max_tokens} tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_kind_decodes_to_valid_output(tokenizer, tokenizer_info, greedy, seed):
    cache = GrammarCache(tokenizer_info)
    check_json(_generate(cache, tokenizer, SOP(json=PERSON), seed, greedy), PERSON)
    if greedy:  # sampled free-form keys and strings run past any small bound
        assert isinstance(
            json.loads(_generate(cache, tokenizer, SOP(json_object=True), seed, greedy)), dict
        )
    check_regex(_generate(cache, tokenizer, SOP(regex=REGEX), seed, greedy))
    assert _generate(cache, tokenizer, SOP(choice=CHOICES), seed, greedy) in CHOICES
    text = _generate(cache, tokenizer, SOP(grammar=EBNF), seed, greedy)
    check_regex(text, r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))*\)")


def _mask_of(state, vocab):
    m = bitmask.allocate(1, vocab)
    state.fill_bitmask(m, 0)
    return m.clone()


def test_rollback_and_reset_restore_the_state(tokenizer, tokenizer_info):
    cache = GrammarCache(tokenizer_info)
    state = StructuredState(
        cache.compile_now(SOP(regex=REGEX)), eos_token_ids=[tokenizer.eos_token_id]
    )
    prefix = tokenizer.encode("abc", add_special_tokens=False)
    assert state.accept(prefix) == len(prefix)
    before = _mask_of(state, len(tokenizer))
    drafts = tokenizer.encode("d@xy.", add_special_tokens=False)
    assert state.validate(drafts) == len(drafts)
    assert torch.equal(_mask_of(state, len(tokenizer)), before)  # validate left the state alone
    bad = drafts[:1] + tokenizer.encode("!!!", add_special_tokens=False)
    assert state.accept(bad) == 1  # the grammar refuses the punctuation
    state.rollback(1)
    assert torch.equal(_mask_of(state, len(tokenizer)), before)
    state.reset(prefix)
    assert state.num_accepted == len(prefix) and torch.equal(
        _mask_of(state, len(tokenizer)), before
    )
    with pytest.raises(ValueError):
        state.reset(tokenizer.encode("NOT AN ADDRESS", add_special_tokens=False))


def test_padded_vocabulary_columns_are_masked(tokenizer, tokenizer_info):
    cache = GrammarCache(tokenizer_info)
    state = StructuredState(cache.compile_now(SOP(choice=CHOICES)))
    vocab = len(tokenizer)
    mask = bitmask.allocate(2, vocab)
    logits = torch.zeros(2, vocab + 64)
    bitmask.apply(logits, mask, bitmask.fill(mask, [state, None]), vocab)
    assert torch.isinf(logits[0, vocab:]).all() and torch.isfinite(logits[1]).all()
    allowed = torch.isfinite(logits[0]).nonzero()[:, 0].tolist()
    assert allowed and all(
        any(c.startswith(tokenizer.decode([t])) for c in CHOICES) for t in allowed
    )


def test_choices_with_escapes_and_non_ascii_text(tokenizer, tokenizer_info):
    cache = GrammarCache(tokenizer_info)
    choices = ["smile 😀", 'say "hi"\n', "back\\slash", "é"]
    compiled = cache.compile_now(SOP(choice=choices))
    for text in choices:
        state = StructuredState(compiled, eos_token_ids=[tokenizer.eos_token_id])
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert state.accept(ids + [tokenizer.eos_token_id]) == len(ids) + 1 and state.finished, text


@pytest.mark.parametrize("rows", [[0, 2, 3], [1], [0, 1, 2, 3]])
def test_cpu_apply_matches_xgrammars_kernel(rows):
    import xgrammar as xgr

    vocab = 1000
    gen = torch.Generator().manual_seed(len(rows))
    mask = torch.randint(
        -(2**31), 2**31 - 1, (4, (vocab + 31) // 32), generator=gen, dtype=torch.int64
    ).to(torch.int32)
    logits = torch.randn(4, vocab + 24, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, mask, vocab_size=vocab, indices=rows)
    expected[rows, vocab:] = float("-inf")
    bitmask.apply(logits, mask, rows, vocab)
    assert torch.equal(
        logits, expected
    )  # the numpy path, token for token what xgrammar's kernel does
    assert torch.isinf(logits[rows, :vocab]).any() and torch.isfinite(logits[rows, :vocab]).any()
