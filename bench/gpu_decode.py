#!/usr/bin/env python3
"""GPU decode speed (part of bench/gpu_check.sh): decode tok/s at batch 1, 16 and 64, with and
without CUDA graphs, and the achieved fraction of HBM bandwidth; then the fused Triton ops
against the torch ops they replace (so the choice is measured, not guessed).

Bandwidth: a decode step must read every weight once and each row's K/V context; bytes per
step / step time is the achieved bandwidth, compared with (a) the device's datasheet peak
when known and (b) a device-to-device copy measured in the same run (the practical roofline),
for the whole step (wall clock) and for the forward alone (CUDA events). A 135M model moves
~0.3 GB per step, ~0.1 ms at HBM speed, so its whole-step figure is bounded by the step's host
work; --model takes any Llama-family Hugging Face directory for a bigger one.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

PEAK_HBM = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.04e12,
    "A100-SXM4-40GB": 1.56e12,
    "A100": 1.56e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10": 0.6e12,
}


def copy_bandwidth(torch) -> float:
    x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    n = 20
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * n / (time.perf_counter() - start)  # read + write


class ForwardTimer:
    """CUDA events around each model forward (an eager call, or a graph replay): the device time
    of the forward alone, without the step's host work (scheduling, inputs, sampling)."""

    def __init__(self, runner):
        import torch

        self.torch, self.pairs, self.on = torch, [], False
        runner.model.register_forward_pre_hook(lambda *a: self._start())
        runner.model.register_forward_hook(lambda *a: self._stop())
        if runner.graphs is not None:
            replay = runner.graphs.replay

            def timed_replay(*args, **kwargs):
                self._start()
                out = replay(*args, **kwargs)
                self._stop()
                return out

            runner.graphs.replay = timed_replay

    def _start(self):
        if self.on:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            self.pairs.append([e, None])

    def _stop(self):
        if self.on and self.pairs and self.pairs[-1][1] is None:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            self.pairs[-1][1] = e

    def take_ms(self) -> float:
        self.torch.cuda.synchronize()
        total = sum(a.elapsed_time(b) for a, b in self.pairs if b is not None)
        n = len(self.pairs)
        self.pairs = []
        return total / max(1, n)


