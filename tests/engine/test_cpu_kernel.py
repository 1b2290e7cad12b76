"""The compiled CPU kernels (decode and prefill attention, fused ops) against the torch reference path."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.attention import AttentionMetadata, PrefillSeq, paged_attention
from kvmesh.engine.kernels import cpu


@pytest.fixture(scope="module")
def native_kernel():
    module = cpu.load()
    if module is None:
        pytest.fail(
            "the CPU kernel failed to build (a C++ compiler and ninja are part of the engine extra)"
        )
    return module


def _cpuinfo_flags() -> str:
    import platform

    return open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""


@pytest.fixture(scope="module")
def avx2_kernel(tmp_path_factory):
    """The kernels built for AVX2 without AVX-512 (x86-64-v3: AMD Zen 2/3, Intel Haswell to the
    client parts), so their 8-lane paths are checked on an AVX-512 machine too."""
    import platform

    from torch.utils.cpp_extension import load

    flags = _cpuinfo_flags()
    if platform.machine() != "x86_64" or " avx2 " not in flags or " fma " not in flags:
        pytest.skip("needs an x86-64 CPU with AVX2 and FMA")
    if " avx512f " not in flags and not cpu.portable():
        pytest.skip("this CPU has no AVX-512: the native build is the AVX2 build")
    d = tmp_path_factory.mktemp("kernels_avx2")
    return load(
        name="kvmesh_cpu_ops_avx2_test",
        sources=[str(s) for s in cpu._SOURCES],
        extra_cflags=["-O3", "-fopenmp", "-ffast-math", "-march=x86-64-v3"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(d),
        verbose=False,
    )


@pytest.fixture(params=["native", "avx2"])
def kernel(request):
    """Every kernel test runs on the machine's own build and on the AVX2 build."""
    return request.getfixturevalue(f"{request.param}_kernel")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize(
    "dim, bs", [(32, 4), (64, 16), (64, 32), (128, 8)]
)  # 64: the AVX-512 path; 128: templated
def test_kernel_matches_torch_gather_path(kernel, dtype, tol, heads, kv_heads, dim, bs):
    torch.manual_seed(0)
    blocks = 64
    k_cache = torch.randn(kv_heads, blocks, bs, dim).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, bs, dim).to(dtype)
    # Up to 3 of the AVX-512 path's 64-key chunks: whole, partial, and a partial last tile.
    lens = torch.tensor([1, 3, 4, 5, 17, 33, 64, 65, 128, 150])
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in lens])
    # q as a view into a fused qkv row, as the model passes it (rows farther apart than H * D).
    q = (
        torch.randn(len(lens), (heads + 2 * kv_heads) * dim)
        .to(dtype)[:, : heads * dim]
        .view(len(lens), heads, dim)
    )
    k_new = torch.randn(len(lens), kv_heads, dim).to(dtype)
    mask = torch.where(torch.arange(width * bs)[None, :] < lens[:, None], 0.0, float("-inf"))
    common = dict(
        slots=None, decode_indices=torch.arange(len(lens)), decode_block_tables=tables, prefills=[]
    )
    ref = paged_attention(
        q, k_new, k_new, k_cache, v_cache, AttentionMetadata(decode_mask=mask, **common), dim**-0.5
    )
    got = paged_attention(
        q,
        k_new,
        k_new,
        k_cache,
        v_cache,
        AttentionMetadata(decode_mask=None, decode_ctx_lens=lens, cpu_ops=kernel, **common),
        dim**-0.5,
    )
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (8, 1), (12, 1)])
@pytest.mark.parametrize("bs", [16, 32])
def test_bf16_decode_is_the_fp32_path_on_widened_rows(kernel, heads, kv_heads, bs):
    """Head size 64 over a bf16 cache: each element is widened exactly and every sum is fp32, so
    the result is the fp32 kernel's on the widened tensors, rounded to bf16 once (register
    accumulators for groups of up to 4, memory ones above)."""
    torch.manual_seed(0)
    blocks, dim = 64, 64
    k_cache = torch.randn(kv_heads, blocks, bs, dim).bfloat16()
    v_cache = torch.randn(kv_heads, blocks, bs, dim).bfloat16()
    lens = torch.tensor([1, 15, 16, 17, 64, 65, 200])
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in lens])
    q = torch.randn(len(lens), heads + 2 * kv_heads, dim).bfloat16()[:, :heads]
    got = kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    want = kernel.paged_decode_attention(
        q.float(), k_cache.float(), v_cache.float(), tables, lens, dim**-0.5
    )
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())


