"""vLLM's own benchmark client (`vllm bench serve`, from the vLLM anchor's venv) as a load for
bench/serve.py --compare-vllm --client vllm: each workload as vLLM's dataset flags, and its saved
result read back into the summary bench/serve.py prints (total tok/s, TTFT, TPOT, ITL)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path


def anchor_venv() -> Path:
    """The venv `vllm_anchor.sh setup` made (VLLM_ANCHOR_VENV, else its default)."""
    return Path(os.environ.get("VLLM_ANCHOR_VENV", "/tmp/vllm-anchor"))


def dataset_flags(kind: str, args) -> tuple[list[str], int, int]:
    """vLLM's dataset flags for one of --compare-vllm's workloads, its prompt count and
    concurrency. The long workload is vLLM's random dataset with an input range ratio: prompts
    uniform in len * (1 +- ratio), every output the same length."""
    if kind == "random":
        flags = ["--dataset-name", "random", "--random-input-len", str(args.random_input_len)]
        flags += ["--random-output-len", str(args.random_output_len)]
        return flags, args.random_num_prompts, args.random_concurrency
    if kind == "prefix":
        flags = ["--dataset-name", "prefix_repetition"]
        flags += ["--prefix-repetition-prefix-len", str(args.prefix_rep_prefix_len)]
        flags += ["--prefix-repetition-suffix-len", str(args.prefix_rep_suffix_len)]
        flags += ["--prefix-repetition-num-prefixes", str(args.prefix_rep_num_prefixes)]
        flags += ["--prefix-repetition-output-len", str(args.prefix_rep_output_len)]
        return flags, args.prefix_rep_num_prompts, args.prefix_rep_concurrency
    if kind == "long":
        ratio = args.long_input_spread / args.long_input_len
        flags = ["--dataset-name", "random", "--random-input-len", str(args.long_input_len)]
        flags += ["--random-output-len", str(args.long_output_len)]
        flags += ["--random-range-ratio", json.dumps({"input": round(ratio, 4), "output": 0.0})]
        return flags, args.long_num_prompts, args.long_concurrency
    raise ValueError(f"unknown workload {kind!r}")


def bench_serve(url: str, model: str, tokenizer: str, flags: list[str], seed: int) -> dict:
    """One `vllm bench serve` run against url (greedy, ignore_eos), flags naming the dataset,
    prompts and concurrency; its saved result with every request's details."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [str(anchor_venv() / "bin" / "vllm"), "bench", "serve", "--backend", "openai"]
        cmd += ["--base-url", url, "--endpoint", "/v1/completions", "--model", model]
        cmd += ["--tokenizer", tokenizer, "--ignore-eos", "--seed", str(seed), "--temperature", "0"]
        cmd += [*flags, "--save-result", "--save-detailed", "--result-dir", d]
        cmd += ["--result-filename", "r.json"]
        # cwd: not the repository root, whose operator/ would shadow the stdlib's in vLLM's children
        proc = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"vllm bench serve failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        return json.loads((Path(d) / "r.json").read_text())


def run(url: str, model: str, tokenizer: str, kind: str, args, seed: int) -> dict:
    """One workload of --compare-vllm through vLLM's client, as bench/serve.py's summary."""
    flags, num_prompts, conc = dataset_flags(kind, args)
    flags += ["--num-prompts", str(num_prompts), "--max-concurrency", str(conc)]
    return summary(bench_serve(url, model, tokenizer, flags, seed), num_prompts)


def summary(res: dict, num_prompts: int) -> dict:
    """vLLM's saved result (times in s per request with --save-detailed, aggregates in ms) as the
    fields bench/serve.py reads: total tok/s, per-request TTFT and TPOT, every ITL, failures, and
    each request's prompt and output lengths."""
    ttfts = [t for t in res.get("ttfts", []) if t]
    lens = res.get("output_lens", [])
    itls = res.get("itls", [])
    tpot = [sum(gaps) / len(gaps) for gaps, n in zip(itls, lens) if n > 1 and gaps]
    completed = int(res.get("completed", 0))
    return {
        "total_tok_s": float(res["total_token_throughput"]),
        "out_tok_s": float(res["output_throughput"]),
        "ttft": ttfts,
        "tpot": tpot,
        "itl": [x for gaps in itls for x in gaps],
        "failed": num_prompts - completed,
        "ok": completed,
        "lens": list(zip(res.get("input_lens", []), lens)),  # (prompt, output) per request
    }