# Kernel kinds by name (first match wins): where a decode step's device time goes.
KERNEL_KINDS = (
    ("attention", ("_decode_kernel", "_decode_reduce", "_prefill_kernel", "store_kv")),
    ("norm/rope/silu", ("rms_norm", "rotary", "silu")),
    (
        "gemm",
        (
            "gemm",
            "gemv",
            "cutlass",
            "sm90_",
            "sm80_",
            "cublas",
            "xmma",
            "splitk",
            "matmul",
            "dot_kernel",
        ),
    ),
    ("copy", ("memcpy", "memset", "copy", "fill")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_breakdown(events, steps: int) -> dict[str, tuple[float, float]]:
    """{kind: (device ms per step, kernels per step)} from (name, device us, count) rows of a
    profiler's per-kernel averages."""
    out: dict[str, list[float]] = {}
    for name, us, count in events:
        row = out.setdefault(kernel_kind(name), [0.0, 0.0])
        row[0] += us / 1e3 / steps
        row[1] += count / steps
    return {
        k: (round(ms, 4), round(n, 1))
        for k, (ms, n) in sorted(out.items(), key=lambda kv: -kv[1][0])
    }


def profiled_kernels(run_steps, steps: int):
    """(name, device us, count) per CUDA kernel over `steps` steps run by run_steps(steps)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps(steps)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        rows.append((e.key, float(us), int(e.count)))
    return rows


def print_breakdown(label: str, rows, steps: int, weight_bytes: int, peak: float | None) -> None:
    kinds = kernel_breakdown(rows, steps)
    total = sum(ms for ms, _ in kinds.values())
    launches = sum(n for _, n in kinds.values())
    parts = []
    for kind, (ms, n) in kinds.items():
        extra = ""
        if kind == "gemm" and ms > 0:  # the projections read every weight once a step
            bw = weight_bytes / (ms / 1e3)
            extra = f", weights at {bw / 1e12:.2f} TB/s" + (
                f" = {bw / peak:.0%} of datasheet" if peak else ""
            )
        parts.append(f"{kind} {ms:.3f} ms ({ms / total:.0%}, {n:.0f} kernels{extra})")
    print(
        f"   where the device time goes, {label}: {total:.3f} ms, {launches:.0f} kernels per step: "
        + "; ".join(parts),
        flush=True,
    )


def decode_rate(
    llm,
    batch: int,
    prompt_len: int,
    steps: int,
    warm: int = 3,
    timer: ForwardTimer | None = None,
    profile_steps: int = 0,
    peak: float | None = None,
    label: str = "",
):
    """(tok/s, bytes read per step, wall s per step, forward ms per step) over `steps` decode
    steps of `batch` running requests; with `profile_steps`, then that many steps under the
    profiler, their device time printed by kernel kind."""
    import torch

    from kvmesh.engine import SamplingParams

    engine = llm.engine
    sp = SamplingParams(
        max_tokens=warm + steps + profile_steps + 2, temperature=0.0, ignore_eos=True
    )
    for i in range(batch):
        engine.add_request([(13 * i + j) % 1000 + 10 for j in range(prompt_len)], sp)
    core = engine.core
    while core.scheduler.num_waiting or any(
        r.num_output_tokens == 0 for r in core.scheduler.running
    ):
        engine.step()
    for _ in range(warm):
        engine.step()
    torch.cuda.synchronize()
    ctx_before = sum(r.num_tokens for r in core.scheduler.running)
    if timer is not None:
        timer.on = True
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    forward_ms = float("nan")
    if timer is not None:
        timer.on = False
        forward_ms = timer.take_ms()
    weights = sum(p.numel() * p.element_size() for p in core.runner.model.parameters())
    if profile_steps:
        try:
            rows = profiled_kernels(lambda n: [engine.step() for _ in range(n)], profile_steps)
            print_breakdown(label or f"batch {batch}", rows, profile_steps, weights, peak)
        except Exception as exc:  # a figure lost, not the run
            print(f"!! kernel breakdown failed: {exc!r}", flush=True)
    while engine.has_unfinished_requests():
        engine.step()
    cfg = core.model_config
    per_token_kv = (
        2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * cfg.head_dim
        * core.runner.kv_caches[0][0].element_size()
    )
    mean_ctx = ctx_before + batch * steps / 2
    return batch * steps / elapsed, weights + per_token_kv * mean_ctx, elapsed / steps, forward_ms


def fused_ops_bench(torch):
    from kvmesh.engine.kernels import triton_ops
    from kvmesh.engine.models.llama import RMSNorm

    def timed(fn, n=200):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e6

    hidden, inter = 576, 1536  # SmolLM2-135M
    for tokens in (64, 2048):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        norm = RMSNorm(hidden, 1e-5).cuda().to(torch.bfloat16)
        gu = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)

        def torch_add_norm():
            s = x + r
            return norm._norm(s), s

        t_norm = timed(torch_add_norm)
        xx, rr = x.clone(), r.clone()
        k_norm = timed(lambda: triton_ops.fused_add_rms_norm(xx, rr, norm.weight, 1e-5))
        t_silu = timed(lambda: torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:])
        k_silu = timed(lambda: triton_ops.silu_and_mul(gu))
        print(
            f"fused ops, {tokens} tokens, bf16: add+RMSNorm torch {t_norm:.1f} us vs triton {k_norm:.1f} us "
            f"({t_norm / k_norm:.2f}x); SiLU-and-mul torch {t_silu:.1f} us vs triton {k_silu:.1f} us "
            f"({t_silu / k_silu:.2f}x)",
            flush=True,
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="eager,cuda-graphs")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=8,
        help="steps profiled after each CUDA-graph measurement: device time by kernel kind (0: none)",
    )
    ap.add_argument("--no-fused-ops-bench", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from kvmesh.engine import LLM

    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_HBM.items() if k in name), None)
    measured = copy_bandwidth(torch)
    print(
        f"device {name}: datasheet HBM {peak / 1e12 if peak else float('nan'):.2f} TB/s, "
        f"device copy measured {measured / 1e12:.2f} TB/s",
        flush=True,
    )
    batches = [int(b) for b in args.batches.split(",")]
    rates = {}
    modes = args.modes.split(",")
    for eager in [m == "eager" for m in ("eager", "cuda-graphs") if m in modes]:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device="cuda",
            attention_backend="triton",
            enforce_eager=eager,
            max_num_seqs=max(batches),
            num_kv_blocks=8192,
        )
        mode = "eager" if eager else "cuda-graphs"
        timer = ForwardTimer(llm.engine.core.runner)
        for b in batches:
            tps, step_bytes, step_s, fwd_ms = decode_rate(
                llm,
                b,
                args.prompt_len,
                args.steps,
                timer=timer,
                profile_steps=0 if eager else args.profile_steps,
                peak=peak,
                label=f"{mode} batch {b}",
            )
            rates[(mode, b)] = tps
            bw = step_bytes / step_s
            fwd_bw = step_bytes / (fwd_ms / 1e3)
            frac = f"{bw / peak:.1%} of datasheet, " if peak else ""
            fwd_frac = f"{fwd_bw / peak:.1%} of datasheet, " if peak else ""
            print(
                f"decode {args.dtype} {mode:<11} batch {b:>3}: {tps:9.1f} tok/s, {step_s * 1e3:6.2f} ms/step "
                f"({step_bytes / 1e9:.3f} GB read): {bw / 1e12:.2f} TB/s = {frac}{bw / measured:.1%} of measured "
                f"copy bandwidth; the forward alone {fwd_ms:.3f} ms: {fwd_bw / 1e12:.2f} TB/s = {fwd_frac}"
                f"{fwd_bw / measured:.1%} of copy",
                flush=True,
            )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for b in batches:
        if ("cuda-graphs", b) in rates and ("eager", b) in rates:
            print(
                f"cuda graphs speed-up at batch {b}: {rates[('cuda-graphs', b)] / rates[('eager', b)]:.2f}x",
                flush=True,
            )
    if not args.no_fused_ops_bench:
        fused_ops_bench(torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
