"""The arithmetic ceiling of a serving workload on this machine: the total tok/s that no engine
running the same model in the same dtype can pass, however good its kernels and scheduling.
(The one saving it does not count: an engine could skip the last layer's work past its K/V for
prompt tokens whose logits nobody reads: at most 1/layers of the linears.)

A workload's prompts and outputs fix its arithmetic. Every prompt token that no cache holds goes
through each layer's linears and causal attention over the tokens before it; every generated
token after the first goes through the linears and attention over its context; every generated
token costs one row of the LM head. Counted as 2 FLOPs a multiply-add, that work done at the
machine's matmul peak (oneDNN on a weight that stays in cache: faster than any real layer, so the
ceiling is never too low) takes a time no engine can beat, and the workload's tokens over that
time are its ceiling. Decode steps are also bound by the weight stream; leaving that out only
raises the ceiling.

The peak is measured on all the CPUs an engine may use (its affinity and cgroup quota), with
nothing else running. Beside n processes that never sleep an engine running one thread per CPU
gets cpus / (cpus + n) of the CPU time when every runnable thread gets the same, and so that share
of the peak. `bench/serve.py --compare-vllm` prints each workload's ceiling from the prompts it
served, against both servers' throughput.

  python bench/ceiling.py          # the matmul peak here, fp32 and bf16, one thread and all CPUs
"""

from __future__ import annotations

import time
from dataclasses import dataclass


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) features of each of a Llama-family layer's linears, as the engine fuses them."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }


def best_of(fn, reps: int = 5) -> float:
    """The shortest of `reps` timed calls of fn, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass(frozen=True)
class ModelCost:
    """FLOPs of one model's parts: per token through the linears, per token and key of
    attention, per row of the LM head."""

    linears_per_token: int
    attention_per_key: int
    head_per_token: int

    @classmethod
    def of(cls, config) -> ModelCost:
        """From an engine ModelConfig (hidden, heads, KV heads, head_dim, intermediate, vocab)."""
        c = config
        weights = sum(n * k for n, k in linear_shapes(c).values())
        return cls(
            linears_per_token=2 * weights * c.num_hidden_layers,
            # QK^T and PV, each a multiply-add per head dimension
            attention_per_key=4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers,
            head_per_token=2 * c.vocab_size * c.hidden_size,
        )

    def request_flops(self, prompt: int, cached: int, output: int) -> int:
        """One request: prompt tokens (the first `cached` found in a cache), `output` generated."""
        new = prompt - cached
        keys = new * cached + new * (new + 1) // 2  # prefill row i sees cached + i + 1 keys
        decodes = max(output - 1, 0)  # the first token comes out of the prefill
        keys += decodes * (prompt + 1) + decodes * (decodes - 1) // 2
        return (
            (new + decodes) * self.linears_per_token
            + keys * self.attention_per_key
            + output * self.head_per_token
        )


def workload_flops(cost: ModelCost, requests: list[tuple[int, int, int]]) -> int:
    """(prompt, cached, output) per request."""
    return sum(cost.request_flops(p, c, o) for p, c, o in requests)


def ceiling_tok_s(cost: ModelCost, requests: list[tuple[int, int, int]], flop_s: float) -> float:
    """The workload's total tokens (prompt + output) over its FLOPs at flop_s."""
    tokens = sum(p + o for p, _, o in requests)
    return tokens * flop_s / workload_flops(cost, requests)


def share_beside(cpus: float, busy_neighbours: int) -> float:
    """The share of the machine's CPU time an engine running one thread per CPU gets beside n
    processes that never sleep, when every runnable thread gets the same time."""
    return cpus / (cpus + busy_neighbours)


def engine_cpus() -> float:
    """The CPUs an engine here may use: its affinity, capped by its cgroup's quota."""
    from kvmesh.engine.threads import available_cpus, cgroup_cpu_limit

    cpus, limit = len(available_cpus()), cgroup_cpu_limit()
    return min(cpus, limit) if limit else cpus


def repeated_prefix_cached(num_prompts: int, num_prefixes: int, prefix_len: int) -> list[int]:
    """Cached prompt tokens per request of a prefix-repetition workload at best: each prefix
    computed once, found by every later prompt that shares it (whole, not just full blocks)."""
    return [0 if i < num_prefixes else prefix_len for i in range(num_prompts)]


def matmul_peak(dtype=None, threads: int | None = None, rows: int = 512, reps: int = 5) -> float:
    """FLOP/s of oneDNN on prepacked weights that stay in cache (576 x 576, `rows` rows, 20
    products a timing, best of `reps`) on `threads` torch threads (default: the engine's CPUs);
    the caller's thread count is restored."""
    import torch

    from kvmesh.engine.kernels.onednn_linear import OneDNNLinear

    dtype = dtype or torch.float32
    before = torch.get_num_threads()
    torch.set_num_threads(threads or max(1, int(engine_cpus())))
    try:
        with torch.inference_mode():
            lin = OneDNNLinear(torch.randn(576, 576).to(dtype), None, rows)
            x = torch.randn(rows, 576).to(dtype)
            best = best_of(lambda: [lin(x) for _ in range(20)], reps)
    finally:
        torch.set_num_threads(before)
    return 2 * rows * 576 * 576 * 20 / best


def main() -> None:
    import torch

    cpus = max(1, int(engine_cpus()))
    for dtype in (torch.float32, torch.bfloat16):
        one = matmul_peak(dtype, 1)
        every = matmul_peak(dtype)
        print(
            f"{str(dtype).removeprefix('torch.'):9s} matmul peak: one thread {one / 1e9:6.1f} "
            f"GFLOP/s, {cpus} threads {every / 1e9:6.1f} GFLOP/s ({every / one:.2f}x)"
        )


if __name__ == "__main__":
    main()
