"""The KV cache sized from the GPU's free memory, as vLLM's gpu_worker.determine_available_memory.

With the weights loaded, one profiling step runs at the engine's largest batch
(``max_num_batched_tokens`` prompt tokens over up to ``max_num_seqs`` sequences, every
sequence sampling): its peak of torch allocations above the weights is the activation
memory a step may need. The KV cache gets what is left of ``gpu_memory_utilization`` x
the device's total memory:

    kv_bytes = total * utilization - in_use_after_weights - peak_activation

where ``in_use_after_weights`` (total minus free, from the driver) counts the weights, the
CUDA context and anything other processes hold. The engine logs the blocks and how many
full-length requests they hold at once.

The torch.cuda calls sit behind ``MemoryQuery``, so the arithmetic and the profiling step
are tested on the CPU with the query stubbed (tests/engine/test_gpu_execution.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class MemoryQuery:
    """The torch.cuda boundary: (free, total) bytes, and the caching allocator's counters."""

    mem_get_info: Callable[[], tuple[int, int]]
    reset_peak: Callable[[], None]
    max_allocated: Callable[[], int]
    allocated: Callable[[], int]
    synchronize: Callable[[], None]
    empty_cache: Callable[[], None]

    @classmethod
    def cuda(cls, device: torch.device) -> MemoryQuery:
        return cls(
            mem_get_info=lambda: torch.cuda.mem_get_info(device),
            reset_peak=lambda: torch.cuda.reset_peak_memory_stats(device),
            max_allocated=lambda: torch.cuda.max_memory_allocated(device),
            allocated=lambda: torch.cuda.memory_allocated(device),
            synchronize=lambda: torch.cuda.synchronize(device),
            empty_cache=torch.cuda.empty_cache,
        )


@dataclass
class KVSizing:
    num_blocks: int
    total: int
    in_use: int  # after the weights, before the profiling step
    peak_activation: int
    kv_bytes: int


def blocks_from_memory(
    total: int, in_use: int, peak_activation: int, utilization: float, bytes_per_block: int
) -> tuple[int, int]:
    """(blocks, bytes for the KV cache) that fit in utilization x total beside what is in use
    and the profiled activation peak."""
    kv_bytes = int(total * utilization) - in_use - peak_activation
    return max(0, kv_bytes // bytes_per_block), max(0, kv_bytes)


def profile_step(
    runner, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> None:
    """One step at the engine's largest batch on a scratch KV cache just big enough for it."""
    block_size = runner.block_size
    tokens = max(1, max_num_batched_tokens)
    num_seqs = max(1, min(max_num_seqs, tokens))
    per_seq = cdiv(tokens, num_seqs)
    if (
        per_seq > max_model_len - 1
    ):  # more, shorter sequences when one would overflow the model length
        per_seq = max_model_len - 1
        num_seqs = cdiv(tokens, per_seq)
    num_blocks = num_seqs * cdiv(per_seq, block_size) + 1
    runner.allocate_kv_cache(num_blocks)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    requests, scheduled, left = [], {}, tokens
    for i in range(num_seqs):
        n = min(per_seq, left)
        if n <= 0:
            break
        left -= n
        req = Request(
            f"profile-{i}",
            [(7 * i + j) % runner.config.vocab_size for j in range(n)],
            params,
            set(),
            "profile",
            block_size,
            max_model_len,
        )
        kv.allocate_slots(req, n)
        requests.append(req)
        scheduled[req.request_id] = n
    runner.execute(SchedulerOutput(scheduled, requests), kv)


def size_kv_cache(
    runner,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    utilization: float,
    bytes_per_block: int,
    query: MemoryQuery | None = None,
) -> KVSizing:
    """Profile one step and return how many KV blocks fit; the runner's cache is left empty
    (the caller allocates the real one)."""
    query = query or MemoryQuery.cuda(runner.device)
    runner.allocate_kv_cache(0)
    query.synchronize()
    query.empty_cache()
    free, total = query.mem_get_info()
    in_use = total - free
    query.reset_peak()
    before = query.allocated()
    profile_step(runner, max_num_batched_tokens, max_num_seqs, max_model_len)
    query.synchronize()
    peak = max(0, query.max_allocated() - before)
    runner.allocate_kv_cache(0)  # the scratch cache (counted in the peak: a small overestimate)
    query.empty_cache()
    num_blocks, kv_bytes = blocks_from_memory(total, in_use, peak, utilization, bytes_per_block)
    sizing = KVSizing(num_blocks, total, in_use, peak, kv_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} x {total / 2**30:.1f} GiB total, "
            f"{in_use / 2**30:.2f} GiB in use after loading the weights, {peak / 2**30:.2f} GiB peak "
            "activations at max_num_batched_tokens: raise gpu_memory_utilization or lower "
            "max_num_batched_tokens"
        )
    return sizing


def log_capacity(sizing: KVSizing, block_size: int, max_model_len: int) -> float:
    """Log the cache and its max concurrency (full-length requests held at once); returns it."""
    tokens = sizing.num_blocks * block_size
    concurrency = tokens / max_model_len
    log.info(
        "GPU KV cache: %d blocks (%d tokens, %.2f GiB; %.2f GiB in use after the weights, %.2f GiB "
        "peak activations); maximum concurrency for %d-token requests: %.2fx",
        sizing.num_blocks,
        tokens,
        sizing.kv_bytes / 2**30,
        sizing.in_use / 2**30,
        sizing.peak_activation / 2**30,
        max_model_len,
        concurrency,
    )
    return concurrency
