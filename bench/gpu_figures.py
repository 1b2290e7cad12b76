#!/usr/bin/env python3
"""The figures of one bench/gpu_check.sh run in one JSON file: each step's result and seconds,
the JSON the steps wrote (parity, serve, profile), and the figures read off the logs of the steps
that print rather than write them (the kernel tests' counts, the offline throughput table)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path


def kernel_counts(log: str) -> dict:
    """pytest's summary line: {'passed': 15, 'failed': 0, ...}."""
    lines = [
        ln for ln in log.splitlines() if re.search(r"\d+ (passed|failed|errors?|skipped)\b", ln)
    ]
    return (
        {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)\b", lines[-1])}
        if lines
        else {}
    )


def offline_rates(log: str) -> dict:
    """bench/offline_throughput.py's table rows and ratio line."""
    out = {}
    for name, secs, tok, total in re.findall(
        r"^(kvmesh|hf-static)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", log, re.M
    ):
        out[name] = {
            "seconds": float(secs),
            "output_tok_s": float(tok),
            "total_tok_s": float(total),
        }
    m = re.search(r"total ([\d.]+)x", log)
    if m:
        out["ratio_total"] = float(m.group(1))
    return out


def collect(work: Path, results: list[str]) -> dict:
    fig: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": {}}
    for r in results:
        name, result, secs = r.split()
        step: dict = {"result": result, "seconds": int(secs)}
        log_path = work / f"{name}.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        js = work / f"{name}.json"
        if js.exists():
            try:
                step["figures"] = json.loads(js.read_text())
            except ValueError as exc:
                step["figures_error"] = str(exc)
        elif name == "kernels":
            step["figures"] = kernel_counts(log)
        elif name.startswith("offline"):
            step["figures"] = offline_rates(log)
        fig["steps"][name] = step
    try:
        import torch

        fig["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
        fig["torch"] = torch.__version__
    except Exception as exc:  # noqa: BLE001 - the figures still go out
        fig["device"] = f"unknown ({exc})"
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="the steps' logs and JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", nargs="*", default=[], help="'NAME RESULT SECONDS' per step")
    args = ap.parse_args(argv)
    fig = collect(Path(args.work), args.results)
    Path(args.out).write_text(json.dumps(fig, indent=1))
    print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
