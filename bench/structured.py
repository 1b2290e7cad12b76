"""Structured outputs: what constrained decoding costs the engine.

1. Throughput (output tokens/s) at concurrency 16 with half the requests constrained by a JSON schema,
   against the same requests all unconstrained, measured in the same run (repeats alternate; the
   ratio is of the medians; target >= 0.9x). Every request runs to max_tokens (unconstrained ones
   ignore EOS; the schema asks for more items than max_tokens can hold), so both sides emit the same
   tokens and only the per-step cost differs: the matcher's mask fill, the mask applied to the
   logits, and synchronous steps while a constrained request runs.
2. Grammar compile time through the engine's cache (engine/structured/compiler.py): cold (a spec
   not seen before) and cached (the same spec again), p50 / p99.

    python -P bench/structured.py [--model smollm2-135m-instruct | --tiny] [--requests 32] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # tests.tiny_models, bench.structured_backends

CONCURRENCY = 16
# An array longer than any max_tokens here allows: a constrained request never ends early.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 400,
        }
    },
    "required": ["values"],
    "additionalProperties": False,
}


def _pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class MaskTimer:
    """Time spent building and applying the masks (bitmask.for_step, bitmask.apply), per step that
    had any: a direct measure of the cost, steadier than throughput on a shared machine."""

    def __init__(self):
        from kvmesh.engine.structured import bitmask

        self.seconds, self.steps = 0.0, 0
        for name in ("for_step", "apply"):
            setattr(bitmask, name, self._timed(getattr(bitmask, name), name == "for_step"))

    def _timed(self, fn, counts_step):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.steps += counts_step

        return wrapper


def throughput(llm, prompts, params) -> tuple[float, float]:
    """(output tokens/s, mean seconds per step)."""
    steps = llm.engine.core.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, elapsed / (
        llm.engine.core.num_steps - steps
    )


def bench_throughput(llm, num_requests: int, max_tokens: int, repeats: int) -> None:
    from kvmesh.engine import SamplingParams
    from kvmesh.engine.structured import StructuredOutputsParams

    prompts = [f"Request {i}: list some numbers as JSON." for i in range(num_requests)]
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA),
    )
    half = [constrained if i % 2 else plain for i in range(num_requests)]
    llm.generate(
        prompts[:CONCURRENCY], half[:CONCURRENCY]
    )  # warm-up: kernels, the grammar compiled and cached
    timer = MaskTimer()
    base, mixed, mixed_steps = [], [], []
    for _ in range(repeats):
        base.append(throughput(llm, prompts, [plain] * num_requests)[0])
        tps, step_s = throughput(llm, prompts, half)
        mixed.append(tps)
        mixed_steps.append(step_s)
    b, m = statistics.median(base), statistics.median(mixed)
    print(
        f"throughput all unconstrained      {b:8.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in base)})"
    )
    print(
        f"throughput half JSON-constrained  {m:8.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in mixed)})"
    )
    print(f"ratio half-constrained / unconstrained: {m / b:.3f}x (target >= 0.9x)")
    mask_ms = timer.seconds / max(timer.steps, 1) * 1e3
    step_ms = statistics.median(mixed_steps) * 1e3
    print(
        f"mask build + apply per step: {mask_ms:.3f} ms of a {step_ms:.1f} ms step ({mask_ms / step_ms:.1%}; "
        f"{CONCURRENCY // 2} of {CONCURRENCY} rows constrained)"
    )


def bench_compile(backend, repeats: int) -> None:
    from bench.structured_backends import SCHEMAS
    from kvmesh.engine.structured import StructuredOutputsParams

    for name, schema in {**SCHEMAS, "long_array": LONG_SCHEMA}.items():
        cold, cached = [], []
        for i in range(repeats):
            # A spec the cache has not seen (a new description), then the same one again.
            spec = StructuredOutputsParams(
                json={**schema, "description": f"bench {time.time_ns()} {i}"}
            )
            start = time.perf_counter()
            backend.cache.compile_now(spec)
            cold.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            backend.cache.compile_now(spec)
            cached.append((time.perf_counter() - start) * 1e3)
        print(
            f"compile {name:11s} cold   p50 {_pct(cold, 0.5):7.3f} ms  p99 {_pct(cold, 0.99):7.3f} ms"
        )
        print(
            f"compile {name:11s} cached p50 {_pct(cached, 0.5):7.3f} ms  p99 {_pct(cached, 0.99):7.3f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny random-weight Llama (tests/tiny_models.py)"
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile-repeats", type=int, default=50)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    args = ap.parse_args()

    from kvmesh.engine import LLM

    model = args.model
    if args.tiny:
        from tests.tiny_models import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="kvmesh-tiny-")), "tiny-llama"))
    llm = LLM(model, max_num_seqs=CONCURRENCY, kv_cache_memory=args.kv_cache_memory, seed=0)
    core = llm.engine.core
    print(
        f"model {args.model if not args.tiny else 'tiny-llama (random weights)'}, device {core.device}, "
        f"dtype {core.dtype}, concurrency {CONCURRENCY}, {args.requests} requests x {args.max_tokens} tokens"
    )
    bench_throughput(llm, args.requests, args.max_tokens, args.repeats)
    bench_compile(core.structured_backend(), args.compile_repeats)


if __name__ == "__main__":
    main()
