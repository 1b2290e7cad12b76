"""Speculative decoding, piece by piece: the n-gram proposer, the config, the per-request
acceptance rule, the scheduler/KV side of drafts, and the rejection sampler's distribution."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampler import Sampler
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from kvmesh.engine.spec_decode.controller import SpecDecoder
from kvmesh.engine.spec_decode.ngram import NgramProposer, propose_batch
from kvmesh.engine.spec_decode.rejection import verify

BS = 4


# -- proposer -----------------------------------------------------------------------------------
def reference(hist: list[int], k: int, max_n: int, min_n: int, limit: int) -> list[int]:
    """The rule, written plainly: the longest suffix (max_n down to min_n) that occurs earlier,
    its most recent occurrence, the k tokens after it (continuing the cycle past the end)."""
    L = len(hist)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = hist[L - n :]
        for end in range(L - 2, n - 2, -1):  # an occurrence ending at `end` < L - 1
            if hist[end - n + 1 : end + 1] == suffix:
                start, period = end + 1, L - end - 1
                return [hist[start + i % period] for i in range(min(k, limit))]
    return []


def test_proposer_examples():
    h = [
        np.array(x)
        for x in (
            [1, 2, 3, 4, 5, 1, 2, 3],  # "1 2 3" recurs: draft what followed
            [9, 8, 7, 6],  # nothing recurs
            [1, 2, 1, 2, 1, 2],  # a loop: the draft continues it
            [5, 6, 7, 5, 6, 7, 8, 5, 6, 7],  # the most recent occurrence wins
            [3],
            [1, 1],
        )
    ]
    assert propose_batch(h, 4, 4, 2) == [[4, 5, 1, 2], [], [1, 2, 1, 2], [8, 5, 6, 7], [], []]
    # prompt_lookup_min=1: a single repeated token is enough.
    assert propose_batch(h, 4, 4, 1)[5] == [1, 1, 1, 1]
    # Per-request limits (max_tokens / max_model_len room) cut the draft.
    assert propose_batch(h, 4, 3, 2, [1, 4, 4, 2, 4, 4]) == [[4], [], [1, 2, 1, 2], [8, 5], [], []]
    # A longer match beats a more recent shorter one: "2 3" recurs at the end, "1 2 3" only earlier.
    h2 = [np.array([1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3])]
    assert propose_batch(h2, 2, 3, 2) == [[9, 7]]
    assert propose_batch(h2, 2, 2, 2) == [[8, 1]]  # with n <= 2 only, the most recent "2 3"


def test_proposer_matches_the_reference_on_random_batches():
    rng = random.Random(5)
    for trial in range(60):
        vocab = rng.choice([3, 5, 20])
        k, max_n = rng.randint(1, 5), rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        hists = [
            [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            for _ in range(rng.randint(1, 7))
        ]
        limits = [rng.randint(0, 6) for _ in hists]
        got = propose_batch([np.array(h) for h in hists], k, max_n, min_n, limits)
        want = [reference(h, k, max_n, min_n, lim) for h, lim in zip(hists, limits)]
        assert got == want, (trial, hists, k, max_n, min_n, limits)


def test_proposer_keeps_histories_incrementally():
    p = NgramProposer(3, 3, 2)
    toks = [7, 8, 9, 7, 8]
    assert p.propose(["a"], [toks], [3]) == [[9, 7, 8]]
    toks += [1, 2] * 40  # grows past the first buffer
    assert p.propose(["a"], [toks], [3]) == [[1, 2, 1]]
    buf, n = p._hist["a"]
    assert n == len(toks) and list(buf[:n]) == toks
    p.forget("a")
    assert "a" not in p._hist


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": "3"}, "speculative_config.num_speculative_tokens"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_max": 0},
            "speculative_config.prompt_lookup_max",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "speculative_config.disable_by_batch_size",
        ),
        (
            {"num_speculative_tokens": 2, "acceptance_threshold": 1.5},
            "speculative_config.acceptance_threshold",
        ),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, "speculative_config.draft_model"),
        ("{not json", "speculative_config"),
        ("[1, 2]", "speculative_config"),
    ],
)
def test_bad_config_names_the_field(value, field):
    with pytest.raises(SpeculativeConfigError) as err:
        SpeculativeConfig.parse(value)
    assert err.value.field == field and str(err.value).startswith(field + ":")


def test_config_parse_and_defaults():
    c = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    )
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (3, 5, 2)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 3, "prompt_lookup_min": 6})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (6, 6)
    assert SpeculativeConfig.parse(None) is None
    assert (
        SpeculativeConfig.parse(
            {"num_speculative_tokens": 1, "disable_by_batch_size": None}
        ).disable_by_batch_size
        is None
    )


# -- the per-request rule and the batch-size rule -----------------------------------------------------
def _req(rid: str, tokens: list[int], max_tokens: int = 100, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(
        rid, tokens, SamplingParams(max_tokens=max_tokens, **params), set(), "m", BS, 256
    )


def _decoding(rid: str, tokens: list[int], **kw) -> Request:
    r = _req(rid, tokens, **kw)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_low_acceptance_pauses_drafting_then_reprobes():
    cfg = SpeculativeConfig(
        num_speculative_tokens=2,
        prompt_lookup_min=1,
        acceptance_threshold=0.5,
        acceptance_min_drafts=3,
        acceptance_ema=0.5,
        reprobe_interval=4,
    )
    spec = SpecDecoder(cfg, 256)
    r = _decoding("a", [1, 2, 1, 2, 1])

    def drafts_now() -> bool:
        spec.propose([r])
        return bool(r.spec_token_ids)

    for _ in range(3):  # three drafts, none accepted
        assert drafts_now()
        spec.record("a", 2, 0)
    paused = [drafts_now() for _ in range(4)]
    assert paused == [False] * 4  # reprobe_interval steps without drafts
    assert drafts_now()  # the re-probe
    spec.record("a", 2, 0)  # fails: the pause doubles
    assert [drafts_now() for _ in range(8)] == [False] * 8
    assert drafts_now()
    spec.record("a", 2, 2)  # the probe pays: drafting resumes at once
    assert all(drafts_now() for _ in range(5))
    s = spec.stats()
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos) == (
        5,
        10,
        2,
        [1, 1],
    )


def test_good_acceptance_never_pauses():
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1), 256)
    r = _decoding("a", [1, 2, 1, 2, 1])
    for _ in range(20):
        spec.propose([r])
        assert r.spec_token_ids == [2, 1]
        spec.record("a", 2, 1)  # 50%: above the default 25% threshold
    assert spec.stats().num_paused_requests == 0


def test_batch_size_rule_and_per_request_room():
    spec = SpecDecoder(
        SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=3),
        256,
    )
    rs = [_decoding(f"r{i}", [1, 2, 1, 2, 1]) for i in range(3)]
    spec.propose(rs)
    assert all(r.spec_token_ids == [] for r in rs) and spec.num_steps_disabled_by_batch == 1
    spec.propose(rs[:2])
    assert [r.spec_token_ids for r in rs[:2]] == [[2, 1, 2], [2, 1, 2]]
    # Drafts that could not all be emitted under max_tokens are cut: k drafts emit k + 1 tokens.
    near_end = _decoding("e", [1, 2, 1, 2, 1], max_tokens=2)
    near_end.append_token(2)  # one output token: one more allowed
    near_end.num_computed_tokens = near_end.num_tokens - 1
    prefilling = _req("p", [1, 2, 1, 2, 1])  # prompt not computed yet: no drafts
    spec.propose([near_end, prefilling])
    assert near_end.spec_token_ids == [] and prefilling.spec_token_ids == []
    roomy = _decoding("f", [1, 2, 1, 2, 1], max_tokens=3)
    spec.propose([roomy])
    assert roomy.spec_token_ids == [2, 1]


# -- scheduler and KV manager ------------------------------------------------------------------------
def _sched(num_blocks: int = 16, budget: int = 32) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BS, enable_caching=True, enable_events=True), budget, 8, 256
    )


def _prefilled(s: Scheduler, rid: str, prompt: list[int], **kw) -> Request:
    r = _req(rid, prompt, **kw)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {rid: 0})
    return r


def test_drafts_take_budget_and_lookahead_slots_and_the_rejected_tail_is_released():
    s = _sched()
    r = _prefilled(s, "a", [5, 6, 7, 8, 9, 10])  # 7 tokens: 2 blocks
    events = s.kv.take_events()
    assert len(s.kv.req_blocks["a"]) == 2
    r.spec_token_ids = [1, 2, 3, 4, 5]  # positions 7..11: lookahead into a third block
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 6}
    assert len(s.kv.req_blocks["a"]) == 3
    # Only blocks full of verified tokens are cached: block 0 (tokens 0..3); block 1 holds
    # verified 4..6 and draft 7, and must not be.
    assert s.kv.num_cached_blocks["a"] == 1
    stored = [e for e in s.kv.take_events() + events if type(e).__name__ == "BlockStored"]
    assert [t for e in stored for t in e.token_ids] == [5, 6, 7, 8]
    (res,) = s.update_from_output(out, {"a": [1, 42]})  # one draft accepted, then 42
    assert res == (r, [1, 42]) and r.output_token_ids == [0, 1, 42]
    assert r.num_computed_tokens == 8 and r.num_tokens == 9 and r.spec_token_ids == []
    assert len(s.kv.req_blocks["a"]) == 3  # 9 tokens need 3 blocks: none was past the verified end
    r.spec_token_ids = [7, 7, 7, 7]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 5} and len(s.kv.req_blocks["a"]) == 4
    free_before = s.kv.pool.num_free_blocks
    s.update_from_output(out, {"a": [3]})  # every draft rejected
    assert r.num_computed_tokens == 9 and r.num_tokens == 10
    assert len(s.kv.req_blocks["a"]) == 3 and s.kv.pool.num_free_blocks == free_before + 1
    assert all(b.key is None for b in s.kv.req_blocks["a"][2:])
    assert s.kv.pool.num_free_blocks + 3 == 16


def test_drafts_are_cut_by_the_budget_and_never_preempt():
    s = _sched(budget=4)
    r = _prefilled(s, "a", [5, 6, 7])
    r.spec_token_ids = [1, 2, 3, 4, 5]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and r.spec_token_ids == [1, 2, 3]
    s.update_from_output(out, {"a": [9]})
    # A full pool: drafts are dropped rather than preempting anyone.
    s2 = _sched(num_blocks=2, budget=32)
    a, b = _req("a", [1, 2, 3]), _req("b", [4, 5, 6])
    s2.add_request(a)
    s2.add_request(b)
    s2.update_from_output(s2.schedule(), {"a": 0, "b": 0})  # 4 tokens each: one block each
    assert s2.kv.pool.num_free_blocks == 0 and len(s2.running) == 2
    a.spec_token_ids = [4, 4, 4]
    out = s2.schedule()
    assert not out.preempted and out.num_scheduled_tokens["a"] == 1 and a.spec_token_ids == []


def test_a_stop_token_inside_the_accepted_run_ends_the_request_there():
    s = _sched()
    r = _prefilled(s, "a", [5, 6, 7], stop_token_ids=[13])
    r.spec_token_ids = [11, 13, 14]
    out = s.schedule()
    (res,) = s.update_from_output(out, {"a": [11, 13, 14, 15]})
    assert res[1] == [11, 13] and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 13
    assert "a" not in s.requests and s.kv.pool.num_free_blocks == 16


def test_max_tokens_truncates_the_accepted_run():
    s = _sched()
    r = _prefilled(s, "a", [5, 6, 7], max_tokens=3)
    r.spec_token_ids = [11, 12, 13]
    out = s.schedule()
    (res,) = s.update_from_output(out, {"a": [11, 12, 13, 14]})
    assert res[1] == [11, 12] and r.output_token_ids == [0, 11, 12]
    assert r.status == RequestStatus.FINISHED_LENGTH


def test_preemption_drops_drafts():
    s = _sched(num_blocks=4, budget=64)
    a = _prefilled(s, "a", list(range(1, 8)))  # 8 tokens: 2 blocks
    b = _prefilled(s, "b", list(range(20, 27)))  # 2 blocks: the pool is full
    b.spec_token_ids = [1]
    a.append_token(3)  # as if a's next token needs a new block
    a.num_computed_tokens = a.num_tokens - 1
    out = s.schedule()
    assert out.preempted == ["b"] and b.spec_token_ids == [] and b.num_computed_tokens == 0


# -- rejection sampling ---------------------------------------------------------------------------
def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal quantile z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    keep = probs * n >= 5
    expected = np.append(probs[keep] * n, probs[~keep].sum() * n)
    observed = np.append(counts[keep], counts[~keep].sum())
    if expected[-1] < 5:
        expected, observed = expected[:-1], observed[:-1]
        observed[-1] += counts[~keep].sum()  # fold the rare tail into the last cell
        expected[-1] += probs[~keep].sum() * n
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


@pytest.mark.parametrize(
    "params",
    [dict(temperature=0.8), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.8)],
)
def test_rejection_sampling_preserves_the_target_distribution(params):
    """Many requests, one verify call: the first emitted token follows p_0, the second (given the
    first draft was accepted) follows p_1, whatever the drafts were."""
    vocab, n = 8, 30000
    gen = torch.Generator().manual_seed(3)
    row_logits = torch.randn(3, vocab, generator=gen) * 1.5
    sampler = Sampler(seed=11)
    reqs = [
        Request(
            f"r{i}",
            [1, 2],
            SamplingParams(max_tokens=10, ignore_eos=True, **params),
            set(),
            "m",
            BS,
            64,
        )
        for i in range(n)
    ]
    # Drafts: a likely token, an unlikely one, and one outside top-k/top-p, cycling.
    order = row_logits[0].argsort(descending=True).tolist()
    firsts = [order[0], order[3], order[-1]]
    drafts = [[firsts[i % 3], int(row_logits[1].argmax())] for i in range(n)]
    logits = row_logits.repeat(n, 1)
    results = verify(sampler, logits, reqs, drafts)
    target = sampler.probs(row_logits, reqs[:3]).numpy().astype(np.float64)
    first = np.bincount([r.tokens[0] for r in results], minlength=vocab)
    stat, df = _chi2(first, target[0] / target[0].sum())
    assert stat < _chi2_critical(df), (stat, df)
    second = [r.tokens[1] for r in results if len(r.tokens) > 1]
    assert len(second) > 1000
    stat, df = _chi2(np.bincount(second, minlength=vocab), target[1] / target[1].sum())
    assert stat < _chi2_critical(df), (stat, df)
    # The drafts were really tested: some accepted, some rejected, each where the rule says.
    accepted = np.array([r.num_accepted > 0 for r in results])
    assert 0 < accepted.mean() < 1
    p_first = target[0][np.array([d[0] for d in drafts])]
    assert abs(accepted.mean() - p_first.mean()) < 0.02
    # A draft with probability zero (outside the filters) is never accepted.
    zero = [(r, d) for r, d in zip(results, drafts) if target[0][d[0]] == 0]
    assert bool(zero) == ("top_k" in params or "top_p" in params)
    assert all(r.num_accepted == 0 and r.tokens[0] != d[0] for r, d in zero)


def test_greedy_verification_is_the_longest_matching_prefix():
    sampler = Sampler()
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 4, 5, 6]):
        logits[row, tok] = 5.0
    r = Request(
        "g",
        [1],
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        set(),
        "m",
        BS,
        64,
    )
    assert verify(sampler, logits, [r], [[3, 4, 5]])[0].tokens == [3, 4, 5, 6]  # all + bonus
    assert verify(sampler, logits, [r], [[3, 9, 5]])[0].tokens == [3, 4]  # first mismatch corrected
    assert verify(sampler, logits[:2], [r], [[7]])[0].tokens == [3]


def test_greedy_verification_equals_step_by_step_sampling_with_penalties_and_min_tokens():
    """Each draft row is adjusted as a plain decode of that prefix would be: penalties count the
    drafts before it as output, min_tokens counts them too. Checked against the plain sampler run
    one token at a time, over random histories, logits, drafts and parameters."""
    rng = random.Random(7)
    vocab = 12
    for trial in range(200):
        params = SamplingParams(
            max_tokens=50,
            temperature=0.0,
            ignore_eos=False,
            stop_token_ids=[rng.randrange(vocab)],
            min_tokens=rng.randint(0, 6),
            repetition_penalty=rng.choice([1.0, 1.5]),
            frequency_penalty=rng.choice([0.0, 0.7]),
            presence_penalty=rng.choice([0.0, 0.9]),
            logit_bias={rng.randrange(vocab): 1.0} if rng.random() < 0.3 else None,
        )
        prompt = [rng.randrange(vocab) for _ in range(5)]
        req = Request("r", prompt, params, {rng.randrange(vocab)}, "m", BS, 64)
        for _ in range(rng.randint(0, 3)):
            req.append_token(rng.randrange(vocab))
        k = rng.randint(1, 4)
        logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(trial)) * 0.6
        # The step-by-step truth, and drafts that follow it for a while, then stray.
        truth, shadow = [], Request("s", prompt, params, req.eos_token_ids, "m", BS, 64)
        shadow.all_token_ids = list(req.all_token_ids)
        for j in range(k + 1):
            tok = Sampler()(logits[j : j + 1], [shadow])[0][0]
            truth.append(tok)
            shadow.append_token(tok)
        cut = rng.randint(0, k)
        drafts = truth[:cut] + [(t + 1) % vocab for t in truth[cut:k]]
        got = verify(Sampler(), logits, [req], [drafts])[0].tokens
        assert got == truth[: cut + 1], (trial, drafts, truth)
