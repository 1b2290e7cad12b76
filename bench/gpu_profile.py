#!/usr/bin/env python3
"""Where a GPU engine step's time goes: host work against device work, per step (part of
bench/gpu_check.sh), on one engine (bf16, Triton backend, CUDA graphs), in three scenarios:

  decode        --batch decode rows, every step replayed from a CUDA graph, synchronous scheduling
  decode-async  the same with async scheduling (the next step is scheduled while this one runs)
  mixed         --batch decode rows plus one fresh --chunk-token prompt per step (a mixed step,
                replayed from the piecewise graphs, attention between them), synchronous scheduling
  mixed-eager   the same step run eagerly (the piecewise graphs set aside): the before of the pair

Per step: the step's wall time over its device busy time (the targets: within 1.15x for the
batch-64 decode step, 1.3x for the mixed step); wall time (each synchronous step ends on the device: its sampled ids are copied to
the host); device busy time (the union of the kernels' and copies' intervals under
torch.profiler); the forward alone (CUDA events around the model call or the graph replay);
the device's idle time (wall - busy: host work the device waited for); the host phases of the
step timer (engine/step_timing.py: schedule, prepare, forward issue, sample incl. the wait for
the device, update, output); kernel launches per step; and the mixed step's ops by host time.

    python bench/gpu_profile.py [--model M] [--batch 64] [--chunk 512] [--steps 24] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

SCENARIOS = ("decode", "decode-async", "mixed", "mixed-eager")
LAUNCH_EVENTS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaGraphLaunch",
)


class ForwardEvents:
    """CUDA events around each forward (an eager model call or a graph replay), and the host time
    the call took to return (issuing the launches, or the replay)."""

    def __init__(self, runner, torch):
        self.torch, self.pairs, self.issue_s, self.on = torch, [], 0.0, False
        self.cuda = torch.cuda.is_available() and runner.device.type == "cuda"
        runner.model.register_forward_pre_hook(lambda *a: self._start())
        runner.model.register_forward_hook(lambda *a: self._stop())
        for graphs, name in ((runner.graphs, "replay"), (runner.piecewise, "forward")):
            if graphs is not None:
                setattr(graphs, name, self._timed(getattr(graphs, name)))

    def _timed(self, call):
        def timed(*args, **kwargs):
            self._start()
            out = call(*args, **kwargs)
            self._stop()
            return out

        return timed

    def _event(self):
        if not self.cuda:  # the CPU (a dry run of this script): host time only
            return None
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _start(self):
        if self.on:
            self.pairs.append([self._event(), None, time.perf_counter()])

    def _stop(self):
        if self.on and self.pairs and self.pairs[-1][1] is None:
            self.pairs[-1][1] = self._event() or True
            self.issue_s += time.perf_counter() - self.pairs[-1][2]

    def take(self) -> tuple[float, float, int]:
        """(device ms per forward, host issue ms per forward, forwards) since the last take."""
        done = [(a, b) for a, b, _ in self.pairs if b is not None]
        n = len(done)
        if self.cuda:
            self.torch.cuda.synchronize()
            dev = sum(a.elapsed_time(b) for a, b in done) / max(n, 1)
        else:
            dev = float("nan")
        issue = 1000 * self.issue_s / max(n, 1)
        self.pairs, self.issue_s = [], 0.0
        return dev, issue, n


def busy_ms(prof, DeviceType) -> tuple[float, int]:
    """(union of the device intervals in ms, kernel launches) of a torch.profiler run."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    total, cur_s, cur_e = 0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    launches = sum(1 for e in prof.events() if e.name in LAUNCH_EVENTS)
    return total / 1e3, launches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512, help="the decode rows' prompts")
    ap.add_argument("--chunk", type=int, default=512, help="the mixed step's fresh prompt")
    ap.add_argument(
        "--steps", type=int, default=24, help="timed steps per scenario (and as many profiled)"
    )
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--rows", type=int, default=15, help="ops listed for the mixed step")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--device", default="cuda", help="cpu: a dry run of the script's logic (no device figures)"
    )
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)} (choose from {', '.join(SCENARIOS)})")

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kvmesh.engine.config import EngineArgs
    from kvmesh.engine.core_messages import AddRequest
    from kvmesh.engine.core_proc import CoreLoop
    from kvmesh.engine.engine_core import EngineCore
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.engine.step_timing import PHASES

    steps = args.steps
    decode_tokens = 16 + 4 * steps + 2 * (steps + 4) + 64  # every scenario's steps, with room
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    core = EngineCore(
        EngineArgs(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            attention_backend="triton" if cuda else "auto",
            max_num_seqs=args.batch + 1,
            kv_cache_memory="8GiB" if cuda else "256MiB",
            async_scheduling=False,
            max_model_len=args.prompt_len + decode_tokens + 64,
            max_num_batched_tokens=max(2048, args.batch + args.chunk),
        )
    )
    loop = CoreLoop(core)
    events = ForwardEvents(core.runner, torch)
    rng = random.Random(0)
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        loop.add(
            AddRequest(f"d{i}", [rng.randrange(100, vocab) for _ in range(args.prompt_len)], params)
        )
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        loop.step()
    for _ in range(4):
        loop.step()
    n_chunks = [0]

    def add_chunk() -> (
        None
    ):  # one fresh prompt that finishes after its first token: the next step is mixed
        n_chunks[0] += 1
        loop.add(
            AddRequest(
                f"c{n_chunks[0]}",
                [rng.randrange(100, vocab) for _ in range(args.chunk)],
                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            )
        )

    def one_step(name: str) -> None:
        if name.startswith("mixed"):
            add_chunk()
        loop.step()

    def phases_since(snap0: dict, n: int) -> dict:
        snap = loop.timer.snapshot()
        return {p: round(1000 * (snap[p] - snap0[p]) / n, 3) for p in PHASES}

    out: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "chunk": args.chunk,
        "steps": steps,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "scenarios": {},
    }
    piecewise = core.runner.piecewise
    for name in scenarios:
        core.async_scheduling = name == "decode-async"
        core.runner.piecewise = None if name == "mixed-eager" else piecewise
        while core._in_flight:  # a switch drains the pipeline: its outputs are not this scenario's
            core._apply_oldest()
        for _ in range(3):  # warm: the mixed step's prefill kernels compile here
            one_step(name)
        batch_seen = len(core.scheduler.running)
        sync()
        snap0 = loop.timer.snapshot()
        events.on = True
        start = time.perf_counter()
        for _ in range(steps):
            one_step(name)
        sync()
        wall = 1000 * (time.perf_counter() - start) / steps
        events.on = False
        fwd_dev, fwd_issue, n_fwd = events.take()
        phases = phases_since(snap0, steps)
        with profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        ) as prof:
            for _ in range(steps):
                one_step(name)
            sync()
        busy, launches = busy_ms(prof, DeviceType)
        busy /= steps
        r = {
            "wall_ms": round(wall, 3),
            "device_busy_ms": round(busy, 3),
            "device_idle_ms": round(wall - busy, 3),
            "forward_device_ms": round(fwd_dev, 3),
            "forward_issue_ms": round(fwd_issue, 3),
            "forwards_per_step": round(n_fwd / steps, 2),
            "launches_per_step": round(launches / steps, 1),
            "host_phases_ms": phases,
            "rows": batch_seen,
            "wall_over_busy": round(wall / busy, 3) if busy else None,
            "wall_over_forward": round(wall / fwd_dev, 3)
            if fwd_dev == fwd_dev and fwd_dev > 0
            else None,
        }
        out["scenarios"][name] = r
        ratio = f"{wall / busy:.2f}x" if busy else "n/a"
        ratio += (
            f", step / forward {wall / fwd_dev:.2f}x" if fwd_dev == fwd_dev and fwd_dev > 0 else ""
        )
        print(
            f"profile {name:<12} batch {args.batch}{f' + {args.chunk}-token chunk' if name.startswith('mixed') else ''}: "
            f"step / device busy {ratio}; "
            f"wall {wall:.2f} ms/step; device busy {busy:.2f} ms (forward {fwd_dev:.2f} ms by events), "
            f"device idle {wall - busy:.2f} ms; host issue of the forward {fwd_issue:.2f} ms; "
            f"{launches / steps:.0f} launches/step",
            flush=True,
        )
        print(
            "   host phases ms/step: "
            + ", ".join(f"{p} {v:.2f}" for p, v in phases.items())
            + "  (sample includes the wait for the device; a graph replay counts under output)",
            flush=True,
        )
        if name.startswith("mixed") and args.rows:
            table = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=50
            )
            print(f"{name} step, ops by host time ({steps} steps):\n{table}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    core.abort_requests(list(core.scheduler.requests))
    while core.has_unfinished_requests():
        core.step()
    core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
