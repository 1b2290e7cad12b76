"""CUDA graphs for decode-only steps, as vLLM's CUDAGraphRunner.

A decode step of a small model is hundreds of short kernels launched from Python; on a GPU
the launches, not the kernels, set the step time. So at start-up the model's forward is
captured once per padded batch size (1, 2, 4, 8, 16, ... up to ``max_num_seqs``, and
``max_num_seqs`` itself) over static input buffers: token ids, positions, slot mapping,
context lengths and block tables, sized for the largest batch. A decode-only step (every row
one query token that samples) is then replayed: its inputs are copied into the first ``n``
rows of the static buffers, the rows up to the padded size become padding (slot -1, which
the KV write skips; context length 0, which attention reads nothing for), the graph of the
padded size replays, and the first ``n`` rows of its static output are the logits. Steps
with prefills or chunks, steps with prompt-logprob rows, and batches larger than the largest
size run on the piecewise graphs (piecewise_graphs.py) or eagerly beyond those;
``compilation_config`` picks which graphs are captured, ``enforce_eager`` none.

Split-KV ranges per row are fixed per captured size (from ``max_model_len``), since a graph
replays the grid it was captured with; each range adapts to the row's real length in the
kernel, so short contexts leave the later ranges empty.

Everything torch.cuda is behind ``GraphAPI`` (new graph, capture, replay): the tests run the
bookkeeping on the CPU with that boundary stubbed (tests/engine/test_gpu_execution.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvmesh.engine.attention_backends import PAD_SLOT, TritonMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... up to max_num_seqs, and max_num_seqs itself."""
    sizes, s = [], 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    return sizes + [max_num_seqs]


class GraphAPI:
    """The torch.cuda boundary: one memory pool shared by every captured graph."""

    def __init__(self):
        self._pool = None

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def capture(self, graph, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        if self._pool is None:
            self._pool = graph.pool()
        return out

    def replay(self, graph) -> None:
        graph.replay()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class CUDAGraphRunner:
    def __init__(
        self,
        model,
        backend,
        kv_caches,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        api: GraphAPI | None = None,
    ):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.api = api or GraphAPI()
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        largest = self.sizes[-1]
        width = -(-max_model_len // block_size)
        # The static inputs: every graph reads the first `size` rows of these.
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), PAD_SLOT, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((largest, width), dtype=torch.int32, device=device)
        self.rows = torch.arange(
            largest + 1, dtype=torch.int32, device=device
        )  # one query token per row
        self.logits_indices = torch.arange(largest, dtype=torch.long, device=device)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, TritonMetadata] = {}
        self.num_replays = 0

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size holding n rows; None when n exceeds them all."""
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def _meta(self, size: int) -> TritonMetadata:
        meta = TritonMetadata(
            slots=self.slots[:size],
            query_start_loc=self.rows[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            decode_seqs=self.rows[:size],
            num_decodes=size,
            num_splits=self.backend.num_splits(size, self.max_model_len),
            decode_only=True,
        )
        meta.sample_meta = meta  # every row samples: the last layer attends for all of them
        return meta

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            self.metas[size],
            self.logits_indices[:size],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self.metas[size] = self._meta(size)
            self._forward(size)  # warm-up: JIT compiles the kernels, the allocator settles
            graph = self.api.new_graph()
            self.outputs[size] = self.api.capture(graph, lambda size=size: self._forward(size))
            self.graphs[size] = graph
        self.api.synchronize()
        log.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s",
            self.sizes,
            time.perf_counter() - start,
        )

    def can_replay(self, meta, num_sampling: int) -> bool:
        return (
            isinstance(meta, TritonMetadata)
            and meta.decode_only
            and self.padded_size(num_sampling) is not None
        )

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: TritonMetadata
    ) -> torch.Tensor:
        """Logits of a decode-only step ([n, vocab]) from the graph of its padded size."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slots)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:  # padding rows: no KV write, no keys read
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(PAD_SLOT)
            self.seq_lens[n:size].zero_()
        self.api.replay(self.graphs[size])
        self.num_replays += 1
        return self.outputs[size][:n]
