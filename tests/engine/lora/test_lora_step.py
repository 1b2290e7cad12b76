"""build_lora_step: a step's rows grouped by adapter (slices where contiguous), over all rows and
over the logits rows; and the LoRA term each group adds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvmesh.engine.lora.step import LoRAContext, add_lora_torch, build_lora_step


def _reqs(*adapters):
    return [SimpleNamespace(lora=a) for a in adapters]


def _build(reqs, q_lens, logits):
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    return build_lora_step(
        reqs, qsl, np.asarray(logits), lambda a: a.weights, lambda v: torch.as_tensor(v)
    )


def _rows(group):
    r = group.rows
    return list(range(r.start, r.stop)) if isinstance(r, slice) else r.tolist()


def test_base_only_step_has_no_lora_work():
    assert _build(_reqs(None, None), [3, 1], [2, 3]) is None


def test_rows_grouped_by_adapter_in_first_row_order():
    a, b = SimpleNamespace(weights="A"), SimpleNamespace(weights="B")
    # rows: base 0-2, a 3, b 4-7, a 8, base 9
    step = _build(_reqs(None, a, b, a, None), [3, 1, 4, 1, 1], [2, 3, 7, 8, 9])
    assert [g.weights for g in step.full.groups] == ["A", "B"]
    assert [_rows(g) for g in step.full.groups] == [[3, 8], [4, 5, 6, 7]]
    assert isinstance(step.full.groups[1].rows, slice)  # contiguous: no index tensor
    # logits rows 0..4 are flattened rows 2, 3, 7, 8, 9: a owns logits rows 1 and 3, b row 2
    assert [_rows(g) for g in step.logits.groups] == [[1, 3], [2]]


def test_an_adapter_without_logits_rows_is_left_out_of_them():
    a = SimpleNamespace(weights="A")
    step = _build(_reqs(a, None), [4, 1], [4])  # a's chunk samples nothing this step
    assert [_rows(g) for g in step.full.groups] == [[0, 1, 2, 3]]
    assert step.logits.groups == []


def test_context_adds_each_groups_term_to_its_rows_only():
    gen = torch.Generator().manual_seed(0)
    x, out = torch.randn(6, 8, generator=gen), torch.randn(6, 5, generator=gen)
    a1, b1 = torch.randn(2, 8, generator=gen), torch.randn(5, 2, generator=gen)
    a2, b2 = torch.randn(3, 8, generator=gen), torch.randn(5, 3, generator=gen)
    w1, w2 = SimpleNamespace(weights=[{"o_proj": (a1, b1)}]), SimpleNamespace(weights=[{}])
    w3 = SimpleNamespace(weights=[{"o_proj": (a2, b2)}])
    step = _build(_reqs(w1, None, w2, w3), [2, 1, 1, 2], [1, 5])
    ctx = LoRAContext(add_lora_torch)
    ctx.begin(step)
    got = out.clone()
    ctx.add(got, x, 0, "o_proj")
    want = out.clone()
    want[0:2] += x[0:2] @ a1.T @ b1.T
    want[4:6] += x[4:6] @ a2.T @ b2.T  # rows 2 (base) and 3 (no o_proj term) unchanged
    torch.testing.assert_close(got, want)
    ctx.to_logits_rows()
    assert [_rows(g) for g in ctx.rows.groups] == [[0], [1]]
    ctx.begin(None)
    assert ctx.rows is None


def test_stacked_rows_add_what_the_groups_add(monkeypatch):
    """Few rows and several adapters run stacked (rows gathered per adapter, one batched shrink
    and expand per projection): the same sums as per group, base rows and rows of an adapter
    without the projection untouched."""
    from kvmesh.engine.lora import step as lora_step

    gen = torch.Generator().manual_seed(1)
    x, out = torch.randn(7, 8, generator=gen), torch.randn(7, 5, generator=gen)
    a1, b1 = torch.randn(2, 8, generator=gen), torch.randn(5, 2, generator=gen)
    a2, b2 = torch.randn(3, 8, generator=gen), torch.randn(5, 3, generator=gen)
    w1, w2 = SimpleNamespace(weights=[{"o_proj": (a1, b1)}]), SimpleNamespace(weights=[{}])
    w3 = SimpleNamespace(weights=[{"o_proj": (a2, b2)}])
    reqs = _reqs(w1, None, w3, w2, w1, w3)
    q_lens, logits = [2, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6]
    got = {}
    for limit in (0, 64):
        monkeypatch.setattr(lora_step, "STACKED_MAX_ROWS", limit)
        built = _build(reqs, q_lens, logits)
        assert (built.full.gather is not None) == (limit == 64)
        if limit:  # each adapter's rows, padded with row 0 (masked)
            assert built.full.gather.tolist() == [[0, 1, 5], [3, 6, 0], [4, 0, 0]]
            assert built.full.valid.view(3, 3).tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
        ctx = LoRAContext(add_lora_torch)
        ctx.begin(built)
        got[limit] = out.clone()
        ctx.add(got[limit], x, 0, "o_proj")
    want = out.clone()
    for rows, (a, b) in (([0, 1, 5], (a1, b1)), ([3, 6], (a2, b2))):
        want[rows] += x[rows] @ a.T @ b.T
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[64], want)


def test_the_compiled_kernel_adds_what_torch_adds():
    """kernels/lora_cpu.cpp lora_add_rows: each adapter's rows, up to its rank; padding rows,
    padding ranks and an adapter without the projection (rank 0) add nothing."""
    from kvmesh.engine.kernels import cpu as cpu_kernels

    ops = cpu_kernels.load()
    if ops is None:
        pytest.skip("the CPU kernels did not build here")
    gen = torch.Generator().manual_seed(2)
    x, out = torch.randn(9, 40, generator=gen), torch.randn(9, 24, generator=gen)
    a = torch.randn(3, 6, 40, generator=gen)
    bt = torch.randn(3, 6, 24, generator=gen)
    ranks = torch.tensor([6, 4, 0])
    gather = torch.tensor([[1, 7, 3], [0, 5, 0], [2, 0, 0]])
    counts = torch.tensor([3, 2, 1])
    got = out.clone()
    ops.lora_add_rows(got, x, gather, counts, a, bt, ranks)
    want = out.clone()
    for g in range(3):
        r = int(ranks[g])
        for row in gather[g, : int(counts[g])].tolist():
            want[row] += (a[g, :r] @ x[row]) @ bt[g, :r]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[[4, 6, 8]], out[[4, 6, 8]])  # rows of no adapter (or of rank 0)


def test_a_kernel_that_takes_groups_gets_no_stacked_rows():
    """The Triton kernels take groups: a short step builds no stacked batch for them."""
    w1, w2 = SimpleNamespace(weights=[{}]), SimpleNamespace(weights=[{}])
    qsl = np.array([0, 1, 2])
    built = build_lora_step(
        _reqs(w1, w2), qsl, np.array([0, 1]), lambda a: a.weights, torch.as_tensor, stack=False
    )
    assert built.full.gather is None and built.logits.gather is None
    assert len(built.full.groups) == 2
    assert not LoRAContext(lambda *a: None).stacks and LoRAContext(add_lora_torch).stacks
