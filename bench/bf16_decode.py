#!/usr/bin/env python3
"""CPU decode speed, bf16 against fp32: decode tokens/s of the same model at batch 1 and 32 in
both dtypes, measured interleaved (fp32, bf16, fp32, bf16, ...) so a change in the machine's load
hits both, and the bf16/fp32 ratio per batch size (the goal: >= 1.6x).

Decode time is a run's time less the time of the same prompts with one output token (their
prefill and the first sample), so the short prompts' prefill does not count. The medians of the
repeats are printed; on a machine shared with other work, say so beside the figures.

``--prefill`` measures prefill instead: tokens/s of a batch of fresh long prompts (8 of 512
tokens by default) with one output token each, prefix caching off so every run computes them,
interleaved the same way; the ratio is printed, with no goal.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

GOAL = 1.6


def run_once(llm, prompts, max_tokens: int) -> float:
    from kvmesh.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


def decode_tok_s(llm, prompts, max_tokens: int) -> float:
    full = run_once(llm, prompts, max_tokens)
    first = run_once(llm, prompts, 1)
    return len(prompts) * (max_tokens - 1) / max(full - first, 1e-9)


def prefill_tok_s(llm, prompts) -> float:
    return sum(len(p) for p in prompts) / run_once(llm, prompts, 1)


def random_prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, 49152) for _ in range(length)] for _ in range(count)]


def prefill_main(args) -> int:
    from kvmesh.engine import LLM

    engines = {
        d: LLM(args.model, dtype=d, num_kv_blocks=1024, enable_prefix_caching=False)
        for d in ("float32", "bfloat16")
    }
    prompts = random_prompts(random.Random(0), args.prefill_prompts, args.prefill_len)
    rates: dict[str, list[float]] = {d: [] for d in engines}
    for llm in engines.values():  # warm-up: first-call costs out of the figures
        run_once(llm, prompts, 1)
    for _ in range(args.repeats):
        for d, llm in engines.items():
            rates[d].append(prefill_tok_s(llm, prompts))
    fp32, bf16 = (statistics.median(rates[d]) for d in ("float32", "bfloat16"))
    print(
        f"prefill {args.prefill_prompts} x {args.prefill_len}: fp32 {fp32:.1f} tok/s, "
        f"bf16 {bf16:.1f} tok/s, bf16/fp32 {bf16 / fp32:.2f}x "
        f"(medians of {args.repeats}, interleaved)"
    )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", action="store_true", help="measure prefill, not decode")
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=512)
    args = parser.parse_args(argv)
    if args.prefill:
        return prefill_main(args)

    from kvmesh.engine import LLM

    engines = {d: LLM(args.model, dtype=d, num_kv_blocks=1024) for d in ("float32", "bfloat16")}
    rng = random.Random(0)
    worst = None
    for batch in args.batches:
        prompts = random_prompts(rng, batch, args.prompt_len)
        rates: dict[str, list[float]] = {d: [] for d in engines}
        for llm in engines.values():  # warm-up: first-call costs out of the figures
            run_once(llm, prompts, 4)
        for _ in range(args.repeats):
            for d, llm in engines.items():
                rates[d].append(decode_tok_s(llm, prompts, args.max_tokens))
        fp32, bf16 = (statistics.median(rates[d]) for d in ("float32", "bfloat16"))
        ratio = bf16 / fp32
        worst = ratio if worst is None else min(worst, ratio)
        print(
            f"batch {batch}: fp32 {fp32:.1f} tok/s, bf16 {bf16:.1f} tok/s, "
            f"bf16/fp32 {ratio:.2f}x (goal >= {GOAL}x; medians of {args.repeats}, interleaved)"
        )
    return 0 if worst is not None and worst >= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
