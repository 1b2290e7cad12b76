"""The Triton LoRA shrink/expand (kernels/triton_lora.py) against the torch path, on the CPU under
Triton's interpreter (compiled on a GPU with ``TRITON_INTERPRET=0``)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kvmesh.engine.kernels import triton_attention  # noqa: E402
from kvmesh.engine.kernels.triton_lora import add_lora_triton  # noqa: E402
from kvmesh.engine.lora.step import add_lora_torch  # noqa: E402

DEV = "cpu" if triton_attention.INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    DEV == "cuda" and not torch.cuda.is_available(),
    reason="the kernels were imported without TRITON_INTERPRET=1 and there is no GPU",
)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows",
    [slice(0, 7), slice(5, 41), [1, 4, 5, 9, 30, 31, 32, 33, 34, 40], [3]],
    ids=["head", "contiguous", "gathered", "one-row"],
)
@pytest.mark.parametrize("rank,k_dim,n_dim", [(2, 64, 96), (8, 48, 33), (24, 70, 128)])
def test_matches_the_torch_path(dtype, rows, rank, k_dim, n_dim):
    gen = torch.Generator().manual_seed(rank + k_dim)
    x = torch.randn(42, k_dim, generator=gen).to(DEV, dtype)
    a = (torch.randn(rank, k_dim, generator=gen) * 0.3).to(DEV, dtype)
    b = (torch.randn(n_dim, rank, generator=gen) * 0.3).to(DEV, dtype)
    base = torch.randn(42, n_dim, generator=gen).to(DEV, dtype)
    if isinstance(rows, list):
        rows = torch.tensor(rows, dtype=torch.long, device=DEV)
    expected, got = base.clone(), base.clone()
    # Garbage (NaN) in the allocator's free memory must not reach the padded rank columns.
    torch.full((4096,), float("nan"), device=DEV)
    add_lora_torch(expected, x, rows, a, b)
    add_lora_triton(got, x, rows, a, b)
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])
    untouched = torch.ones(42, dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert torch.equal(got[untouched], base[untouched])  # other rows are left as they were
