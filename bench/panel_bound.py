#!/usr/bin/env python3
"""Where the panel linears should hand over to oneDNN: the bound `onednn_linear.panel_max_rows`.

Two measurements, each interleaved (medians of --repeats) so a change in the machine's load hits
both sides:

  kernels  the panel kernel against oneDNN on the model's four linear shapes, every layer its
           own random weights (from memory, as in a decode step), and the LM head, at
           each row count of --rows
  engine   decode tokens/s of one engine with the panels' bound at 16 rows against the bound
           this build uses, switched between runs, at each batch of --batches

  python bench/panel_bound.py --dtype float32 --rows 16 24 32 48 64 --batches 24 32 48 64
  python bench/panel_bound.py --dtype bfloat16 --rows 16 24 32 64 --batches 24 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # python -P leaves bench/ out

import bf16_decode  # noqa: E402
from ceiling import best_of  # noqa: E402
from roofline import model_shapes  # noqa: E402


def kernels(args, dtype) -> None:
    import torch

    from kvmesh.engine.kernels import cpu
    from kvmesh.engine.kernels.onednn_linear import pack_weight

    ops = cpu.load()
    if ops is None:
        raise SystemExit("the CPU kernels are not built (kvmesh build-kernels)")
    model = model_shapes(args.model)
    shapes, vocab, hidden = model["linears"], model["vocab"], model["hidden"]
    weights = {
        n: [torch.randn(N, K).to(dtype) for _ in range(model["layers"])]
        for n, (N, K) in shapes.items()
    }
    head = torch.randn(vocab, hidden).to(dtype)
    panels = {n: [ops.pack_panels(w) for w in ws] for n, ws in weights.items()}
    packed = {n: [pack_weight(w, 32) for w in ws] for n, ws in weights.items()}
    head_panels, head_packed = ops.pack_panels(head), pack_weight(head, 32)
    onednn = torch.ops.mkldnn._linear_pointwise
    for m in args.rows:
        xs = {n: torch.randn(m, K).to(dtype) for n, (N, K) in shapes.items()}
        xh = torch.randn(m, hidden).to(dtype)
        sides = {
            "layers": (
                lambda: [
                    ops.panel_linear(xs[n], p, shapes[n][0]) for n in shapes for p in panels[n]
                ],
                lambda: [onednn(xs[n], w, None, "none", [], "") for n in shapes for w in packed[n]],
            ),
            "LM head": (
                lambda: ops.panel_linear(xh, head_panels, vocab),
                lambda: onednn(xh, head_packed, None, "none", [], ""),
            ),
        }
        for part, (pan, dnn) in sides.items():
            runs = [(best_of(pan), best_of(dnn)) for _ in range(args.repeats)]
            a, b = (statistics.median(r[i] for r in runs) for i in (0, 1))
            print(
                f"{args.dtype} {m:3d} rows {part:7s}: panels {1e3 * a:7.2f} ms, oneDNN {1e3 * b:7.2f} ms, "
                f"panels {b / a:.2f}x",
                flush=True,
            )


def engine(args, dtype) -> None:
    from kvmesh.engine import LLM
    from kvmesh.engine.kernels import onednn_linear

    llm = LLM(args.model, dtype=args.dtype, num_kv_blocks=2048)
    model = llm.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, onednn_linear.OneDNNLinear)]
    bound = onednn_linear.panel_max_rows(dtype)
    saved = dict(onednn_linear.PANEL_MAX_ROWS_AVX512)

    def use(rows: int) -> None:  # the layers read their bound at init, the decode stack per step
        onednn_linear.PANEL_MAX_ROWS_AVX512.update({dtype: rows})
        for m in linears:
            m.panel_rows = rows

    rng = random.Random(0)
    try:
        for batch in args.batches:
            prompts = bf16_decode.random_prompts(rng, batch, 16)
            rates: dict[int, list[float]] = {16: [], bound: []}
            for rows in rates:  # warm-up
                use(rows)
                bf16_decode.run_once(llm, prompts, 4)
            for _ in range(args.repeats):
                for rows in rates:
                    use(rows)
                    rates[rows].append(bf16_decode.decode_tok_s(llm, prompts, 64))
            old, new = statistics.median(rates[16]), statistics.median(rates[bound])
            print(
                f"{args.dtype} batch {batch}: decode tok/s with panels up to 16 rows {old:.1f}, "
                f"up to {bound} {new:.1f}: {new / old:.2f}x",
                flush=True,
            )
    finally:
        onednn_linear.PANEL_MAX_ROWS_AVX512.clear()
        onednn_linear.PANEL_MAX_ROWS_AVX512.update(saved)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 24, 32, 48, 64])
    ap.add_argument("--batches", type=int, nargs="*", default=[24, 32, 64])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    dtype = getattr(torch, args.dtype)
    if args.rows:
        kernels(args, dtype)
    if args.batches:
        engine(args, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
