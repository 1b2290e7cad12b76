#!/usr/bin/env python3
"""Python overhead per decode step: where one engine step's time goes at a decode batch of 64.

Runs an EngineCore (the built-in model by default) the way the core process does (CoreLoop, with
the step timer of engine/step_timing.py, and each step's outputs encoded as the StepOutputs
message the core process sends), fills a batch of --batch requests, lets their prompts finish,
then times --steps decode steps in which every request decodes one token. Prints milliseconds per
step for each phase (schedule / prepare / forward / sample / update / output), and the overhead:
the step's wall time minus the model's forward, in ms and as a share of the step.

  python bench/step_overhead.py                       # smollm2-135m-instruct, batch 64, 64 steps
  python bench/step_overhead.py --batch 64 --steps 128 --model /path/to/hf-dir
  python bench/step_overhead.py --compare-async     # sync vs async scheduling, alternating rounds
  python bench/step_overhead.py --host-only         # ModelRunner.prepare alone, no model, batch 64 and 256

On a shared machine the forward time is noisy; the overhead (pure Python and small tensor work)
much less so.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--compare-async",
        action="store_true",
        help="sync vs async scheduling on one engine: --rounds alternating rounds of --steps "
        "decode steps each; wall and process CPU time per step, and their ratio",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="time ModelRunner.prepare alone (no model, no forward) for the cpu and triton "
        "backends' metadata at batches 64 and 256 (--host-batches)",
    )
    ap.add_argument("--host-batches", default="64,256")
    args = ap.parse_args()
    if args.host_only:
        host_only(args)
        return
    if args.compare_async:
        compare_async(args)
        return

    import msgspec

    from kvmesh.engine.core_proc import StepOutputs
    from kvmesh.engine.step_timing import PHASES, overhead_per_step

    loop = _decode_engine(args, None, args.steps)  # None: the engine's default for its device
    core = loop.core
    encoder = msgspec.msgpack.Encoder()
    timer = loop.timer
    for key in timer.totals:
        timer.totals[key] = 0.0
    timer.steps = timer.decode_steps = timer.decode_seqs = 0
    encode_s = 0.0
    wall0 = time.perf_counter()
    for _ in range(args.steps):
        items = loop.step()
        t0 = time.perf_counter()
        outs = [o for _, o in items if not isinstance(o, BaseException)]
        encoder.encode(StepOutputs(outs, [], core.stats(), timer.snapshot(), []))
        dt = time.perf_counter() - t0
        encode_s += dt
        timer.totals["output"] += dt
        timer.totals["decode_output"] += dt
    wall = time.perf_counter() - wall0
    snap = timer.snapshot()
    per = overhead_per_step(snap)
    if not per or snap["decode_steps"] != args.steps:
        raise SystemExit(f"expected {args.steps} decode steps, got {snap.get('decode_steps')}")
    import torch

    print(
        f"decode steps: {args.steps} at batch {per['batch']:.0f}, model {args.model}, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(
        "  per step (ms): "
        + ", ".join(f"{p} {per[p]:.2f}" for p in PHASES)
        + f"  (output includes msgspec encoding: {1000 * encode_s / args.steps:.2f})"
    )
    print(
        f"  step {per['total']:.2f} ms (wall {1000 * wall / args.steps:.2f}), forward {per['forward']:.2f} ms"
    )
    print(
        f"python overhead per decode step at batch {per['batch']:.0f}: {per['overhead']:.2f} ms "
        f"({100 * per['overhead'] / per['total']:.1f}% of the step; "
        f"{1000 * per['overhead'] / per['batch']:.1f} us per sequence)"
    )


def _decode_engine(args, async_scheduling: bool | None, total_steps: int):
    """A CoreLoop whose --batch requests have finished their prompts and a few warm-up steps."""
    from kvmesh.engine.config import EngineArgs
    from kvmesh.engine.core_messages import AddRequest
    from kvmesh.engine.core_proc import CoreLoop
    from kvmesh.engine.engine_core import EngineCore
    from kvmesh.engine.sampling_params import SamplingParams

    total_len = args.prompt_len + args.warmup_steps + total_steps + 8
    core = EngineCore(
        EngineArgs(
            model=args.model,
            num_kv_blocks=args.batch * -(-total_len // 16) + 16,
            max_num_seqs=args.batch,
            max_model_len=max(total_len + 16, 256),
            max_num_batched_tokens=max(2048, args.prompt_len),
            dtype="float32",
            async_scheduling=async_scheduling,
        )
    )
    loop = CoreLoop(core)
    rng = random.Random(args.seed)
    vocab = core.model_config.vocab_size
    params = SamplingParams(
        max_tokens=args.warmup_steps + total_steps + 4, temperature=0.0, ignore_eos=True
    )
    for i in range(args.batch):
        loop.add(
            AddRequest(f"r{i}", [rng.randrange(0, vocab) for _ in range(args.prompt_len)], params)
        )
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        loop.step()
    for _ in range(args.warmup_steps):
        loop.step()
    return loop


def compare_async(args) -> None:
    """Sync and async scheduling on one engine (no difference of memory placement between two
    engines), switched between alternating rounds (the machine's load drifts; the pipeline is
    drained at each switch): per decode step, the wall time, the process's CPU time (all threads),
    the forward's and the sampler's time (the step thread's work under async scheduling) and the
    host overhead outside them (wall minus both: for async, the host work the overlap did not hide)."""
    import torch

    loop = _decode_engine(args, True, 2 * args.rounds * args.steps + 4)
    core, timer = loop.core, loop.timer
    worker_threads = []
    core._step_thread.submit(lambda: worker_threads.append(torch.get_num_threads())).result()
    totals = {
        mode: {"wall": 0.0, "cpu": 0.0, "forward": 0.0, "sample": 0.0, "tokens": 0}
        for mode in (False, True)
    }
    for r in range(args.rounds):
        for mode in (False, True) if r % 2 == 0 else (True, False):
            while core._in_flight:  # drain before a switch: its outputs are not this round's
                core._apply_oldest()
            core.async_scheduling = mode
            loop.step()  # an async round starts by filling the pipeline
            t = totals[mode]
            tok0 = core.generation_tokens
            fwd0, smp0 = timer.totals["forward"], timer.totals["sample"]
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                loop.step()
            t["wall"] += time.perf_counter() - w0
            t["cpu"] += time.process_time() - c0
            t["forward"] += timer.totals["forward"] - fwd0
            t["sample"] += timer.totals["sample"] - smp0
            t["tokens"] += core.generation_tokens - tok0
    print(
        f"sync vs async scheduling: model {args.model}, decode batch {args.batch}, "
        f"{torch.get_num_threads()} torch threads (step thread: {worker_threads[0]}), one engine, "
        f"{args.rounds} alternating rounds x {args.steps} steps per mode"
    )
    per = {}
    for mode, t in totals.items():
        n = t["tokens"] / args.batch  # steps whose tokens were applied
        per[mode] = {k: 1000 * t[k] / n for k in ("wall", "cpu", "forward", "sample")}
        p = per[mode]
        print(
            f"  {'async' if mode else 'sync ':5}: wall {p['wall']:.2f} ms/step, cpu {p['cpu']:.2f} ms/step, "
            f"forward {p['forward']:.2f} + sample {p['sample']:.2f} ms, host overhead outside them "
            f"{p['wall'] - p['forward'] - p['sample']:.2f} ms, {t['tokens'] / t['wall']:.1f} tok/s"
        )
    print(
        f"  async / sync: wall {per[True]['wall'] / per[False]['wall']:.3f}, "
        f"cpu {per[True]['cpu'] / per[False]['cpu']:.3f}"
    )


def host_only(args) -> None:
    """ModelRunner.prepare's host time per decode step: a scheduler and KV cache manager with no
    model behind them (each step appends a fixed token), the runner's prepare timed alone, with the
    cpu backend's metadata (compiled-kernel layout) and the triton backend's (TRITON_INTERPRET=1;
    nothing runs on it). Prints the median step (and the mean)."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from kvmesh.engine import attention_backends
    from kvmesh.engine.kv_cache_manager import KVCacheManager
    from kvmesh.engine.model_runner import ModelRunner
    from kvmesh.engine.request import Request
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.engine.scheduler import Scheduler
    from kvmesh.engine.step_rows import StepBuffers

    class _Config:  # what the Triton backend reads
        num_attention_heads, num_key_value_heads, head_dim, vocab_size = 9, 3, 64, 49152

    bs = 16
    for backend_name in ("cpu", "triton"):
        for batch in (int(b) for b in args.host_batches.split(",")):
            total_len = args.prompt_len + args.warmup_steps + args.steps + 8
            kv = KVCacheManager(batch * -(-total_len // bs) + 16, bs)
            sched = Scheduler(kv, max(8192, batch * args.prompt_len), batch, total_len + 16)
            runner = ModelRunner.__new__(ModelRunner)  # prepare's state only: no model
            runner.block_size, runner.device, runner.config = bs, torch.device("cpu"), _Config
            runner._buffers = StepBuffers()
            try:
                from kvmesh.engine.input_batch import InputBatch

                runner.input_batch = InputBatch(bs, max_rows=batch)
            except ImportError:
                pass
            if backend_name == "cpu":
                runner.backend = attention_backends.CpuBackend()
                runner.backend.use_cpu_ops(object(), True)  # the compiled kernels' metadata layout
            else:
                runner.backend = attention_backends.TritonBackend(_Config, bs, torch.device("cpu"))
            rng = random.Random(args.seed)
            params = SamplingParams(max_tokens=total_len, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                sched.add_request(
                    Request(
                        f"r{i}",
                        [rng.randrange(0, 1000) for _ in range(args.prompt_len)],
                        params,
                        set(),
                        "m",
                        bs,
                        total_len + 16,
                    )
                )
            times = []
            for step in range(args.warmup_steps + args.steps):
                out = sched.schedule()
                t0 = time.perf_counter()
                runner.prepare(out, kv)
                if step >= args.warmup_steps and len(out.requests) == batch:
                    times.append(time.perf_counter() - t0)
                sched.update_from_output(out, {r.request_id: 7 for r in out.requests})
            times.sort()  # the median: robust to the load of a shared machine
            print(
                f"host-only prepare: backend {backend_name}, decode batch {batch}: "
                f"{1000 * times[len(times) // 2]:.3f} ms per step (median; mean {1000 * sum(times) / len(times):.3f})"
            )


if __name__ == "__main__":
    main()
