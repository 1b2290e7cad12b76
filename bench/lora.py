#!/usr/bin/env python3
"""Multi-LoRA serving benchmark: adapter traffic against base traffic, and against vLLM's CPU build.

Four adapters made with peft on the built-in model (non-zero random weights; ranks and target
modules differ: all seven projections, attention only, MLP only, q/v), served beside the base
model by `kvmesh serve --enable-lora` and by `vllm serve --enable-lora` (vLLM's CPU build through
../shared/bench/vllm_anchor.sh's venv). Every load comes from vLLM's own client (`vllm bench serve`,
random dataset, greedy, ignore_eos): the base workload names the base model, the adapter workload
the same prompts spread round-robin over the four adapters (`--lora-modules a b c d`).

In --rounds interleaved rounds (order alternating; the server not measured paused by SIGSTOP, as
bench/serve.py does) it prints, per round and as medians of the ratios paired within a round:
  kvmesh adapters / kvmesh base   total tok/s (goal >= 0.8x)
  kvmesh adapters / vLLM adapters total tok/s (goal >= 2x) and TTFT p50
  vLLM adapters / vLLM base       (vLLM's own cost of adapters, for context)

  bench/lora.py                     # both servers (vLLM: `vllm_anchor.sh setup` first)
  bench/lora.py --skip-vllm         # kvmesh only: adapters vs base
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/serve.py: the servers

from serve import VLLM_ANCHOR, LocalServer, VLLMServer, _median  # noqa: E402
from vllm_client import bench_serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (name, rank, target modules): ranks and targets differ, so the step mixes shapes.
ADAPTERS = [
    ("sql", 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("chat", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("code", 16, ["gate_proj", "up_proj", "down_proj"]),
    ("tone", 8, ["q_proj", "v_proj"]),
]


def make_adapters(model_dir: str, out: Path, seed: int = 0) -> dict[str, str]:
    """PEFT adapters with non-zero random A and B (made once, kept in `out`)."""
    paths = {name: out / name for name, _, _ in ADAPTERS}
    if all((p / "adapter_config.json").is_file() for p in paths.values()):
        return {n: str(p.resolve()) for n, p in paths.items()}
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, (name, rank, targets) in enumerate(ADAPTERS):
        print(f"making adapter {name}: rank {rank}, {', '.join(targets)}", flush=True)
        base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
        model = get_peft_model(base, cfg)
        gen = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        model.save_pretrained(paths[name])
    return {n: str(p.resolve()) for n, p in paths.items()}


def lora_flags(adapters: dict[str, str]) -> list[str]:
    rank = max(r for _, r, _ in ADAPTERS)
    return [
        "--enable-lora",
        "--max-loras",
        str(len(adapters)),
        "--max-cpu-loras",
        str(len(adapters)),
        "--max-lora-rank",
        str(rank),
        "--lora-modules",
        *(f"{n}={p}" for n, p in adapters.items()),
    ]


def client(args, url: str, name: str, tokenizer: str, loras: list[str], seed: int) -> dict:
    """One run of vLLM's client; its saved result (throughputs, TTFT/ITL percentiles in ms)."""
    flags = ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    flags += ["--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts)]
    flags += ["--max-concurrency", str(args.concurrency)]
    if loras:
        flags += ["--lora-modules", *loras, "--lora-assignment", "round-robin"]
    res = bench_serve(url, name, tokenizer, flags, seed)
    if res.get("completed") != args.num_prompts:
        raise RuntimeError(f"{res.get('completed')} of {args.num_prompts} requests completed")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-anchor", default=VLLM_ANCHOR)
    ap.add_argument("--kvmesh-flags", default="", help="extra flags for kvmesh serve")
    ap.add_argument("--adapters-dir", default=str(ROOT / ".cache" / "bench-lora"))
    ap.add_argument("--log-dir", default=str(ROOT / ".cache" / "bench-lora-logs"))
    args = ap.parse_args(argv)

    from kvmesh.engine.builtin import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    name = args.model
    adapters = make_adapters(model_dir, Path(args.adapters_dir) / name)
    loras = list(adapters)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[str, LocalServer] = {}
    with contextlib.ExitStack() as stack:
        if not args.skip_vllm:
            print(
                "starting vllm serve --enable-lora (its first start compiles: minutes)", flush=True
            )
            servers["vllm"] = stack.enter_context(
                VLLMServer(
                    args.vllm_anchor, model_dir, name, logs / "vllm.log", extra=lora_flags(adapters)
                )
            )
        print("starting kvmesh serve --enable-lora", flush=True)
        flags = ["--served-model-name", name, "--dtype", "float32", *lora_flags(adapters)]
        servers["kvmesh"] = stack.enter_context(
            LocalServer(args.model, flags + args.kvmesh_flags.split(), logs / "kvmesh.log")
        )
        for s in servers.values():
            s.pause()
        rounds: list[dict[str, dict]] = []
        for rnd in range(args.rounds):
            order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            got: dict[str, dict] = {}
            for label in order:
                srv = servers[label]
                srv.resume()
                try:
                    for kind, names in (("base", []), ("adapters", loras)):
                        print(f"round {rnd + 1}: {label} {kind}", flush=True)
                        got[f"{label} {kind}"] = client(
                            args, srv.url, name, model_dir, names, seed=rnd
                        )
                finally:
                    srv.pause()
            rounds.append(got)
            report(got, f"round {rnd + 1}")
    summary(rounds, args)
    return 0


def _line(label: str, r: dict) -> str:
    return (
        f"  {label:18s} total {r['total_token_throughput']:8.1f} tok/s  output "
        f"{r['output_throughput']:7.1f} tok/s  TTFT p50 {r['median_ttft_ms'] / 1000:6.2f} s  "
        f"ITL p50 {r['median_itl_ms']:6.1f} ms"
    )


def report(got: dict[str, dict], title: str) -> None:
    print(title)
    for label, r in got.items():
        print(_line(label, r))


def ratios(got: dict[str, dict]) -> dict[str, float]:
    def tput(k):
        return got[k]["total_token_throughput"]

    out = {
        "kvmesh adapters / kvmesh base, throughput": tput("kvmesh adapters") / tput("kvmesh base")
    }
    if "vllm adapters" in got:
        out["kvmesh adapters / vllm adapters, throughput"] = tput("kvmesh adapters") / tput(
            "vllm adapters"
        )
        out["kvmesh adapters / vllm adapters, TTFT p50"] = (
            got["kvmesh adapters"]["median_ttft_ms"] / got["vllm adapters"]["median_ttft_ms"]
        )
        out["vllm adapters / vllm base, throughput"] = tput("vllm adapters") / tput("vllm base")
    return out


def summary(rounds: list[dict[str, dict]], args) -> None:
    print(
        f"\nmulti-LoRA, {len(ADAPTERS)} adapters round-robin vs base; random {args.input_len} in / "
        f"{args.output_len} out, {args.num_prompts} prompts, concurrency {args.concurrency}; "
        f"{time.strftime('%Y-%m-%d')}; medians over {len(rounds)} rounds of in-round ratios:"
    )
    per = [ratios(r) for r in rounds]
    for key in per[0]:
        print(f"  {key:45s} {_median([p[key] for p in per]):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
