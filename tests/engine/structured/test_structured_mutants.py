"""Structured outputs' bookkeeping on a five-token vocabulary: the bitmask rows filled and applied
(which columns, which rows, which path), a request's grammar while it compiles and after, and the
matcher state's counts through accept, validate, rollback and reset (docs/mutation.md).
test_spec_masks.py checks which rows of a step get which mask; these pin the rest exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import xgrammar as xgr

from kvmesh.engine.structured import bitmask
from kvmesh.engine.structured.backend import RequestGrammar
from kvmesh.engine.structured.matcher import StructuredState

A, X, BANG, EOS, B = range(5)  # the vocabulary, in order
VOCAB = 5
ONLY_X = 1 << X  # the mask word of a fresh "x+" grammar
X_OR_EOS = ONLY_X | 1 << EOS  # ... after one "x"
X_OR_B = ONLY_X | 1 << B  # ... after one "x", with B as the stop token


@pytest.fixture(scope="module")
def x_plus():
    """``x+``, stopped by EOS (the tokenizer's stop token) unless a state names its own."""
    info = xgr.TokenizerInfo(["a", "x", "!", "<eos>", "b"], stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_regex("x+")


def word(state: StructuredState) -> int:
    mask = bitmask.allocate(1, VOCAB)
    state.fill_bitmask(mask, 0)
    return int(mask[0, 0])


# -- StructuredState --------------------------------------------------------------------------------
def test_a_new_state_has_accepted_nothing(x_plus):
    state = StructuredState(x_plus)
    assert state.num_accepted == 0 and not state.finished and word(state) == ONLY_X


def test_accept_counts_the_tokens_before_the_first_refused(x_plus):
    state = StructuredState(x_plus)
    assert state.accept([X, X, BANG, X]) == 2 and state.num_accepted == 2
    assert state.accept([]) == 0 and state.accept([X]) == 1 and state.num_accepted == 3


def test_nothing_is_accepted_after_the_stop_token(x_plus):
    state = StructuredState(x_plus)
    assert state.accept([X, EOS, X]) == 2 and state.finished and state.num_accepted == 2


def test_a_states_own_stop_tokens_replace_the_tokenizers(x_plus):
    state = StructuredState(x_plus, [B])
    assert state.accept([X]) == 1 and word(state) == X_OR_B
    assert state.accept([EOS]) == 0 and state.accept([B]) == 1 and state.finished


def test_no_stop_tokens_keep_the_tokenizers(x_plus):
    for stop in (None, []):
        state = StructuredState(x_plus, stop)
        state.accept([X])
        assert word(state) == X_OR_EOS


def test_validate_counts_and_leaves_the_state_as_it_was(x_plus):
    state = StructuredState(x_plus)
    state.accept([X])
    assert state.validate([X, X, BANG]) == 2
    assert state.num_accepted == 1 and word(state) == X_OR_EOS
    assert state.validate([EOS]) == 1 and not state.finished


def test_rollback_undoes_that_many_tokens(x_plus):
    state = StructuredState(x_plus)
    state.accept([X, X, X])
    state.rollback(2)
    assert state.num_accepted == 1 and word(state) == X_OR_EOS
    state.rollback(0)
    assert state.num_accepted == 1
    state.rollback(1)
    assert state.num_accepted == 0 and word(state) == ONLY_X


def test_reset_rebuilds_the_state_for_the_outputs(x_plus):
    state = StructuredState(x_plus, [B])
    state.accept([X, B])
    state.reset([X, X])
    assert state.num_accepted == 2 and not state.finished and word(state) == X_OR_B
    state.reset()
    assert state.num_accepted == 0 and word(state) == ONLY_X


def test_reset_refuses_outputs_the_grammar_does_not_allow(x_plus):
    with pytest.raises(ValueError, match="^the request's outputs do not follow its grammar$"):
        StructuredState(x_plus).reset([X, BANG])


def test_a_state_fills_only_its_own_row(x_plus):
    mask = bitmask.allocate(3, VOCAB)
    StructuredState(x_plus).fill_bitmask(mask, 1)
    assert mask[:, 0].tolist() == [-1, ONLY_X, -1]


# -- RequestGrammar ---------------------------------------------------------------------------------
class Handle:
    def __init__(self, compiled, ready=True):
        self.compiled, self.is_ready = compiled, ready

    def ready(self):
        return self.is_ready

    def result(self):
        return self.compiled


def test_a_grammar_compiles_until_its_handle_is_ready(x_plus):
    handle = Handle(x_plus, ready=False)
    grammar = RequestGrammar(handle, [B])
    assert grammar.handle is handle and grammar.stop_token_ids == [B]
    assert grammar.compiling and grammar.state is None and not grammar.refused
    assert grammar.poll() is False and grammar.compiling and not grammar.done
    grammar.accept(X)  # nothing to advance yet
    assert not grammar.refused


def test_a_ready_grammar_builds_its_state_once_with_its_stop_tokens(x_plus):
    grammar = RequestGrammar(Handle(x_plus), [B])
    assert grammar.poll() is True and not grammar.compiling and grammar.handle is None
    state = grammar.state
    assert state.num_accepted == 0 and grammar.poll() is True and grammar.state is state
    grammar.accept(X)
    assert word(state) == X_OR_B


def test_a_grammar_without_stop_tokens_keeps_the_tokenizers(x_plus):
    grammar = RequestGrammar(Handle(x_plus), [])
    grammar.poll()
    grammar.accept(X)
    assert word(grammar.state) == X_OR_EOS


def test_a_refused_token_ends_the_grammar_for_good(x_plus):
    grammar = RequestGrammar(Handle(x_plus), [EOS])
    grammar.poll()
    grammar.accept(X)
    assert not grammar.refused and not grammar.done and grammar.state.num_accepted == 1
    grammar.accept(BANG)
    assert grammar.refused and grammar.done
    grammar.accept(X)  # nothing more reaches the matcher
    assert grammar.state.num_accepted == 1


def test_the_stop_token_finishes_the_grammar(x_plus):
    grammar = RequestGrammar(Handle(x_plus), [EOS])
    grammar.poll()
    grammar.accept(X)
    grammar.accept(EOS)
    assert grammar.done and not grammar.refused


def outputs(*ids):
    return SimpleNamespace(num_output_tokens=len(ids), output_token_ids=list(ids))


def test_synced_rebuilds_a_state_behind_the_outputs(x_plus):
    grammar = RequestGrammar(Handle(x_plus), [EOS])
    grammar.poll()
    state = grammar.synced(outputs(X, X))
    assert state is grammar.state and state.num_accepted == 2


def test_synced_leaves_a_state_at_the_outputs_alone(x_plus):
    grammar = RequestGrammar(Handle(x_plus), [EOS])
    grammar.poll()
    grammar.accept(X)
    # outputs that differ but count the same: not replayed (the counts are what is compared)
    assert grammar.synced(outputs(BANG)).num_accepted == 1


def test_synced_leaves_a_refused_grammar_alone(x_plus):
    grammar = RequestGrammar(Handle(x_plus), [EOS])
    grammar.poll()
    grammar.accept(BANG)
    assert grammar.synced(outputs(BANG)).num_accepted == 0  # a reset would raise


# -- bitmask: fill and apply ------------------------------------------------------------------------
def test_allocate_gives_a_word_per_32_tokens_every_bit_set():
    mask = bitmask.allocate(2, 33)
    assert mask.shape == (2, 2) and mask.dtype == torch.int32 and (mask == -1).all()


def test_fill_fills_the_constrained_rows_and_names_them(x_plus):
    mask = bitmask.allocate(4, VOCAB)
    states = [None, StructuredState(x_plus), None, StructuredState(x_plus)]
    assert bitmask.fill(mask, states) == [1, 3]
    assert mask[:, 0].tolist() == [-1, ONLY_X, -1, ONLY_X]
    assert bitmask.fill(mask, [None, None]) == []


def mask_of(*words):
    return torch.tensor([[w] for w in words], dtype=torch.int32)


NEG = float("-inf")


def test_no_rows_leave_the_logits_alone():
    logits = torch.zeros(2, 8)
    bitmask.apply(logits, mask_of(0, 0), [], VOCAB)
    assert (logits == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_masks_the_rows_named_and_the_columns_past_the_vocabulary(dtype):
    logits = torch.zeros(3, 7, dtype=dtype)
    bitmask.apply(logits, mask_of(ONLY_X, 0, X_OR_B), [0, 2], VOCAB)
    assert logits.tolist() == [
        [NEG, 0, NEG, NEG, NEG, NEG, NEG],
        [0, 0, 0, 0, 0, 0, 0],
        [NEG, 0, NEG, NEG, 0, NEG, NEG],
    ]


def test_logits_narrower_than_the_vocabulary_are_masked_to_their_width():
    logits = torch.zeros(1, 4)
    bitmask.apply(logits, mask_of(X_OR_B), [0], VOCAB)
    assert logits.tolist() == [[NEG, 0, NEG, NEG]]


def test_bits_past_the_first_word_reach_their_tokens():
    mask = torch.tensor([[0, 1 << 1]], dtype=torch.int32)  # token 33 only
    logits = torch.zeros(1, 40)
    bitmask.apply(logits, mask, [0], 40)
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [33]


@pytest.mark.parametrize(
    "dtype, numpy_path", [(torch.float32, True), (torch.float16, False), (torch.bfloat16, False)]
)
def test_float32_logits_on_the_cpu_take_the_numpy_path(monkeypatch, dtype, numpy_path):
    calls = []
    real = bitmask.apply_numpy
    monkeypatch.setattr(bitmask, "apply_numpy", lambda *a: calls.append(a[2:]) or real(*a))
    bitmask.apply(torch.zeros(2, 6, dtype=dtype), mask_of(0, ONLY_X), [1], VOCAB)
    assert calls == ([([1], VOCAB)] if numpy_path else [])


def test_logits_off_the_cpu_get_the_bitmask_on_their_device_and_xgrammars_kernel(monkeypatch):
    # "meta" stands for the GPU: a device other than the bitmask's, where tensors have no data
    calls = []

    def kernel(logits, mask, vocab_size, indices):
        calls.append((mask.device.type, vocab_size, indices))

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", kernel)
    mask = mask_of(0, ONLY_X)
    bitmask.apply(torch.zeros(2, 4, device="meta"), mask, [1], VOCAB)
    assert calls == [("meta", 4, [1])] and mask.device.type == "cpu"
