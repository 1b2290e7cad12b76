"""Truncation (top-p, min-p) always keeps the top token, at any value the API accepts: down to
the smallest positive float64 (5e-324), values that round to zero in float32 (1e-46) and
float32's subnormals. And a row asking for no truncation (top_p=1, min_p=0) keeps its whole
distribution, whatever the other rows of its batch ask. Property tests over random logits with
ties and -inf, plus the end-to-end request: top_p=1e-300 returns the greedy token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvmesh.engine.request import Request
from kvmesh.engine.sampler import Sampler
from kvmesh.engine.sampling_params import SamplingParams

# The model's logits reach the sampler in float32 (engine/models: lm_head(...).float()).
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)  # 1.4e-45
F32_NORMAL = float(np.finfo(np.float32).tiny)  # 1.2e-38
EXTREMES = [
    5e-324,
    1e-323,
    1e-310,
    2.2250738585072014e-308,
    1e-300,
    1e-100,
    1e-46,
    F32_TINY / 2,
    F32_TINY,
    2 * F32_TINY,
    1e-44,
    F32_NORMAL / 3,
    F32_NORMAL,
    1e-30,
    1e-12,
    1e-6,
    0.5,
    float(np.nextafter(1.0, 0.0)),
    1.0,
]

TOP_P = st.one_of(
    st.sampled_from(EXTREMES), st.floats(min_value=5e-324, max_value=1.0, exclude_min=False)
)
MIN_P = st.one_of(st.just(0.0), st.sampled_from(EXTREMES), st.floats(min_value=0.0, max_value=1.0))
LOGIT = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 30.0, -30.0, float("-inf")]),
    st.floats(min_value=-50, max_value=50, allow_nan=False),
)


def row_of(vocab: int):
    """A logits row with at least one finite entry (a row banned everywhere has nothing to keep)."""
    return st.lists(LOGIT, min_size=vocab, max_size=vocab).filter(
        lambda r: any(v != float("-inf") for v in r)
    )


@st.composite
def batches(draw, max_rows: int = 4):
    """(rows, params): a batch of logits rows (small vocabularies make ties likely), each with
    its own top_p, min_p and temperature."""
    vocab = draw(st.integers(1, 40))
    n = draw(st.integers(1, max_rows))
    rows = [draw(row_of(vocab)) for _ in range(n)]
    params = [
        dict(
            top_p=draw(TOP_P),
            min_p=draw(MIN_P),
            temperature=draw(st.sampled_from([1.0, 0.5, 2.0, 1e-4])),
        )
        for _ in range(n)
    ]
    return rows, params


def _requests(params: list[dict]) -> list[Request]:
    return [
        Request(
            f"r{i}", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True, **p), set(), "m", 4, 64
        )
        for i, p in enumerate(params)
    ]


def _probs(rows: list[list[float]], params: list[dict]) -> torch.Tensor:
    return Sampler().probs(torch.tensor(rows, dtype=torch.float32), _requests(params))


@settings(max_examples=500, deadline=None)
@given(batch=batches())
@example(batch=([[2.0, 1.0, 0.5]], [dict(top_p=1e-46)]))
@example(batch=([[2.0, 1.0, 0.5]], [dict(top_p=5e-324)]))
@example(batch=([[1.0, 1.0, 0.5]], [dict(top_p=1e-300, min_p=1e-300)]))
@example(batch=([[float("-inf"), 3.0, 3.0]], [dict(top_p=1e-300)]))
@example(batch=([[0.0, 1.0, 1.0, -30.0]], [dict(top_p=1e-44, min_p=1.0)]))
def test_the_top_token_is_always_kept(batch):
    rows, params = batch
    kept = _probs(rows, params) > 0
    for row, keep, p in zip(rows, kept, params):
        top = torch.tensor(row)
        assert bool(keep[int(top.argmax())]), (row, p, keep)  # the greedy token
        assert bool(keep[top == top.max()].all()), (row, p, keep)  # and every token tied with it
        assert not bool(keep[top == float("-inf")].any()), (
            row,
            p,
            keep,
        )  # a banned token stays banned


@settings(max_examples=300, deadline=None)
@given(batch=batches(max_rows=3), data=st.data())
def test_no_truncation_asked_none_done(batch, data):
    """top_p=1 and min_p=0 keep every token that has probability, beside rows that truncate."""
    rows, params = batch
    untruncated = data.draw(row_of(len(rows[0])))
    probs = _probs([untruncated] + rows, [dict(top_p=1.0, min_p=0.0)] + params)[0]
    full = torch.tensor(untruncated, dtype=torch.float32).softmax(-1)
    assert torch.equal(probs > 0, full > 0), (untruncated, params)


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 5e-324])
def test_extreme_top_p_samples_the_greedy_token(top_p):
    """A 49k vocabulary whose top token is far from the rest: junk was drawn when top_p rounded
    to zero in float32 (every token dropped)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49152, generator=gen) * 3
    params = [dict(temperature=1.0, top_p=top_p, seed=s) for s in range(8)]
    tokens, _ = Sampler(seed=1)(logits, _requests(params))
    assert tokens == logits.argmax(-1).tolist()
