"""The sampler draws from the distribution its filters leave: sampling by inversion, checked
statistically (chi-square) on a small vocabulary, and on its edges (unnormalised rows, zero
probabilities, uniforms at 0 and just under 1), and seeded rows drawing the same tokens in any batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.engine.request import Request
from kvmesh.engine.sampler import Sampler, sample_by_inversion
from kvmesh.engine.sampling_params import SamplingParams
from tests.engine.test_spec_units import _chi2, _chi2_critical


def _requests(n: int, **params) -> list[Request]:
    return [
        Request(
            f"r{i}",
            [1, 2],
            SamplingParams(max_tokens=10, ignore_eos=True, **params),
            set(),
            "m",
            4,
            64,
        )
        for i in range(n)
    ]


def test_inversion_picks_the_first_token_whose_cumulative_mass_exceeds_the_uniform():
    probs = torch.tensor(
        [[0.0, 2.0, 0.0, 1.0, 1.0, 0.0]] * 6
    )  # unnormalised, zeros inside and at the ends
    uniform = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.75, float(np.nextafter(np.float32(1), 0))])
    assert sample_by_inversion(probs, uniform).tolist() == [1, 1, 3, 3, 4, 4]


def test_inversion_never_picks_a_zero_probability_token():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 1000, generator=gen)
    probs[probs < 0.9] = 0.0  # about 100 live tokens a row
    for _ in range(20):
        tokens = sample_by_inversion(probs, torch.rand(64, generator=gen))
        assert bool((probs.gather(1, tokens[:, None]) > 0).all())


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.2, top_p=0.8),
        dict(temperature=1.0, min_p=0.1),
    ],
)
def test_sampled_tokens_follow_the_filtered_distribution(params):
    vocab, n = 12, 20000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    sampler = Sampler(seed=7)
    reqs = _requests(n, **params)
    tokens, _ = sampler(row.repeat(n, 1), reqs)
    target = sampler.probs(row[None], reqs[:1])[0].double().numpy()
    target /= target.sum()
    counts = np.bincount(tokens, minlength=vocab)
    stat, df = _chi2(counts, target)
    assert stat < _chi2_critical(df), (stat, df, counts, target)
    assert counts[target == 0].sum() == 0  # filtered-out tokens never come out
    assert (target == 0).any() == ("temperature" in params and len(params) > 1)


def test_seeded_rows_draw_the_same_tokens_in_any_batch_and_unseeded_rows_differ():
    row = torch.zeros(1, 50)  # uniform over 50 tokens: any difference in the draws shows
    seeded = lambda: _requests(1, temperature=1.0, seed=123)[0]  # noqa: E731

    def draws(batch_extra: int) -> list[int]:
        sampler = Sampler(seed=batch_extra)
        req = seeded()
        others = _requests(batch_extra, temperature=1.0)
        out = []
        for _ in range(8):
            tokens, _ = sampler(row.repeat(1 + batch_extra, 1), others + [req])
            out.append(tokens[-1])
        return out

    alone, crowded = draws(0), draws(5)
    assert alone == crowded
    sampler = Sampler(seed=1)
    unseeded = [sampler(row, _requests(1, temperature=1.0))[0][0] for _ in range(20)]
    assert len(set(unseeded)) > 5
