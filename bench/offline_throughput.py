#!/usr/bin/env python3
"""Offline throughput: kvmesh's continuous batching vs Hugging Face static batching.

Workload: 64 requests, prompts of random token ids with lengths uniform in
[64, 512] (seed 0), 128 output tokens each, ignore_eos, greedy, the built-in model; fp32 on
the CPU by default, ``--device cuda --dtype bfloat16`` on a GPU (bench/gpu_check.sh). The
baseline runs the same requests through transformers' `generate` in static, left-padded
batches of 16, on the same device and dtype, in the same run. Each system runs in its
own fresh process.
Prints output tok/s, total tok/s (prompt + output) and the ratio.
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def make_workload(num_requests: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        n = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(0, vocab) for _ in range(n)])
    return prompts


def run_kvmesh(model: str, prompts, output_len: int, engine_args: dict) -> tuple[float, int]:
    from kvmesh.engine import LLM, SamplingParams

    llm = LLM(model, **engine_args)
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Warm-up: a small mixed batch (prefills of several lengths, then decodes), so kernel
    # compilation (Triton's JIT on a GPU) and first-touch allocation are not timed. Reversed
    # prompts: no prefix of theirs is a prefix of a timed prompt (no prefix-cache hits bought).
    llm.generate(
        [p[::-1][:n] for p, n in zip(prompts[:8], (16, 32, 64, 128, 256, 17, 33, 65))],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    stats = llm.stats()
    print(
        f"  kvmesh: {stats.num_steps} steps, {stats.num_preemptions} preemptions, "
        f"{stats.num_total_blocks} KV blocks",
        flush=True,
    )
    return elapsed, generated


def in_fresh_process(fn, *args):
    """fn(*args) in a new interpreter (spawned, not forked), which exits afterwards."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        return pool.submit(fn, *args).result()


def run_hf(
    model_dir,
    prompts,
    output_len: int,
    batch_size: int,
    malloc_tuning: bool,
    device: str = "cpu",
    dtype: str = "float32",
) -> tuple[float, int]:
    if malloc_tuning:
        from kvmesh.engine.kernels.malloc_tuning import tune_malloc

        tune_malloc()
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    hf = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        .to(device)
        .eval()
    )
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    generated = 0

    def batch_inputs(batch):
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids.to(device), mask.to(device)

    with torch.inference_mode():
        ids, mask = batch_inputs([prompts[0][:32]])
        hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        for b in tqdm(range(0, len(prompts), batch_size), desc="hf static batches", unit="batch"):
            batch = prompts[b : b + batch_size]
            ids, mask = batch_inputs(batch)
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad,
            )
            generated += (out.shape[1] - ids.shape[1]) * len(batch)
        elapsed = time.perf_counter() - start
    return elapsed, generated


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--skip-kvmesh", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda, for both systems")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--baseline-malloc-tuning",
        action="store_true",
        help="run the baseline with kvmesh's glibc malloc settings too (default: glibc defaults)",
    )
    args = ap.parse_args(argv)

    from kvmesh.engine.builtin import resolve_model_dir
    from kvmesh.engine.config import ModelConfig

    model_dir = resolve_model_dir(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = make_workload(args.num_requests, args.min_len, args.max_len, vocab)
    prompt_tokens = sum(len(p) for p in prompts)
    print(
        f"workload: {len(prompts)} requests, {prompt_tokens} prompt tokens, "
        f"{args.output_len} output tokens each, greedy, {args.dtype} on {args.device}, model {args.model}",
        flush=True,
    )

    # Each system runs in its own fresh interpreter, as its users run it: neither inherits the
    # other's heap, allocator settings or warm caches, and the order does not matter. kvmesh's
    # engine tunes glibc malloc for itself when it starts (engine/kernels/malloc_tuning.py);
    # --baseline-malloc-tuning gives the baseline the same settings.
    print(
        "each system runs in a fresh process; baseline allocator: "
        + ("kvmesh's malloc tuning" if args.baseline_malloc_tuning else "glibc defaults"),
        flush=True,
    )
    results = {}
    engine_args = dict(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
    )
    if args.num_kv_blocks:
        engine_args["num_kv_blocks"] = args.num_kv_blocks
    if not args.skip_kvmesh:
        results["kvmesh"] = in_fresh_process(
            run_kvmesh, args.model, prompts, args.output_len, engine_args
        )
    if not args.skip_baseline:
        results["hf-static"] = in_fresh_process(
            run_hf,
            model_dir,
            prompts,
            args.output_len,
            args.hf_batch_size,
            args.baseline_malloc_tuning,
            args.device,
            args.dtype,
        )

    print()
    print(f"{'system':<12} {'time s':>8} {'output tok/s':>13} {'total tok/s':>12}")
    rates = {}
    for name, (elapsed, generated) in results.items():
        rates[name] = (generated / elapsed, (generated + prompt_tokens) / elapsed)
        print(f"{name:<12} {elapsed:8.1f} {rates[name][0]:13.1f} {rates[name][1]:12.1f}")
    if len(rates) == 2:
        print(
            f"ratio kvmesh / hf-static: output {rates['kvmesh'][0] / rates['hf-static'][0]:.2f}x, "
            f"total {rates['kvmesh'][1] / rates['hf-static'][1]:.2f}x (target >= 3.0x total)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
