"""Piecewise CUDA graphs for the steps the decode graphs do not cover: prefills, chunks, mixed
steps and draft verification (vLLM's PIECEWISE mode, without torch.compile).

Such a step is hundreds of kernels launched from Python between the attentions: on a GPU the
launches, not the kernels, set its time (17 ms a step for a 1B model eagerly). Attention depends
on the step's shape (which rows are prefill tiles, which decodes, how long each context is), so
it runs eagerly; everything else depends only on the number of rows, so it is captured once
per token count of a ladder (compilation_config.piecewise_sizes), in L + 1 pieces for L layers:

  piece 0   embedding; layer 0's input norm, qkv projection, RoPE and K/V store
  piece i   layer i-1's o_proj, post-attention norm and MLP; layer i's input norm, qkv, RoPE, store
  piece L   layer L-1's o_proj, post-attention norm and MLP; the final norm

(the halves are the model's own: DecoderLayer.pre_attention / post_attention). The pieces read
and write static buffers sized for the largest count: token ids, positions, slots, q, the
attention output, the residual stream and the final hidden states. A step of T rows copies its
inputs into the first T rows and pads to the ladder's next size P (id 0, position 0, slot -1,
which the K/V store skips), then replays piece 0, attends for its T real rows (the backend
writes into the static attention buffer), replays piece 1, ... piece L, and computes logits
eagerly for the rows that give them (one LM-head matmul). The P - T padding rows carry values
nobody reads; every row is independent of the others outside attention.

Unlike the eager forward, the last layer runs for every row (the eager path carries on only
for the rows that give logits): the price of a static shape, paid in the last layer only.

Everything torch.cuda is behind ``cuda_graphs.GraphAPI``: the tests run it on the CPU with
the Triton kernels interpreted and graph capture stubbed (tests/engine/test_piecewise_graphs.py).
"""

from __future__ import annotations

import logging
import time

import torch

from kvmesh.engine.attention_backends import PAD_SLOT, TritonMetadata
from kvmesh.engine.models.llama import StepRope

log = logging.getLogger(__name__)


class StaticSlots:
    """What the K/V store reads of the metadata inside a piece: the static slot buffer."""

    def __init__(self, slots: torch.Tensor):
        self.slots = slots


class PiecewiseGraphRunner:
    def __init__(
        self,
        model,
        backend,
        kv_caches,
        sizes: list[int],
        device: torch.device,
        dtype: torch.dtype,
        api=None,
    ):
        from kvmesh.engine.cuda_graphs import GraphAPI

        if model.fused_ops is None:
            raise ValueError(
                "piecewise graphs need the fused ops (RoPE with the K/V store in one kernel)"
            )
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.api = api or GraphAPI()
        self.sizes = sorted(set(sizes))
        attn = model.layers[0].self_attn
        self.num_heads, self.head_dim, self.scale = attn.num_heads, attn.head_dim, attn.scale
        largest = self.sizes[-1]
        hidden = model.config.hidden_size
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), PAD_SLOT, dtype=torch.long, device=device)
        self.q = torch.zeros((largest, self.num_heads, self.head_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros(
            (largest, self.num_heads, self.head_dim), dtype=dtype, device=device
        )
        self.residual = torch.zeros((largest, hidden), dtype=dtype, device=device)
        self.hidden = torch.zeros((largest, hidden), dtype=dtype, device=device)
        self.graphs: dict[int, list[object]] = {}  # size -> its L + 1 pieces, in order
        self.num_replays = 0  # steps replayed

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size holding n rows; None when n exceeds them all."""
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def covers(self, meta, num_tokens: int) -> bool:
        return isinstance(meta, TritonMetadata) and 0 < num_tokens <= self.max_tokens

    # -- the pieces ----------------------------------------------------------------------
    def _rope(self, size: int) -> StepRope:
        return StepRope(self.model.rope, self.positions[:size], self.q.dtype, fused=True)

    def _project(
        self, i: int, x: torch.Tensor, residual: torch.Tensor | None, size: int
    ) -> torch.Tensor:
        """Layer i's first half into the static q and residual buffers; returns the q buffer."""
        k_cache, v_cache = self.kv_caches[i]
        q, _, _, residual = self.model.layers[i].pre_attention(
            x, residual, self._rope(size), k_cache, v_cache, StaticSlots(self.slots[:size])
        )
        if (
            residual.data_ptr() != self.residual.data_ptr()
        ):  # a fused norm updates the buffer in place
            self.residual[:size].copy_(residual)
        self.q[:size].copy_(q)
        return self.q[:size]

    def _piece(self, i: int, size: int) -> torch.Tensor:
        model, num_layers = self.model, len(self.model.layers)
        if i == 0:
            return self._project(0, model.embed_tokens(self.input_ids[:size]), None, size)
        x, residual = model.layers[i - 1].post_attention(self.attn_out[:size], self.residual[:size])
        if i < num_layers:
            return self._project(i, x, residual, size)
        self.hidden[:size].copy_(model.final_norm(x, residual))
        return self.hidden[:size]

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first (the smaller reuse its memory pool); each piece run once
        first (Triton compiles its kernels, the allocator settles). Slots are all padding, so
        neither run writes the KV cache."""
        start = time.perf_counter()
        self.slots.fill_(PAD_SLOT)
        num_pieces = len(self.model.layers) + 1
        for size in reversed(self.sizes):
            pieces = []
            for i in range(num_pieces):
                self._piece(i, size)
                graph = self.api.new_graph()
                self.api.capture(graph, lambda i=i, size=size: self._piece(i, size))
                pieces.append(graph)
            self.graphs[size] = pieces
        self.api.synchronize()
        log.info(
            "captured piecewise CUDA graphs (%d pieces each) for token counts %s in %.1f s",
            num_pieces,
            self.sizes,
            time.perf_counter() - start,
        )

    # -- a step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: TritonMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The step's logits rows ([len(logits_indices), vocab]): the pieces of its padded size
        replayed, attention for its real rows between them."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slots)
        if size > n:  # padding rows: no KV write
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(PAD_SLOT)
        pieces = self.graphs[size]
        q, out = self.q[:n], self.attn_out[:n]
        for i, (k_cache, v_cache) in enumerate(self.kv_caches):
            self.api.replay(pieces[i])
            self.backend.forward(q, None, None, k_cache, v_cache, meta, self.scale, out=out)
        self.api.replay(pieces[-1])
        self.num_replays += 1
        return self.model.compute_logits(self.hidden[logits_indices])