# Groups of 1, 3 and 8 query heads per KV head, and 12: more than a work item takes (split in 8 + 4).
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1), (24, 2)])
@pytest.mark.parametrize("dim, bs", [(64, 16), (128, 32)])
def test_prefill_kernel_matches_torch_path(kernel, heads, kv_heads, dim, bs):
    """One kernel call for a mix of fresh prefills, chunks after cached context and one-row tails;
    every key is read from the paged cache (unwritten slots hold NaN: they must never be read)."""
    if not kernel.prefill_attention_supported(torch.float32, dim, bs):
        pytest.skip(
            "the kernels were built without AVX2 (KVMESH_CPU_KERNELS_PORTABLE=1 or an older CPU)"
        )
    torch.manual_seed(0)
    blocks = 64
    k_cache = torch.full((kv_heads, blocks, bs, dim), float("nan"))
    v_cache = torch.full((kv_heads, blocks, bs, dim), float("nan"))
    # (new tokens, cached tokens): tiles of 16 query rows, partial tiles, diagonal key tiles.
    specs = [(1, 0), (5, 0), (17, 3), (16, 16), (33, 47), (2, 100), (70, 0), (40, 9)]
    num_tokens = sum(n for n, _ in specs)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)  # a strided view, as in the model
    k = torch.randn(num_tokens, kv_heads, dim)
    v = torch.randn(num_tokens, kv_heads, dim)
    free = torch.randperm(blocks).tolist()
    rows, tables, prefills, offset = [], [], [], 0
    for n, ctx in specs:
        table = [free.pop() for _ in range((n + ctx + bs - 1) // bs)]
        slots = torch.arange(n + ctx)
        blk, off = torch.tensor(table)[slots // bs], slots % bs
        k_cache[:, blk[:ctx], off[:ctx]] = torch.randn(kv_heads, ctx, dim)  # the cached prefix
        v_cache[:, blk[:ctx], off[:ctx]] = torch.randn(kv_heads, ctx, dim)
        k_cache[:, blk[ctx:], off[ctx:]] = k[offset : offset + n].transpose(
            0, 1
        )  # this step's rows
        v_cache[:, blk[ctx:], off[ctx:]] = v[offset : offset + n].transpose(0, 1)
        rows.append((offset, n, ctx))
        tables.append(table)
        prefills.append(PrefillSeq(offset, n, ctx, torch.tensor(table) if ctx else None))
        offset += n
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    common = dict(slots=None, decode_indices=None, decode_block_tables=None, decode_mask=None)
    ref = paged_attention(
        q, k, v, k_cache, v_cache, AttentionMetadata(prefills=prefills, **common), dim**-0.5
    )
    got = paged_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        AttentionMetadata(
            prefills=[],
            cpu_ops=kernel,
            prefill_seqs=torch.tensor(rows),
            prefill_block_tables=padded,
            **common,
        ),
        dim**-0.5,
    )
    assert not got.isnan().any()
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (24, 2)])
@pytest.mark.parametrize("dim", [64, 128])
def test_prefill_kernel_row_does_not_depend_on_its_tile(kernel, heads, kv_heads, dim):
    """The kernel takes up to 32 query rows a tile; a row's output must be bit for bit what it is
    in a 16-row tile (the same sequence fed as 16-row chunks after their cached context), so a
    request's numbers do not depend on how a step's budget cut its prompt."""
    if not kernel.prefill_attention_supported(torch.float32, dim, 16):
        pytest.skip(
            "the kernels were built without AVX2 (KVMESH_CPU_KERNELS_PORTABLE=1 or an older CPU)"
        )
    torch.manual_seed(1)
    bs, blocks, cached, new = (
        16,
        16,
        9,
        75,
    )  # 75 rows: tiles of 32, 32 and 11; the chunks: 16 x 4 + 11
    k_cache = torch.randn(kv_heads, blocks, bs, dim)
    v_cache = torch.randn(kv_heads, blocks, bs, dim)
    table = torch.randperm(blocks)[: (cached + new + bs - 1) // bs][None, :]
    q = torch.randn(new, heads, dim)
    whole, chunked = torch.empty_like(q), torch.empty_like(q)
    kernel.paged_prefill_attention(
        whole, q, k_cache, v_cache, torch.tensor([[0, new, cached]]), table, dim**-0.5
    )
    chunks = torch.tensor([[r, min(16, new - r), cached + r] for r in range(0, new, 16)])
    kernel.paged_prefill_attention(
        chunked, q, k_cache, v_cache, chunks, table.expand(len(chunks), -1).contiguous(), dim**-0.5
    )
    assert torch.equal(whole, chunked)


def _prefill_batch(heads, kv_heads, dim, bs, specs, dtype, seed=0):
    """A step's prefills over a paged cache: (q, k_cache, v_cache, seqs, tables) for the kernel,
    the (new tokens, cached tokens) of ``specs`` in scattered blocks; unwritten slots hold NaN."""
    torch.manual_seed(seed)
    blocks = 64
    k_cache = torch.full((kv_heads, blocks, bs, dim), float("nan"), dtype=dtype)
    v_cache = torch.full((kv_heads, blocks, bs, dim), float("nan"), dtype=dtype)
    num_tokens = sum(n for n, _ in specs)
    q = torch.randn(num_tokens, heads + 2 * kv_heads, dim).to(dtype)[:, :heads]  # a qkv view
    free = torch.randperm(blocks).tolist()
    rows, tables, offset = [], [], 0
    for n, ctx in specs:
        table = [free.pop() for _ in range((n + ctx + bs - 1) // bs)]
        slots = torch.arange(n + ctx)
        blk, off = torch.tensor(table)[slots // bs], slots % bs
        k_cache[:, blk, off] = torch.randn(kv_heads, n + ctx, dim).to(dtype)
        v_cache[:, blk, off] = torch.randn(kv_heads, n + ctx, dim).to(dtype)
        rows.append((offset, n, ctx))
        tables.append(table)
        offset += n
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return q, k_cache, v_cache, torch.tensor(rows), padded


def _prefill_reference(q, k_cache, v_cache, seqs, tables):
    """Causal attention of each sequence's new rows over its whole context, in fp32 (torch)."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[0], q.shape[2]
    out = torch.empty(q.shape)
    for (start, n, ctx), table in zip(seqs.tolist(), tables):
        total = ctx + n
        ks = k_cache[:, table].flatten(1, 2)[:, :total].float()
        vs = v_cache[:, table].flatten(1, 2)[:, :total].float()
        mask = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]
        qs = q[start : start + n].float().transpose(0, 1)
        attn = torch.nn.functional.scaled_dot_product_attention(
            qs[None],
            ks[None],
            vs[None],
            attn_mask=mask,
            scale=dim**-0.5,
            enable_gqa=heads > kv_heads,
        )
        out[start : start + n] = attn[0].transpose(0, 1)
    return out


# Fresh prefills, chunks after cached context (tiles of 16 and 32 rows, partial and diagonal
# key tiles), one-row tails; groups of 1, 3, 8 and 12 query heads per KV head.
PREFILL_SPECS = [(1, 0), (5, 0), (17, 3), (16, 16), (33, 47), (2, 100), (70, 0), (40, 9)]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1), (24, 2)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
def test_bf16_prefill_is_the_fp32_path_on_widened_rows(kernel, heads, kv_heads, dim, bs):
    """bf16 q and cache: every element widened exactly, every sum in fp32 and the output rounded
    to bf16 once, so the result is the fp32 kernel's on the widened tensors, rounded; and within
    one bf16 rounding of torch's fp32 attention on them."""
    assert kernel.prefill_attention_supported(torch.bfloat16, dim, bs)
    q, k_cache, v_cache, seqs, tables = _prefill_batch(
        heads, kv_heads, dim, bs, PREFILL_SPECS, torch.bfloat16
    )
    got = torch.empty(q.shape, dtype=torch.bfloat16)
    kernel.paged_prefill_attention(got, q, k_cache, v_cache, seqs, tables, dim**-0.5)
    wide = torch.empty(q.shape)
    kernel.paged_prefill_attention(
        wide, q.float(), k_cache.float(), v_cache.float(), seqs, tables, dim**-0.5
    )
    assert torch.equal(got, wide.bfloat16())
    ref = _prefill_reference(q, k_cache, v_cache, seqs, tables)
    # One bf16 rounding: half an ulp of 8 significant bits, plus the fp32 kernel's own error.
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()


def test_prefill_kernel_declines_what_it_does_not_cover(kernel):
    assert kernel.prefill_attention_supported(torch.bfloat16, 64, 16)
    assert kernel.prefill_attention_supported(torch.bfloat16, 128, 32)
    assert not kernel.prefill_attention_supported(torch.float16, 64, 16)  # the torch path serves it
    assert not kernel.prefill_attention_supported(torch.bfloat16, 80, 16)
    assert not kernel.prefill_attention_supported(torch.float32, 80, 16)
    assert not kernel.prefill_attention_supported(
        torch.float32, 64, 4
    )  # AVX-512 takes 16k, AVX2 8k


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_norms_match_torch(kernel, dtype, tol):
    from kvmesh.engine.models.llama import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x, residual = torch.randn(37, 96).to(dtype), torch.randn(37, 96).to(dtype)
    ref_out, ref_res = norm._norm(x + residual), x + residual
    out = torch.empty_like(x)
    kernel.rms_norm(out, x, norm.weight.data, norm.eps)
    assert torch.allclose(out.float(), norm._norm(x).float(), atol=tol, rtol=tol)
    xi, ri = x.clone(), residual.clone()
    kernel.fused_add_rms_norm(xi, ri, norm.weight.data, norm.eps)  # in place
    assert torch.allclose(ri.float(), ref_res.float(), atol=tol, rtol=tol)
    assert torch.allclose(xi.float(), ref_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_rotary_and_silu_match_torch(kernel, dtype, tol):
    import torch.nn.functional as F

    from kvmesh.engine.config import ModelConfig
    from kvmesh.engine.models.llama import RotaryEmbedding, _rotate

    torch.manual_seed(0)
    heads, kv_heads, dim = 6, 2, 16
    config = ModelConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=heads * dim,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        torch_dtype=None,
    )
    rope = RotaryEmbedding(config, 128)
    positions = torch.tensor([0, 1, 5, 17, 100, 127])
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    cos, sin = rope(positions, dtype)
    ref_q = _rotate(q.reshape(-1, heads, dim), cos, sin).reshape(len(positions), -1)
    ref_k = _rotate(k.reshape(-1, kv_heads, dim), cos, sin).reshape(len(positions), -1)
    ref_v = v.clone()
    # Rotation in place, with each row's k and v heads stored in its cache slot.
    blocks, bs = 5, 4
    k_cache = torch.zeros(kv_heads, blocks, bs, dim).to(dtype)
    v_cache = torch.zeros(kv_heads, blocks, bs, dim).to(dtype)
    slots = torch.tensor([7, 0, 19, 4, 12, 3])
    got = qkv.clone()
    kernel.rotary_qk_store_kv_(
        got, positions, rope.cos, rope.sin, heads, kv_heads, dim, k_cache, v_cache, slots
    )
    gq, gk, gv = got.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert torch.allclose(gq.float(), ref_q.float(), atol=tol, rtol=tol)
    assert torch.allclose(gk.float(), ref_k.float(), atol=tol, rtol=tol)
    assert torch.equal(gv, ref_v)  # v is left alone
    assert torch.equal(
        k_cache.view(kv_heads, -1, dim)[:, slots], gk.view(-1, kv_heads, dim).transpose(0, 1)
    )
    assert torch.equal(
        v_cache.view(kv_heads, -1, dim)[:, slots], gv.reshape(-1, kv_heads, dim).transpose(0, 1)
    )
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(kv_heads, -1, dim)[:, untouched].any()

    gate_up = torch.randn(9, 2 * 40).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -30.0, 30.0])  # exp over- and underflow
    gate, up = gate_up.split(40, dim=-1)
    assert torch.allclose(
        kernel.silu_and_mul(gate_up).float(), (F.silu(gate) * up).float(), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("width", [1, 7, 37, 1536])
def test_bf16_silu_and_mul_widths(kernel, width):
    """bf16 rows of any width (the vector paths' partial last vector): silu rounded to bf16, then
    the product, as torch's two ops round."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    gate_up = (torch.randn(5, 2 * width) * 4).bfloat16()
    gate, up = gate_up.split(width, dim=-1)
    got = kernel.silu_and_mul(gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == (5, width)
    assert torch.allclose(got.float(), (F.silu(gate) * up).float(), atol=1e-2, rtol=1e-2)


PANEL_SHAPES = [(960, 576), (37, 19), (16, 1), (5, 64)]  # panel tails, a 1-wide input


def _check_panel_linear(ops, n, k, bias):
    torch.manual_seed(0)
    w = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    panels = ops.pack_panels(w)
    assert panels.shape == ((n + 15) // 16, k, 16)
    for m in [*range(1, 18), 33]:
        x = torch.randn(m, k + 3)[:, :k]  # rows farther apart than k
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        got = ops.panel_linear(x, panels, n, b)
        assert got.shape == (m, n)
        assert torch.allclose(got.double(), ref, atol=1e-4 * k**0.5, rtol=1e-5), (
            m,
            (got.double() - ref).abs().max(),
        )


@pytest.mark.parametrize("n, k", PANEL_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear(kernel, n, k, bias):
    """Every row count the row-block templates cover (1-16, then a second block), on a strided x."""
    _check_panel_linear(kernel, n, k, bias)


@pytest.mark.parametrize("n, k", [(203, 67), (3059, 576)])  # 13 and 192 panels, a partial last one
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_tiles_are_bit_identical_to_one_panel(kernel, n, k, bias, dtype):
    """At every row count the kernel runs register tiles over several panels; every output is
    still one chain over k in order plus the bias, so it equals bit for bit the one-panel
    layer's result (a layer of one panel takes the one-panel block)."""
    torch.manual_seed(0)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    panels = kernel.pack_panels(w)
    for m in [*range(1, 17), 29]:
        x = torch.randn(m, k + 3).to(dtype)[:, :k]
        got = kernel.panel_linear(x, panels, n, b)
        for p in range(panels.shape[0]):
            cols = slice(16 * p, min(16 * p + 16, n))
            one = kernel.panel_linear(
                x,
                panels[p : p + 1].contiguous(),
                cols.stop - cols.start,
                None if b is None else b[cols],
            )
            assert torch.equal(got[:, cols], one), (m, p)


@pytest.mark.parametrize("n, k", [(203, 67), (960, 576), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(kernel, n, k, dtype):
    """Batch invariance: each row of a batch of 1-33 rows equals that row computed alone, bit for
    bit, so a request's decode does not change with the requests batched beside it."""
    torch.manual_seed(0)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype)
    panels = kernel.pack_panels(w)
    x = torch.randn(33, k).to(dtype)
    alone = torch.cat([kernel.panel_linear(x[i : i + 1], panels, n, b) for i in range(33)])
    for m in [*range(1, 18), 29, 33]:
        for start in (0, 33 - m):  # the same rows at other positions in the batch
            got = kernel.panel_linear(x[start : start + m], panels, n, b)
            assert torch.equal(got, alone[start : start + m]), (m, start)


@pytest.mark.parametrize("n, k", PANEL_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panel_linear_matches_f_linear(kernel, n, k, bias):
    """bf16 weights and rows (the pair-packed panels, odd k included): fp32 sums rounded once."""
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    panels = kernel.pack_panels(w)
    assert panels.dtype == torch.bfloat16 and panels.shape == ((n + 15) // 16, (k + 1) // 2, 32)
    for m in [*range(1, 18), 33]:
        x = torch.randn(m, k + 3).bfloat16()[:, :k]
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        got = kernel.panel_linear(x, panels, n, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # One bf16 rounding of the result (2^-8 relative), plus fp32 summation order.
        assert torch.allclose(got.double(), ref, atol=1e-4 * k**0.5, rtol=2**-8), m


def test_onednn_linear_sends_decode_sizes_to_panels_and_prefill_to_onednn(kernel, monkeypatch):
    """Up to panel_max_rows rows take the panel kernel, more take oneDNN; both equal F.linear."""
    from kvmesh.engine.kernels import onednn_linear

    if not onednn_linear.available(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    torch.manual_seed(1)
    w, b = torch.randn(200, 64), torch.randn(200)
    layer = onednn_linear.OneDNNLinear(w, b, 16, kernel)
    calls = []
    real = kernel.panel_linear
    monkeypatch.setattr(
        layer,
        "panel_ops",
        type(
            "Ops",
            (),
            {"panel_linear": staticmethod(lambda *a: calls.append(a[0].shape[0]) or real(*a))},
        )(),
    )
    most = onednn_linear.panel_max_rows(torch.float32)
    for m in (1, most, most + 1, 100):
        x = torch.randn(2, m + 1, 64)[1][
            1:
        ]  # rows with a stride: the kernel takes them as they are
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, w, b), atol=1e-4)
    assert calls == [1, most]
    monkeypatch.setenv("KVMESH_PANEL_LINEAR", "0")
    assert onednn_linear.OneDNNLinear(w, b, 16, kernel).panels is None


def test_the_panels_take_more_rows_only_on_an_avx512_build(monkeypatch):
    """Past 16 rows the panels beat oneDNN only where they run their AVX-512 paths (measured in
    onednn_linear.py): a portable build or a CPU without AVX-512F keeps 16 for every dtype."""
    from kvmesh.engine import native_bf16
    from kvmesh.engine.kernels import onednn_linear

    def rows(flags: set[str], portable: bool) -> tuple[int, int]:
        monkeypatch.setattr(native_bf16, "cpu_flags", lambda: flags)
        monkeypatch.setenv("KVMESH_CPU_KERNELS_PORTABLE", "1" if portable else "0")
        onednn_linear._avx512_build.cache_clear()
        return onednn_linear.panel_max_rows(torch.float32), onednn_linear.panel_max_rows(
            torch.bfloat16
        )

    try:
        assert rows({"avx2", "fma", "avx512f"}, portable=False) == (64, 32)
        assert rows({"avx2", "fma", "avx512f"}, portable=True) == (16, 16)
        assert rows({"avx2", "fma"}, portable=False) == (16, 16)
    finally:
        onednn_linear._avx512_build.cache_clear()


def test_onednn_keeps_bf16_off_cpus_it_cannot_pack_for(monkeypatch):
    """oneDNN's bf16 weight reorder raises on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT
    (an AVX2 machine): bf16 then stays on F.linear rather than failing the engine's start."""
    from kvmesh.engine.kernels import onednn_linear

    cpu_device = torch.device("cpu")
    if not onednn_linear.available(cpu_device, torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    monkeypatch.setattr(onednn_linear, "_bf16_supported", lambda: False)
    assert not onednn_linear.available(cpu_device, torch.bfloat16)
    assert onednn_linear.available(cpu_device, torch.float32)
    monkeypatch.setattr(onednn_linear, "_bf16_supported", lambda: True)
    assert onednn_linear.available(cpu_device, torch.bfloat16)
