#!/usr/bin/env python3
"""Cost of seeded sampling by position: the sampler's per-step work for a batch of seeded rows.

Times, in one run and alternating rounds, for a decode batch of --batch rows over a --vocab
vocabulary:

* ``uniforms, by position``: the seeded rows' uniforms as the sampler draws them now, a hash of
  (seed, output position) per row (``Sampler.uniforms``);
* ``uniforms, per-request generator``: the baseline, one torch.Generator per request advanced one
  draw per step (the scheme it replaced), built here the way the sampler built it;
* ``sampler step, seeded`` and ``sampler step, unseeded``: a whole ``Sampler.__call__`` (temperature,
  top-p, inversion) with every row seeded, and with none (one shared generator draw).

Prints microseconds per step and the ratios new / baseline.

  python bench/seeded_sampling.py                     # batch 64, vocab 49152, CPU
  python bench/seeded_sampling.py --batch 256 --device cuda
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import torch

    from kvmesh.engine.request import Request
    from kvmesh.engine.sampler import Sampler
    from kvmesh.engine.sampling_params import SamplingParams

    dev = torch.device(args.device)

    def requests(seeded: bool) -> list[Request]:
        return [
            Request(
                f"r{i}",
                [1, 2, 3],
                SamplingParams(
                    max_tokens=10**6,
                    temperature=0.8,
                    top_p=0.95,
                    seed=1000 + i if seeded else None,
                    ignore_eos=True,
                ),
                set(),
                "m",
                16,
                10**7,
            )
            for i in range(args.batch)
        ]

    seeded, unseeded = requests(True), requests(False)
    sampler = Sampler(0, dev)
    logits = torch.randn(args.batch, args.vocab, device=dev)
    generators = {}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def by_position(step: int) -> None:
        sampler.uniforms(seeded, dev, positions=[step] * len(seeded))

    def per_request_generator(step: int) -> None:
        out = torch.zeros(len(seeded), device=dev)
        for i, r in enumerate(seeded):
            gen = generators.get(r.request_id)
            if gen is None:
                gen = generators[r.request_id] = torch.Generator(device=dev)
                gen.manual_seed(r.sampling_params.seed)
            out[i : i + 1].uniform_(generator=gen)

    def step_seeded(step: int) -> None:
        sampler(logits, seeded, positions=[step] * len(seeded))

    def step_unseeded(step: int) -> None:
        sampler(logits, unseeded)

    cases = {
        "uniforms, by position": by_position,
        "uniforms, per-request generator": per_request_generator,
        "sampler step, seeded": step_seeded,
        "sampler step, unseeded": step_unseeded,
    }
    best = {name: float("inf") for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            fn(0)  # warm
            sync()
            t0 = time.perf_counter()
            for s in range(args.steps):
                fn(s)
            sync()
            best[name] = min(best[name], (time.perf_counter() - t0) / args.steps * 1e6)
    print(
        f"batch {args.batch}, vocab {args.vocab}, device {dev}, best of {args.rounds} rounds of "
        f"{args.steps} steps (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    for name, us in best.items():
        print(f"  {name:34s} {us:10.1f} us/step")
    print(
        f"  ratio uniforms by position / per-request generator: "
        f"{best['uniforms, by position'] / best['uniforms, per-request generator']:.2f}"
    )
    print(
        f"  ratio sampler step seeded / unseeded:               "
        f"{best['sampler step, seeded'] / best['sampler step, unseeded']:.2f}"
    )


if __name__ == "__main__":
    main()
