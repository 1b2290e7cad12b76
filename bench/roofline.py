#!/usr/bin/env python3
"""The CPU kernels against this machine's limits, both measured in the same run.

A decode step of a small batch is a stream over the weights and the K/V cache; a prefill step is
matrix products. So each kernel is set against one of two baselines taken in every round:

  stream  read bandwidth: torch's sum over a buffer far larger than the last-level cache
  peak    fp32 matmul rate: oneDNN on a weight that stays in cache (576 x 576, 512 rows)

and the kernels run on the model's shapes (the built-in model's config; random weights, each
layer its own, so nothing is warm that would not be):

  decode linears     panel kernel (kernels/panel_linear_cpu.cpp) at --batch rows: weight bytes / time
  LM head            the same kernel on the vocabulary projection
  decode attention   kernels/paged_attention_cpu.cpp, --batch requests of --context tokens: K/V bytes / time;
                     with the blocks in order (a fresh pool) and scattered (a pool that has served a while)
  prefill linears    oneDNN on prepacked weights (kernels/onednn_linear.py), --prefill-rows rows: FLOPs / time
  prefill attention  kernels/prefill_attention_cpu.cpp: --prefill-seqs sequences of new tokens after
                     --prefill-cached cached ones, --prefill-rows rows in all: FLOPs / time

Each line prints the rate and its ratio to the baseline (median over --rounds interleaved rounds;
this machine's speed drifts within a run). A ratio near 1 means the kernel is at the machine's
limit: a faster step then needs less work, not a faster kernel. The closing lines add the parts
up into a decode step and a prefill step of all layers, against the time the baselines allow.

  python bench/roofline.py                          # batch 8, context 512, prefill 512 rows
  python bench/roofline.py --batch 16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # python -P leaves bench/ out

from ceiling import best_of, linear_shapes, matmul_peak  # noqa: E402


def model_shapes(model: str) -> dict:
    from kvmesh.engine.builtin import resolve_model_dir
    from kvmesh.engine.config import ModelConfig

    c = ModelConfig.from_dir(str(resolve_model_dir(model)))
    return dict(
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab=c.vocab_size,
        linears=linear_shapes(c),
    )


class Bench:
    def __init__(self, args):
        import torch

        from kvmesh.engine.kernels import cpu
        from kvmesh.engine.kernels.onednn_linear import OneDNNLinear

        self.torch, self.args = torch, args
        self.ops = cpu.load()
        if self.ops is None:
            raise SystemExit("the CPU kernels are not built (kvmesh build-kernels)")
        s = self.shapes = model_shapes(args.model)
        L = s["layers"]
        print(f"packing {L} layers of random weights in {args.model}'s shapes ...", flush=True)
        self.panels = {
            n: [self.ops.pack_panels(torch.randn(N, K)) for _ in range(L)]
            for n, (N, K) in s["linears"].items()
        }
        self.head = self.ops.pack_panels(torch.randn(s["vocab"], s["hidden"]))
        # The prefill linears as the model runs them (oneDNN on prepacked weights; no panels).
        self.linears = {
            n: [OneDNNLinear(torch.randn(N, K), None, args.prefill_rows) for _ in range(L)]
            for n, (N, K) in s["linears"].items()
        }
        self.stream_buf = torch.randn(args.stream_mib << 18)  # MiB of fp32
        # The K/V cache: every layer its own, [kv_heads, blocks, block, head_dim] as the engine lays it out.
        bs, D, Hkv = 16, s["head_dim"], s["kv_heads"]
        ctx = args.context
        per_seq = -(-max(ctx, args.prefill_cached + args.prefill_rows // args.prefill_seqs) // bs)
        nblocks = per_seq * max(args.batch, args.prefill_seqs)
        self.k = [torch.randn(Hkv, nblocks, bs, D) for _ in range(L)]
        self.v = [torch.randn(Hkv, nblocks, bs, D) for _ in range(L)]
        # Block tables: in order (a fresh pool, as in a benchmark run), and scattered (a pool that has
        # served a while: each 16-token block of a head is a 4 KiB read somewhere else).
        perm = torch.randperm(nblocks)
        self.tables = torch.arange(args.batch * per_seq).view(args.batch, per_seq).long()
        self.scattered = perm[: args.batch * per_seq].view(args.batch, per_seq).long()
        self.ctx_lens = torch.full((args.batch,), ctx, dtype=torch.long)
        self.q_dec = torch.randn(args.batch, s["heads"], D)
        n_new = args.prefill_rows // args.prefill_seqs
        self.pf_seqs = torch.tensor(
            [[i * n_new, n_new, args.prefill_cached] for i in range(args.prefill_seqs)],
            dtype=torch.long,
        )
        self.pf_tables = perm[: args.prefill_seqs * per_seq].view(args.prefill_seqs, per_seq).long()
        self.q_pf = torch.randn(n_new * args.prefill_seqs, s["heads"], D)
        self.out_pf = torch.empty_like(self.q_pf)
        self.x = {n: torch.randn(args.batch, K) for n, (N, K) in s["linears"].items()}
        self.xp = {n: torch.randn(args.prefill_rows, K) for n, (N, K) in s["linears"].items()}

    # -- baselines
    def stream(self) -> float:
        buf = self.stream_buf
        return buf.numel() * 4 / best_of(buf.sum, 5)

    def peak(self) -> float:
        return matmul_peak(threads=self.torch.get_num_threads())

    # -- kernels: (work, seconds); work in bytes (decode) or FLOPs (prefill)
    def decode_linears(self) -> tuple[float, float]:
        ops, s = self.ops, self.shapes
        calls = [(self.x[n], w, N) for n, (N, K) in s["linears"].items() for w in self.panels[n]]
        t = best_of(lambda: [ops.panel_linear(x, w, N) for x, w, N in calls], 3)
        return sum(N * K * 4 for (N, K) in s["linears"].values()) * s["layers"], t

    def lm_head(self) -> tuple[float, float]:
        s, x = self.shapes, self.torch.randn(self.args.batch, self.shapes["hidden"])
        return s["vocab"] * s["hidden"] * 4, best_of(
            lambda: self.ops.panel_linear(x, self.head, s["vocab"]), 3
        )

    def decode_attention(self, tables=None) -> tuple[float, float]:
        s, a = self.shapes, self.args
        scale = s["head_dim"] ** -0.5
        att, tables = self.ops.paged_decode_attention, self.tables if tables is None else tables
        t = best_of(
            lambda: [
                att(self.q_dec, k, v, tables, self.ctx_lens, scale) for k, v in zip(self.k, self.v)
            ],
            3,
        )
        return a.batch * a.context * s["kv_heads"] * s["head_dim"] * 4 * 2 * s["layers"], t

    def decode_attention_scattered(self) -> tuple[float, float]:
        return self.decode_attention(self.scattered)

    def prefill_linears(self) -> tuple[float, float]:
        s, a = self.shapes, self.args
        calls = [(self.xp[n], lin) for n in s["linears"] for lin in self.linears[n]]
        t = best_of(lambda: [lin(x) for x, lin in calls], 2)
        return 2 * a.prefill_rows * sum(N * K for (N, K) in s["linears"].values()) * s["layers"], t

    def prefill_attention(self) -> tuple[float, float]:
        s, a = self.shapes, self.args
        scale = s["head_dim"] ** -0.5
        att = self.ops.paged_prefill_attention
        t = best_of(
            lambda: [
                att(self.out_pf, self.q_pf, k, v, self.pf_seqs, self.pf_tables, scale)
                for k, v in zip(self.k, self.v)
            ],
            2,
        )
        n_new, c = a.prefill_rows // a.prefill_seqs, a.prefill_cached
        keys = (
            sum(c + i + 1 for i in range(n_new)) * a.prefill_seqs
        )  # causal: row i sees c + i + 1 keys
        return 4 * keys * s["heads"] * s["head_dim"] * s[
            "layers"
        ], t  # QK^T and PV: 2 FLOPs a multiply-add


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8, help="decode rows")
    ap.add_argument("--context", type=int, default=512, help="decode context per request")
    ap.add_argument(
        "--prefill-rows",
        type=int,
        default=512,
        help="prefill rows in the step (the CPU server's budget)",
    )
    ap.add_argument("--prefill-seqs", type=int, default=4)
    ap.add_argument(
        "--prefill-cached", type=int, default=384, help="tokens each prefill finds in the cache"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--stream-mib", type=int, default=512)
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args)
    kernels = [
        ("decode linears", bench.decode_linears, "stream"),
        ("LM head", bench.lm_head, "stream"),
        ("decode attention", bench.decode_attention, "stream"),
        ("  scattered blocks", bench.decode_attention_scattered, "stream"),
        ("prefill linears", bench.prefill_linears, "peak"),
        ("prefill attention", bench.prefill_attention, "peak"),
    ]
    base: dict[str, list[float]] = {"stream": [], "peak": []}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in kernels}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds} ...", flush=True)
        base["stream"].append(bench.stream())
        base["peak"].append(bench.peak())
        for name, fn, _ in kernels:
            runs[name].append(fn())
    med = statistics.median
    print(
        f"\n{torch.get_num_threads()} threads; {args.model}: {bench.shapes['layers']} layers; medians of "
        f"{args.rounds} rounds, ratios paired within a round"
    )
    print(
        f"   baseline  stream read {med(base['stream']) / 1e9:6.1f} GB/s   matmul peak "
        f"{med(base['peak']) / 1e9:6.1f} GFLOP/s"
    )
    seconds = {}
    for name, _, kind in kernels:
        rates = [w / t for w, t in runs[name]]
        ratio = med(rate / b for rate, b in zip(rates, base[kind]))
        seconds[name] = med(t for _, t in runs[name])
        unit, scale = ("GB/s", 1e9) if kind == "stream" else ("GFLOP/s", 1e9)
        print(
            f"   {name:18s} {med(rates) / scale:7.1f} {unit:8s} {ratio:5.2f}x of {kind:6s} "
            f"({1e3 * seconds[name]:7.2f} ms for all layers)"
        )
    # A step is its parts; at the roofline each part would take its work over the baseline.
    for step, parts in (
        ("decode step", ("decode linears", "LM head", "decode attention")),
        ("prefill step", ("prefill linears", "prefill attention")),
    ):
        spent = sum(seconds[p] for p in parts)
        floor = sum(
            runs[p][0][0] / med(base[k]) for p, k in ((n, kd) for n, _, kd in kernels if n in parts)
        )
        print(
            f"   {step:18s} kernels {1e3 * spent:7.2f} ms; at the baselines {1e3 * floor:7.2f} ms "
            f"-> {floor / spent:.2f}x of the machine's limit"
        )


if __name__ == "__main__":
    main()
