"""The Triton kernels (kernels/triton_attention.py, kernels/triton_ops.py) on the CPU under
Triton's interpreter, against plain-torch references: KV write, paged attention for mixed
batches (decodes, fresh prefills, chunks after cached context, contexts crossing block
boundaries and of exactly one block; split-KV), and the fused ops; fp32 and bf16.

Shapes are small: the interpreter runs every program instance in Python. On a GPU machine,
``TRITON_INTERPRET=0 pytest tests/engine/test_triton_kernels.py`` runs the same tests compiled,
on the GPU (bench/gpu_check.sh does)."""

from __future__ import annotations

import os

os.environ.setdefault(
    "TRITON_INTERPRET", "1"
)  # before the kernels are imported (triton.jit reads it)

import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip(
    "triton", reason="triton is not installed (the test extra installs it)"
)

from kvmesh.engine.attention_backends import PAD_SLOT, TritonBackend, TritonMetadata  # noqa: E402
from kvmesh.engine.kernels import triton_attention, triton_ops  # noqa: E402

# Interpreted on the CPU, or compiled on a GPU when TRITON_INTERPRET=0 was set before the import.
DEV = "cpu" if triton_attention.INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    DEV == "cuda" and not torch.cuda.is_available(),
    reason="the kernels were imported without TRITON_INTERPRET=1 and there is no GPU",
)


@pytest.fixture(autouse=True)
def _on_kernel_device():
    torch.set_default_device(DEV)
    yield
    torch.set_default_device(None)


# bf16 on the GPU: P is rounded to bf16 for the tensor cores before P @ V.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2 if DEV == "cpu" else 3e-2}
# BF16_NOTE: the interpreter converts fp32 to bf16 differently from the GPU (which rounds to
# nearest even), so a bf16 result may sit one ulp from torch's: bf16 compares within 1e-2.


def _reference(q, k_cache, v_cache, rows, tables, scale):
    """Per sequence: its new tokens' queries over its whole context gathered from the cache,
    causal, in fp32. rows: (new tokens, cached tokens) in batch order."""
    kv_heads, _, bs, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    at = 0
    for (n, ctx), table in zip(rows, tables):
        total = ctx + n
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)])
        keys = (
            k_cache.float().reshape(kv_heads, -1, dim)[:, slots].repeat_interleave(group, 0)
        )  # [H, L, D]
        values = v_cache.float().reshape(kv_heads, -1, dim)[:, slots].repeat_interleave(group, 0)
        qs = q[at : at + n].float().transpose(0, 1)  # [H, n, D]
        scores = qs @ keys.transpose(1, 2) * scale
        q_pos = torch.arange(ctx, total)[:, None]
        scores = scores.masked_fill(torch.arange(total)[None, :] > q_pos, float("-inf"))
        out[at : at + n] = (scores.softmax(-1) @ values).transpose(0, 1)
        at += n
    return out


def _config(heads, kv_heads):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)


