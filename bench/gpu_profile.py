#!/usr/bin/env python3
"""Where an eager decode step's time goes: torch.profiler over a few decode steps, the ops
ranked by host (self CPU) time, and the device's busy time (part of bench/gpu_check.sh).

An eager step is bounded by its host side when the model is small: each layer's kernel
launches (torch's and Triton's) cost microseconds of Python and driver time each, and the
device waits. CUDA graphs replay decode-only steps; prefill and mixed steps stay eager.

    python bench/gpu_profile.py [--model M] [--batch 16] [--steps 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvmesh.engine import LLM, SamplingParams

    cuda = args.device == "cuda"
    llm = LLM(args.model, device=args.device, attention_backend=args.attention_backend, enforce_eager=True,
              async_scheduling=False, max_num_seqs=args.batch, num_kv_blocks=2048,
              **({"dtype": "bfloat16"} if cuda else {}))
    engine = llm.engine
    sp = SamplingParams(max_tokens=2 * args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([(7 * i + j) % 1000 + 10 for j in range(128)], sp)
    for _ in range(4):  # prefill, then a few decodes: compiled and warm
        engine.step()
    import time

    def sync():
        if cuda:
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60)
    print(f"eager decode, batch {args.batch}, {args.steps} steps, ops by host time:\n{table}", flush=True)
    events = prof.key_averages()
    host_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
    line = f"profile: wall {wall_ms:.2f} ms/step unprofiled; host (self CPU, all torch ops) {host_ms:.2f} ms/step"
    if cuda:
        dev_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 / args.steps
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        line += f", device busy {dev_ms:.2f} ms/step, {launches / args.steps:.0f} kernel launches/step"
    print(line, flush=True)
    while engine.has_unfinished_requests():
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
