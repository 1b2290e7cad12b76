"""Which logits rows each grammar mask lands on when constrained and unconstrained requests share a
step with speculation: plain sampling rows first, then ``k + 1`` verification rows per drafting
request. Every order (constrained first, last, middle, alternating, all, none) is checked row for
row: on ``bitmask.for_step`` with hand-made grammars, on real matchers, through
``ModelRunner.run`` (mask, verification, sampling) on hand-made logits, and on the draft trim."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvmesh.engine.engine_core import EngineCore
from kvmesh.engine.model_runner import ModelRunner, PreparedStep
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import Sampler
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.structured import StructuredOutputsParams as SOP
from kvmesh.engine.structured import bitmask
from kvmesh.engine.structured.backend import RequestGrammar
from kvmesh.engine.structured.compiler import GrammarCache
from kvmesh.engine.structured.matcher import StructuredState

VOCAB = 64
ALL_ALLOWED = -1  # an untouched bitmask row: every bit set


class FakeState:
    """A grammar that refuses the tokens in ``refused``; records each row it fills and the drafts it
    had walked then, and writes a marker into the row."""

    def __init__(self, refused=()):
        self.refused = set(refused)
        self.walked: list[int] = []
        self.fills: list[tuple[int, tuple[int, ...]]] = []

    def fill_bitmask(self, mask, row):
        mask[row] = 0
        mask[row, 0] = 1 + len(self.walked)
        self.fills.append((row, tuple(self.walked)))

    def accept(self, tokens):
        for n, t in enumerate(tokens):
            if t in self.refused:
                return n
            self.walked.append(t)
        return len(tokens)

    def rollback(self, n):
        if n:
            del self.walked[-n:]


def fake(kind: str, refused=()):
    """A request as for_step reads it: ``C`` constrained, ``U`` not."""
    state = FakeState(refused) if kind == "C" else None
    grammar = SimpleNamespace(synced=lambda req: state) if state else None
    return SimpleNamespace(structured=grammar, state=state)


DRAFTS = [11, 12, 13, 14]

# (plain kinds, [(spec kind, number of drafts)], the constrained rows)
ORDERS = [
    ("CUU", [], [0]),
    ("UUC", [], [2]),
    ("UCU", [], [1]),
    ("CUCU", [], [0, 2]),
    ("UCUC", [], [1, 3]),
    ("CCC", [], [0, 1, 2]),
    ("C", [], [0]),
    ("", [("C", 2)], [0, 1, 2]),
    ("U", [("C", 2)], [1, 2, 3]),
    ("C", [("U", 2)], [0]),
    ("UU", [("U", 1), ("C", 1)], [4, 5]),
    ("C", [("U", 2), ("C", 1)], [0, 4, 5]),
    ("", [("C", 1), ("U", 3)], [0, 1]),
    ("", [("U", 3), ("C", 1)], [4, 5]),
    ("U", [("U", 1), ("C", 4), ("U", 2)], [3, 4, 5, 6, 7]),
    ("UC", [("C", 3), ("U", 1), ("C", 2)], [1, 2, 3, 4, 5, 8, 9, 10]),
    ("CUC", [("C", 1), ("C", 1)], [0, 2, 3, 4, 5, 6]),
    ("UCU", [("U", 2), ("U", 1)], [1]),
    ("CC", [("C", 2), ("C", 3)], [0, 1, 2, 3, 4, 5, 6, 7, 8]),
]


@pytest.mark.parametrize("plain_kinds, spec_kinds, want", ORDERS)
def test_each_mask_lands_on_its_own_rows_and_draft_positions(plain_kinds, spec_kinds, want):
    plain = [fake(k) for k in plain_kinds]
    spec = [(fake(k), DRAFTS[:n]) for k, n in spec_kinds]
    mask, rows = bitmask.for_step(plain, spec, VOCAB)
    num_rows = len(plain) + sum(n + 1 for _, n in spec_kinds)
    assert rows == want
    assert mask.shape[0] == num_rows
    for row in range(num_rows):
        if row not in want:
            assert (mask[row] == ALL_ALLOWED).all(), row  # an unconstrained row is left alone
    for i, req in enumerate(plain):  # a plain row: the state as it stands
        if req.state is not None:
            assert req.state.fills == [(i, ())]
    at = len(plain)
    for req, drafts in spec:  # verification row j: the state after drafts 1..j, then rolled back
        if req.state is not None:
            assert req.state.fills == [(at + j, tuple(drafts[:j])) for j in range(len(drafts) + 1)]
            assert [int(mask[at + j, 0]) for j in range(len(drafts) + 1)] == list(
                range(1, len(drafts) + 2)
            )
            assert req.state.walked == []
        at += len(drafts) + 1


@pytest.mark.parametrize(
    "plain_kinds, spec_kinds", [("UUU", []), ("U", [("U", 2)]), ("", [("U", 1)])]
)
def test_no_constrained_row_means_no_mask(plain_kinds, spec_kinds):
    plain = [fake(k) for k in plain_kinds]
    assert bitmask.for_step(plain, [(fake(k), DRAFTS[:n]) for k, n in spec_kinds], VOCAB) is None


@pytest.mark.parametrize(
    "refused, filled",
    [
        ({11}, 1),  # the first draft refused: only the row before it is constrained
        ({12}, 2),
        ({13}, 3),
        ({14}, 4),  # the last draft refused: every row but the bonus row
        (set(), 5),
    ],
)
@pytest.mark.parametrize("before", ["", "U", "C"])
def test_rows_past_a_refused_draft_stay_unconstrained(refused, filled, before):
    plain = [fake(k) for k in before]
    req = fake("C", refused)
    after = fake("C")
    mask, rows = bitmask.for_step(plain, [(req, DRAFTS), (after, [21])], VOCAB)
    at = len(plain)
    head = [0] if before == "C" else []
    assert rows == head + [at + j for j in range(filled)] + [at + 5, at + 6]
    assert req.state.fills == [(at + j, tuple(DRAFTS[:j])) for j in range(filled)]
    assert after.state.fills == [(at + 5, ()), (at + 6, (21,))]
    assert all((mask[at + j] == ALL_ALLOWED).all() for j in range(filled, 5))
    assert req.state.walked == [] and after.state.walked == []


# -- on real matchers ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def x_grammar(tokenizer, tokenizer_info):
    """``x+``: the token "x" is allowed at every position, "!" never."""
    compiled = GrammarCache(tokenizer_info).compile_now(SOP(regex="x+"))
    [x] = tokenizer.encode("x", add_special_tokens=False)
    [bang] = tokenizer.encode("!", add_special_tokens=False)
    return SimpleNamespace(compiled=compiled, x=x, bang=bang, eos=tokenizer.eos_token_id)


def grammar_of(g) -> RequestGrammar:
    grammar = RequestGrammar(None, [g.eos])
    grammar.state = StructuredState(g.compiled, [g.eos])
    return grammar


def request(rid: str, g, constrained: bool) -> Request:
    req = Request(
        rid, [1, 2, 3], SamplingParams(max_tokens=16, temperature=0.0), {g.eos}, "m", 16, 256
    )
    req.structured = grammar_of(g) if constrained else None
    return req


def fresh_mask(g, walked, vocab):
    state = StructuredState(g.compiled, [g.eos])
    assert state.accept(walked) == len(walked)
    m = bitmask.allocate(1, vocab)
    state.fill_bitmask(m, 0)
    return m[0]


def test_real_matchers_fill_each_draft_position_as_a_fresh_walk(tokenizer, x_grammar):
    g, vocab = x_grammar, len(tokenizer)
    plain = [request("u0", g, False), request("c0", g, True)]
    verifying = request("c1", g, True)
    verifying.append_token(g.x)  # one output already: row 0 stands after it
    drafts = [g.x, g.x, g.bang, g.x]
    spec = [(request("u1", g, False), [g.x]), (verifying, drafts)]
    mask, rows = bitmask.for_step(plain, spec, vocab)
    assert rows == [1, 4, 5, 6]
    assert torch.equal(mask[1], fresh_mask(g, [], vocab))
    for j in range(3):  # after drafts 1..j; the refused "!" ends the constrained rows
        assert torch.equal(mask[4 + j], fresh_mask(g, [g.x] * (1 + j), vocab)), j
    assert not torch.equal(mask[4], mask[1])  # after one "x" the end is allowed too
    assert all((mask[r] == ALL_ALLOWED).all() for r in (0, 2, 3, 7, 8))
    assert verifying.structured.state.num_accepted == 1  # the walk was rolled back


def test_a_matcher_behind_its_requests_outputs_is_synced_first(tokenizer, x_grammar):
    """Outputs the matcher never saw (a resumed stream's): each row is filled after them."""
    g, vocab = x_grammar, len(tokenizer)
    plain, verifying = request("c0", g, False), request("c1", g, False)
    for req in (plain, verifying):
        req.append_token(g.x)
        req.structured = grammar_of(g)
    mask, rows = bitmask.for_step([plain], [(verifying, [g.x])], vocab)
    assert rows == [0, 1, 2]
    assert torch.equal(mask[0], fresh_mask(g, [g.x], vocab))
    assert torch.equal(mask[1], fresh_mask(g, [g.x], vocab))
    assert torch.equal(mask[2], fresh_mask(g, [g.x, g.x], vocab))
    assert not torch.equal(mask[0], fresh_mask(g, [], vocab))
    assert [r.structured.state.num_accepted for r in (plain, verifying)] == [1, 1]


# -- through ModelRunner.run: mask, then verification and sampling on their own rows -----------------
def runner(logits: torch.Tensor, vocab: int) -> ModelRunner:
    r = ModelRunner.__new__(ModelRunner)
    r.graphs = r.piecewise = r.kv_caches = None
    r.model = lambda *args: logits.clone()
    r.sampler = Sampler()
    r.config = SimpleNamespace(vocab_size=vocab)
    return r


def run_step(g, vocab, plain, spec):
    """Every row's favourite is "!", then "x": a constrained row can only say "x"."""
    num_rows = len(plain) + sum(len(d) + 1 for _, d in spec)
    logits = torch.zeros(num_rows, vocab)
    logits[:, g.bang] = 10.0
    logits[:, g.x] = 5.0
    step = PreparedStep(
        [*plain, *(r for r, _ in spec)],
        None,
        None,
        None,
        None,
        plain,
        [],
        spec,
        None,
        None,
        {r.request_id: i for i, r in enumerate(plain)},
        bitmask.for_step(plain, spec, vocab),
        sample_positions=[r.num_output_tokens for r in plain],
    )
    sampled, _, _ = ModelRunner.finish(runner(logits, vocab).run(step))
    return sampled


@pytest.mark.parametrize(
    "plain_kinds, spec_kinds",
    [
        ("CU", "CU"),
        ("UC", "UC"),
        ("UCU", "CUC"),
        ("CUC", "UCU"),
        ("CC", "CC"),
        ("UU", "UU"),
        ("", "UCUC"),
        ("CUCU", ""),
        ("U", "C"),
        ("C", "U"),
    ],
)
def test_a_step_verifies_and_samples_each_request_under_its_own_mask(
    tokenizer, x_grammar, plain_kinds, spec_kinds
):
    g, vocab = x_grammar, len(tokenizer)
    plain = [request(f"p{i}{k}", g, k == "C") for i, k in enumerate(plain_kinds)]
    # a constrained request drafts what its grammar allows, an unconstrained one what it favours
    spec = [
        (request(f"s{i}{k}", g, k == "C"), [g.x, g.x] if k == "C" else [g.bang, g.bang])
        for i, k in enumerate(spec_kinds)
    ]
    sampled = run_step(g, vocab, plain, spec)
    want = {r.request_id: g.x if r.structured else g.bang for r in plain}
    # every draft accepted, and the bonus token from the last row (masked too when constrained)
    want.update((r.request_id, [g.x] * 3 if r.structured else [g.bang] * 3) for r, _ in spec)
    assert sampled == want


@pytest.mark.parametrize("before", ["", "U", "C"])
def test_a_refused_draft_is_corrected_under_the_mask(tokenizer, x_grammar, before):
    g, vocab = x_grammar, len(tokenizer)
    plain = [request(f"p{k}", g, k == "C") for k in before]
    constrained = request("c", g, True)
    free = request("u", g, False)
    spec = [(constrained, [g.x, g.bang, g.x]), (free, [g.x, g.bang])]
    sampled = run_step(g, vocab, plain, spec)
    assert sampled["c"] == [g.x, g.x]  # "x" accepted, "!" refused: the correction is "x"
    assert sampled["u"] == [g.bang]  # the unconstrained row favours "!" over the draft "x"


# -- the draft trim ----------------------------------------------------------------------------------
def test_drafts_are_cut_at_the_first_one_the_grammar_refuses(tokenizer, x_grammar):
    g = x_grammar
    reqs = [request(f"r{i}", g, c) for i, c in enumerate([True, False, True, True, False, True])]
    reqs[3].append_token(g.x)
    drafts = [
        [g.x, g.x, g.bang, g.x],
        [g.bang, g.bang],  # unconstrained: left as drafted
        [g.bang, g.x],
        [g.x, g.eos, g.x],  # the end is allowed after "x", and nothing after it
        [g.x],
        [],
    ]
    for r, d in zip(reqs, drafts):
        r.spec_token_ids = list(d)
    EngineCore._trim_drafts(SimpleNamespace(scheduler=SimpleNamespace(running=reqs)))
    assert [r.spec_token_ids for r in reqs] == [
        [g.x, g.x],
        [g.bang, g.bang],
        [],
        [g.x, g.eos],
        [g.x],
        [],
    ]
    assert [r.structured.state.num_accepted for r in reqs if r.structured] == [0, 0, 1, 0]
