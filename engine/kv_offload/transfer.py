"""A step's block copies between the KV cache and the tiers, run before its forward.

Stores (blocks evicted from the KV cache, copied to host slots) run first: an evicted block may
be the very block a load of the same step fills. On the CPU they are index copies between two
ordinary tensors. On CUDA the host buffer is pinned and the copies run on their own stream,
after the work already queued (the evicted blocks' last writes); the compute stream waits on
the step's copies only, through an event."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvmesh.common.kv_tiers import MEDIUM_CPU, MEDIUM_SHARED
from kvmesh.engine.kv_offload.block_io import (
    KVCaches,
    block_elements,
    gather_blocks,
    payload_row,
    scatter_blocks,
)


@dataclass(frozen=True)
class KVStore:
    """Copy KV-cache block ``gpu_block`` into host slot ``host_slot``."""

    gpu_block: int
    host_slot: int


@dataclass(frozen=True)
class KVLoad:
    """Fill KV-cache block ``gpu_block`` from host slot ``host_slot`` or, None, ``payload``."""

    gpu_block: int
    host_slot: int | None = None
    payload: bytes | None = None


@dataclass
class Transfers:
    """What a step copies before its forward: stores, then loads."""

    stores: list[KVStore] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


class TransferEngine:
    """The host buffer (one payload row per slot) and the copies in and out of it."""

    def __init__(self, kv_caches: KVCaches, num_slots: int, device: torch.device, meter=None):
        self.device = device
        self.dtype = kv_caches[0][0].dtype
        self.meter = meter  # BlockCostMeter: the loads' seconds per block
        cuda = device.type == "cuda"
        self.host = torch.zeros(
            (num_slots, block_elements(kv_caches)), dtype=self.dtype, pin_memory=cuda
        )
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._timings: list[tuple] = []  # (start, end, CPU blocks, SHARED blocks)

    def run(self, kv_caches: KVCaches, transfers: Transfers) -> None:
        if not transfers:
            return
        if self.stream is None:
            self._run_cpu(kv_caches, transfers)
        else:
            self._run_cuda(kv_caches, transfers)

    # -- CPU: ordinary tensors, timed on the host --------------------------------------------
    def _run_cpu(self, kv_caches: KVCaches, t: Transfers) -> None:
        if t.stores:
            src = torch.tensor([s.gpu_block for s in t.stores])
            dst = torch.tensor([s.host_slot for s in t.stores])
            self.host.index_copy_(0, dst, gather_blocks(kv_caches, src))
        from_host = [ld for ld in t.loads if ld.host_slot is not None]
        from_bytes = [ld for ld in t.loads if ld.host_slot is None]
        if from_host:
            t0 = time.perf_counter()
            rows = self.host.index_select(0, torch.tensor([ld.host_slot for ld in from_host]))
            scatter_blocks(kv_caches, torch.tensor([ld.gpu_block for ld in from_host]), rows)
            self._observe(MEDIUM_CPU, time.perf_counter() - t0, len(from_host))
        if from_bytes:
            t0 = time.perf_counter()
            rows = torch.stack([payload_row(ld.payload, self.dtype) for ld in from_bytes])
            scatter_blocks(kv_caches, torch.tensor([ld.gpu_block for ld in from_bytes]), rows)
            self._observe(MEDIUM_SHARED, time.perf_counter() - t0, len(from_bytes))

    def _observe(self, medium: str, seconds: float, blocks: int) -> None:
        if self.meter is not None:
            self.meter.observe_load(medium, seconds, blocks)

    # -- CUDA: pinned host rows, a copy stream, an event the compute stream waits on ---------
    def _run_cuda(self, kv_caches: KVCaches, t: Transfers) -> None:
        self._read_timings()
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the evicted blocks' last writes come first
        with torch.cuda.stream(self.stream):
            if t.stores:
                src = torch.tensor([s.gpu_block for s in t.stores], device=self.device)
                rows = gather_blocks(kv_caches, src)
                for i, s in enumerate(t.stores):
                    self.host[s.host_slot].copy_(rows[i], non_blocking=True)
            if t.loads:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                rows = torch.empty(
                    (len(t.loads), self.host.shape[1]), dtype=self.dtype, device=self.device
                )
                for i, ld in enumerate(t.loads):
                    src = (
                        self.host[ld.host_slot]
                        if ld.host_slot is not None
                        else payload_row(ld.payload, self.dtype).pin_memory()
                    )
                    rows[i].copy_(src, non_blocking=True)
                dst = torch.tensor([ld.gpu_block for ld in t.loads], device=self.device)
                scatter_blocks(kv_caches, dst, rows)
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.stream)
                n_cpu = sum(1 for ld in t.loads if ld.host_slot is not None)
                self._timings.append((start, end, n_cpu, len(t.loads) - n_cpu))
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)  # this step's copies only

    def _read_timings(self) -> None:
        """The copies' device time, read once their events have passed (never waited for)."""
        pending = []
        for start, end, n_cpu, n_shared in self._timings:
            if not end.query():
                pending.append((start, end, n_cpu, n_shared))
                continue
            seconds = start.elapsed_time(end) / 1000.0
            n = n_cpu + n_shared
            self._observe(MEDIUM_CPU, seconds * n_cpu / n, n_cpu)
            self._observe(MEDIUM_SHARED, seconds * n_shared / n, n_shared)
        self._timings = pending