def _mixed_case(bs, dim, group, dtype, specs, seed=0):
    """A cache filled with random K/V for every context token, block tables in shuffled blocks,
    and the step's q; the step's own K/V are in the cache as the fused RoPE op leaves them."""
    torch.manual_seed(seed)
    kv_heads = 2 if group < 8 else 1
    heads = kv_heads * group
    need = sum(-(-(n + c) // bs) for n, c in specs)
    blocks = need + 3
    k_cache = torch.randn(kv_heads, blocks, bs, dim).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, bs, dim).to(dtype)
    perm = torch.randperm(blocks).tolist()
    tables, at = [], 0
    for n, c in specs:
        used = -(-(n + c) // bs)
        tables.append(perm[at : at + used])
        at += used
    num_tokens = sum(n for n, _ in specs)
    # q as a strided view into a fused qkv row, as the model passes it.
    q = (
        torch.randn(num_tokens, (heads + 2 * kv_heads) * dim)
        .to(dtype)[:, : heads * dim]
        .view(num_tokens, heads, dim)
    )
    return q, k_cache, v_cache, tables, heads, kv_heads


# (new tokens, cached tokens): decodes (a 1-token context, exactly one block, crossing blocks, long),
# fresh prefills (shorter than, exactly, longer than a block), chunks after cached context.
def padded_tables(tables: list[list[int]], ctx_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Hand-made block tables as the backend takes them: [n, W], zero past each context."""
    width = max(1, int(-(-ctx_lens.max() // block_size)))
    out = np.zeros((len(tables), width), dtype=np.int64)
    for i, (t, n) in enumerate(zip(tables, ctx_lens)):
        used = -(-int(n) // block_size)
        out[i, :used] = t[:used]
    return out


def step_metadata(backend: TritonBackend, rows: list[tuple[int, int, list[int]]]) -> TritonMetadata:
    """A hand-made step's metadata: (new tokens, cached tokens, block table) per sequence, none sampling."""
    q_lens = np.array([n for n, _, _ in rows], dtype=np.int64)
    starts = np.array([c for _, c, _ in rows], dtype=np.int64)
    tables = padded_tables([t for _, _, t in rows], starts + q_lens, backend.block_size)
    return backend.metadata(q_lens, starts, tables, None, None, np.zeros(0, dtype=np.int64))


MIXED = [(1, 0), (1, 15), (1, 40), (5, 0), (16, 0), (19, 13), (3, 32), (1, 70), (37, 0)]


@pytest.mark.parametrize(
    "bs, dim, group, dtype",
    [
        (16, 64, 1, torch.float32),
        (32, 128, 4, torch.float32),
        (16, 128, 8, torch.bfloat16),
        (32, 64, 4, torch.bfloat16),
    ],
)
def test_mixed_batch_matches_reference(bs, dim, group, dtype):
    """One step through the backend's own metadata: decode rows (split-KV) and prefill tiles."""
    q, k_cache, v_cache, tables, heads, kv_heads = _mixed_case(bs, dim, group, dtype, MIXED)
    backend = TritonBackend(_config(heads, kv_heads), bs, torch.device(DEV))
    backend.target_programs = 64  # as on a small GPU: the few decode rows are split
    rows = [(n, c, t) for (n, c), t in zip(MIXED, tables)]
    meta = step_metadata(backend, rows)
    assert meta.num_decodes == 4
    # The long decode rows take the split path. Whether the heuristic splits these short contexts
    # depends on the key tile (larger when compiled for a GPU): force two ranges where it does not.
    meta.num_splits = max(meta.num_splits, 2)
    assert meta.num_tiles == sum(-(-n // backend.block_q) for n, _ in MIXED if n > 1)
    scale = dim**-0.5
    got = backend.forward(q, None, None, k_cache, v_cache, meta, scale)
    ref = _reference(q, k_cache, v_cache, MIXED, tables, scale)
    tol = TOL[dtype]
    assert torch.allclose(got.float(), ref, atol=tol, rtol=tol), (got.float() - ref).abs().max()


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_kv_reduction(num_splits):
    """The same decode rows with 1, 3 and 8 key ranges (8 leaves some ranges empty for the short rows)."""
    specs = [(1, 0), (1, 31), (1, 32), (1, 100)]
    q, k_cache, v_cache, tables, heads, kv_heads = _mixed_case(
        16, 64, 4, torch.float32, specs, seed=1
    )
    backend = TritonBackend(_config(heads, kv_heads), 16, torch.device(DEV))
    meta = step_metadata(backend, [(n, c, t) for (n, c), t in zip(specs, tables)])
    meta.num_splits = num_splits
    got = backend.forward(q, None, None, k_cache, v_cache, meta, 0.125)
    ref = _reference(q, k_cache, v_cache, specs, tables, 0.125)
    assert torch.allclose(got, ref, atol=2e-5, rtol=2e-5)


def test_decode_padding_rows_give_zeros_and_read_nothing():
    """A context of length 0 (a CUDA-graph padding row, block table all zeros) yields zeros, not NaN."""
    specs = [(1, 20), (1, 0)]
    q, k_cache, v_cache, tables, heads, kv_heads = _mixed_case(
        16, 64, 1, torch.float32, specs, seed=2
    )
    backend = TritonBackend(_config(heads, kv_heads), 16, torch.device(DEV))
    lens = np.array([21, 0])
    meta = backend.decode_metadata(padded_tables([tables[0], [0]], lens, 16), lens)
    for splits in (1, 4):
        meta.num_splits = splits
        got = backend.forward(q, None, None, k_cache, v_cache, meta, 0.125)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        ref = _reference(q[:1], k_cache, v_cache, [(1, 20)], tables[:1], 0.125)
        assert torch.allclose(got[:1], ref, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_and_skips_padding(dtype):
    torch.manual_seed(0)
    kv_heads, blocks, bs, dim = 3, 4, 16, 64
    k_cache = torch.zeros(kv_heads, blocks, bs, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 17, PAD_SLOT, 63, 32])
    k = torch.randn(len(slots), kv_heads, dim).to(dtype)
    v = torch.randn(len(slots), kv_heads, dim).to(dtype)
    triton_attention.store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(kv_heads, -1, dim), v_cache.view(kv_heads, -1, dim)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[:, s], k[i]) and torch.equal(flat_v[:, s], v[i])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(blocks * bs) if s not in written]
    assert not flat_k[:, untouched].any() and not flat_v[:, untouched].any()


def _rope_tables(dim, positions=64, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_matches_torch_path(dtype):
    """RoPE on q and k in place plus the KV store, against the model's torch path (_rotate, write_kv)."""
    from kvmesh.engine.attention import AttentionMetadata, write_kv
    from kvmesh.engine.models.llama import _rotate

    torch.manual_seed(0)
    heads, kv_heads, dim, bs, blocks = 4, 2, 64, 16, 4
    cos, sin = _rope_tables(dim)
    positions = torch.tensor([0, 1, 17, 40, 63])
    slots = torch.tensor([3, 20, 33, 60, 1])
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim).to(dtype)
    ref_qkv = qkv.clone()
    k_cache = torch.zeros(kv_heads, blocks, bs, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    triton_ops.rotary_qk_store_kv_(
        qkv, positions, cos, sin, heads, kv_heads, dim, k_cache, v_cache, slots
    )

    q, k, v = ref_qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # fp32 tables, rotated in fp32
    q_ref = _rotate(q.view(-1, heads, dim).float(), c, s).to(dtype)
    k_ref = _rotate(k.view(-1, kv_heads, dim).float(), c, s).to(dtype)
    ref_k_cache, ref_v_cache = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(
        ref_k_cache,
        ref_v_cache,
        k_ref,
        v.view(-1, kv_heads, dim),
        AttentionMetadata(
            slots=slots,
            decode_indices=None,
            decode_block_tables=None,
            decode_mask=None,
            prefills=[],
        ),
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: within an ulp (see BF16_NOTE)
    assert torch.allclose(
        qkv[:, : heads * dim].float(), q_ref.reshape(len(positions), -1).float(), atol=tol, rtol=tol
    )
    assert torch.allclose(k_cache.float(), ref_k_cache.float(), atol=tol, rtol=tol)
    assert torch.equal(v_cache, ref_v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_silu_match_torch(dtype):
    from kvmesh.engine.models.llama import RMSNorm

    torch.manual_seed(0)
    hidden, rows = 96, 20  # not a power of two: masked columns
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x = torch.randn(rows, hidden).to(dtype)
    res = torch.randn(rows, hidden).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    out = torch.empty_like(x)
    triton_ops.rms_norm(out, x, norm.weight.data, 1e-5)
    with torch.no_grad():
        assert torch.allclose(out.float(), norm(x).float(), atol=tol, rtol=tol)
        ref_x, ref_res = norm(x, res)
    x2, res2 = x.clone(), res.clone()
    triton_ops.fused_add_rms_norm(x2, res2, norm.weight.data, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(res2, ref_res)  # the residual stream: the same sum as torch's add
    assert torch.allclose(res2.float(), ref_res.float(), atol=tol, rtol=tol)
    assert torch.allclose(x2.float(), ref_x.float(), atol=tol, rtol=tol)

    gate_up = torch.randn(rows, 2 * 80).to(dtype)
    ref = torch.nn.functional.silu(gate_up[:, :80]) * gate_up[:, 80:]
    assert torch.allclose(triton_ops.silu_and_mul(gate_up).float(), ref.float(), atol=tol, rtol=tol)


def test_prefill_tile_reads_only_its_causal_keys():
    """Slots past the last query's position hold NaN: a tile that read them would return NaN."""
    bs, dim = 16, 64
    specs = [(20, 5)]
    q, k_cache, v_cache, tables, heads, kv_heads = _mixed_case(
        bs, dim, 1, torch.float32, specs, seed=3
    )
    flat_k = k_cache.view(kv_heads, -1, dim)
    table = tables[0]
    backend = TritonBackend(_config(heads, kv_heads), bs, torch.device(DEV))
    meta = step_metadata(backend, [(20, 5, table)])
    ref = _reference(q, k_cache, v_cache, specs, tables, dim**-0.5)
    # Rows past the context (slot 25 .. end of its last block) are never part of any query's keys.
    for p in range(25, len(table) * bs):
        flat_k[:, table[p // bs] * bs + p % bs] = float("nan")
    got = backend.forward(q, None, None, k_cache, v_cache, meta, dim**-0.5)
    assert not math.isnan(got.sum().item())
    assert torch.allclose(got, ref, atol=2e-5)
