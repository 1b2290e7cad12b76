"""The one seam between the model and how it attends: an AttentionBackend per kind of device.

- ``torch``: plain torch ops (attention.py's gather/SDPA path); runs anywhere.
- ``cpu``: the compiled CPU kernels (kernels/cpu.py: decode and prefill attention, fused
  norms, RoPE and SiLU); the CPU default. If they cannot be built it degrades to ``torch``.
- ``triton``: the Triton kernels (kernels/triton_attention.py, kernels/triton_ops.py); the
  GPU default. On the CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
  here when unset), which is how the tests prove it without a GPU.

``auto`` (the default) picks by device: ``triton`` on CUDA (``torch`` if triton is not
installed), ``cpu`` on the CPU. Engine argument ``attention_backend`` / CLI
``--attention-backend`` force one; with ``auto``, the environment variable
``KVMESH_ATTENTION_BACKEND`` may too (as vLLM's ``VLLM_ATTENTION_BACKEND``).

A backend gives the model its ``forward`` (attention over the paged cache), optionally its
fused ``ops`` (same signatures as the compiled CPU ops), and ``step_metadata``: the step's
attention metadata from the backend-neutral rows (step_rows.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.engine.attention import AttentionMetadata, PrefillSeq, paged_attention
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.step_rows import StepRows

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpu", "triton")
ENV_VAR = "KVMESH_ATTENTION_BACKEND"
PAD_SLOT = -1  # a slot the KV write skips (CUDA-graph padding rows)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose(requested: str, device: torch.device) -> str:
    """The backend name for this device: `requested`, or with auto the environment's choice or
    the device's default. Raises ValueError on a backend the device cannot run."""
    if requested == "auto":
        requested = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        if requested not in BACKENDS:
            raise ValueError(f"{ENV_VAR} must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "auto":
        if device.type == "cuda":
            if triton_available():
                return "triton"
            log.warning(
                "triton is not installed (pip install 'kvmesh[gpu]'): attention runs on plain torch ops"
            )
            return "torch"
        return "cpu" if device.type == "cpu" else "torch"
    if requested == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on device cpu only, not {device.type}")
    if requested == "triton":
        if not triton_available():
            raise ValueError(
                "attention_backend 'triton' needs the triton package (pip install 'kvmesh[gpu]')"
            )
        if device.type not in ("cuda", "cpu"):
            raise ValueError(
                f"attention_backend 'triton' runs on cuda (or cpu, interpreted), not {device.type}"
            )
    return requested


class AttentionBackend:
    name = "torch"
    supports_cuda_graphs = False
    ops = None  # fused elementwise ops with the CPU ops' signatures, or None for torch ops

    def forward(self, q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    def step_metadata(self, rows: StepRows, upload, block_size: int):
        """The step's attention metadata; ``upload(values, dtype=torch.long)`` makes a device tensor."""
        raise NotImplementedError


class TorchBackend(AttentionBackend):
    """attention.py's torch path; the compiled CPU kernels' metadata when ``cpu_ops`` is set."""

    name = "torch"
    cpu_ops = None  # the compiled CPU kernels module (kernels/cpu.py), when loaded
    cpu_prefill_attention = False  # whether they cover this model's prefill attention

    def step_metadata(self, rows: StepRows, upload, block_size: int) -> AttentionMetadata:
        """Decode rows batched (kernel or masked gather), prefills by the compiled kernel or one
        PrefillSeq each, and the last layer's view of the rows that give logits."""
        q_lens, starts, qsl = rows.q_lens, rows.starts, rows.query_start_loc
        # Decode and draft-verifying sequences' rows are decodes over the context up to themselves:
        # the decode kernel does a handful of query rows far cheaper than the prefill kernel.
        as_decode = (q_lens == 1) | rows.verifies_drafts
        prefill_seqs = np.flatnonzero(~as_decode)
        prefills: list[PrefillSeq] = []
        meta = AttentionMetadata(
            slots=upload(rows.slots),
            decode_indices=None,
            decode_block_tables=None,
            decode_mask=None,
            prefills=prefills,
        )
        if prefill_seqs.size:
            if self.cpu_prefill_attention:
                seq_lens = starts + q_lens
                meta.cpu_ops = self.cpu_ops
                meta.prefill_seqs = upload(
                    np.stack(
                        [qsl[prefill_seqs], q_lens[prefill_seqs], starts[prefill_seqs]], axis=1
                    )
                )
                meta.prefill_block_tables = upload(
                    rows.batch.table_view(rows.seq_rows[prefill_seqs], seq_lens[prefill_seqs])
                )
            else:
                for i in prefill_seqs.tolist():
                    start = int(starts[i])
                    prefills.append(
                        PrefillSeq(
                            int(qsl[i]),
                            int(q_lens[i]),
                            start,
                            upload(rows.batch.full_table(int(rows.seq_rows[i]))) if start else None,
                        )
                    )
        num_decode_seqs = len(q_lens) - prefill_seqs.size
        if num_decode_seqs == len(q_lens) and len(q_lens) == len(rows.positions):
            decode_idx = np.arange(len(q_lens))
        elif num_decode_seqs:
            decode_idx = np.flatnonzero(np.repeat(as_decode, q_lens))
        else:
            decode_idx = None
        if decode_idx is not None:
            token_rows = np.repeat(rows.seq_rows, q_lens)
            meta.decode_indices = upload(decode_idx)
            self._set_decodes(
                meta,
                rows.batch.table_view(token_rows[decode_idx], rows.positions[decode_idx] + 1),
                rows.positions[decode_idx] + 1,
                upload,
                block_size,
            )
        logits = rows.logits()
        num_logits = len(logits.ctx)
        if num_logits and decode_idx is not None and len(decode_idx) == len(q_lens) == num_logits:
            # Every row decodes and samples: the last layer's view is the decode rows' own.
            meta.sample_meta = AttentionMetadata(
                slots=None,
                decode_indices=meta.decode_indices,
                decode_block_tables=meta.decode_block_tables,
                decode_mask=meta.decode_mask,
                prefills=[],
                decode_ctx_lens=meta.decode_ctx_lens,
                cpu_ops=meta.cpu_ops,
            )
            meta.all_decode = True
        elif num_logits:
            # The last layer only carries on for the rows that give logits: to them it is a
            # decode step over their whole context (this step's K/V are stored by then).
            meta.sample_meta = AttentionMetadata(
                slots=None,
                decode_indices=upload(np.arange(num_logits)),
                decode_block_tables=None,
                decode_mask=None,
                prefills=[],
            )
            self._set_decodes(
                meta.sample_meta, rows.logits_tables(logits), logits.ctx, upload, block_size
            )
        return meta

    def _set_decodes(
        self, meta: AttentionMetadata, padded: np.ndarray, ctx: np.ndarray, upload, block_size: int
    ) -> None:
        """Block tables and context lengths (kernel) or a length mask (torch path) of decode rows."""
        meta.decode_block_tables = upload(padded)
        if self.cpu_ops is not None:
            meta.cpu_ops = self.cpu_ops
            meta.decode_ctx_lens = upload(ctx)
        else:
            width = padded.shape[1] * block_size
            meta.decode_mask = upload(
                np.where(np.arange(width)[None, :] < ctx[:, None], 0.0, -np.inf), torch.float32
            )


class CpuBackend(TorchBackend):
    """The compiled CPU kernels (the runner loads them, ``use_cpu_ops``); torch ops until then."""

    name = "cpu"

    def use_cpu_ops(self, cpu_ops, prefill_attention: bool) -> None:
        self.cpu_ops = cpu_ops
        self.cpu_prefill_attention = prefill_attention


@dataclass
class TritonMetadata:
    """One step's attention inputs for the Triton kernels (all int32 on the device but slots)."""

    slots: torch.Tensor | None  # [T] int64, cache row of each new token; PAD_SLOT skips
    query_start_loc: torch.Tensor  # [S + 1] first row of each sequence in the batch
    seq_lens: torch.Tensor  # [S] context length including this step's tokens
    block_tables: torch.Tensor  # [S, W]
    decode_seqs: torch.Tensor | None  # [R] sequences with one query token
    num_decodes: int
    num_splits: int  # split-KV ranges per decode row
    tile_seq: torch.Tensor | None = None  # [P] prefill tiles: their sequence
    tile_q: torch.Tensor | None = None  # [P] and their first query token within it
    num_tiles: int = 0
    # The sampling rows as decodes over their whole context, for the last layer.
    sample_meta: TritonMetadata | None = None
    # Decode-only with every row sampling once, in order: a CUDA graph can replay the step.
    decode_only: bool = False


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, config: ModelConfig, block_size: int, device: torch.device):
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            if "kvmesh.engine.kernels.triton_attention" in __import__("sys").modules:
                raise ValueError(
                    "attention_backend 'triton' on the CPU needs TRITON_INTERPRET=1 before the "
                    "Triton kernels are imported"
                )
            log.info(
                "attention_backend triton on the CPU: running the kernels under Triton's interpreter"
            )
            os.environ["TRITON_INTERPRET"] = "1"
        from kvmesh.engine.kernels import triton_attention, triton_ops

        if device.type == "cpu" and not triton_attention.INTERPRET:
            raise ValueError(
                "the Triton kernels were imported without TRITON_INTERPRET=1; "
                "they cannot run on the CPU in this process"
            )
        self.kernels = triton_attention
        self.ops = triton_ops
        self.device = device
        self.block_size = block_size
        self.num_kv_heads = config.num_key_value_heads
        self.block_q = triton_attention.prefill_block_q(
            config.num_attention_heads, config.num_key_value_heads
        )
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.target_programs = 2 * sms
        else:
            self.target_programs = 8  # the interpreter: keep the split path exercised, cheaply
        self.max_splits = 16

    def num_splits(self, num_rows: int, max_len: int) -> int:
        """Split-KV ranges per decode row: enough programs to fill the device, each range at
        least one key tile long, rounded down to a power of two; one when the batch alone
        fills the device."""
        if num_rows == 0:
            return 1
        programs = num_rows * self.num_kv_heads
        by_device = -(-self.target_programs // programs)
        by_length = max(1, max_len // self.kernels.TILE_N)
        splits = int(max(1, min(self.max_splits, by_device, by_length)))
        return 1 << (splits.bit_length() - 1)  # a power of two: few kernel variants to compile

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Several int32 arrays in one host-to-device copy; views of it, reshaped as given."""
        flat = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int32)
        host = torch.from_numpy(flat)
        if self.device.type == "cuda":  # pinned: an asynchronous copy
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        out, at = [], 0
        for a in arrays:
            out.append(dev[at : at + a.size].view(a.shape))
            at += a.size
        return out

    def step_metadata(self, rows: StepRows, upload, block_size: int) -> TritonMetadata:
        logits = rows.logits()
        seq_lens = rows.starts + rows.q_lens
        return self.metadata(
            rows.q_lens,
            rows.starts,
            rows.seq_tables(seq_lens),
            upload(rows.slots),
            rows.logits_tables(logits) if len(logits.ctx) else None,
            logits.ctx,
        )

    def metadata(
        self,
        q_lens: np.ndarray,
        starts: np.ndarray,
        tables: np.ndarray,
        slots: torch.Tensor | None,
        sample_tables: np.ndarray | None,
        sample_ctx: np.ndarray,
    ) -> TritonMetadata:
        """Each sequence's new and cached tokens and its [S, W] block table (zero past its
        context), in batch order; the sampling rows' [R, W'] block tables and context lengths."""
        num_seqs = len(q_lens)
        seq_lens = starts + q_lens
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        decode = np.flatnonzero(q_lens == 1)
        prefill = np.flatnonzero(q_lens > 1)
        tiles_per = -(-q_lens[prefill] // self.block_q)
        tile_seq = np.repeat(prefill, tiles_per)
        tile_q = (
            np.arange(tile_seq.size) - np.repeat(np.cumsum(tiles_per) - tiles_per, tiles_per)
        ) * self.block_q
        max_decode = int(seq_lens[decode].max()) if decode.size else 0
        qsl_d, lens_d, tables_d, dec_d, tseq_d, tq_d = self._upload(
            [qsl, seq_lens, tables, decode, tile_seq, tile_q]
        )
        meta = TritonMetadata(
            slots=slots,
            query_start_loc=qsl_d,
            seq_lens=lens_d,
            block_tables=tables_d,
            decode_seqs=dec_d,
            num_decodes=int(decode.size),
            num_splits=self.num_splits(int(decode.size), max_decode),
            tile_seq=tseq_d,
            tile_q=tq_d,
            num_tiles=int(tile_seq.size),
        )
        meta.decode_only = (
            not prefill.size
            and len(sample_ctx) == num_seqs
            and np.array_equal(sample_ctx, seq_lens)
        )
        if meta.decode_only:  # the sampling rows are the batch's rows: the same metadata serves
            meta.sample_meta = meta
        elif len(sample_ctx):
            meta.sample_meta = self.decode_metadata(sample_tables, sample_ctx)
        return meta

    def decode_metadata(self, tables: np.ndarray, lens: np.ndarray) -> TritonMetadata:
        """Row i: one query token over lens[i] cache rows of tables[i] ([R, W], zero past it)."""
        n = len(lens)
        seqs = np.arange(n + 1)
        qsl_d, lens_d, tables_d = self._upload([seqs, lens, tables])
        return TritonMetadata(
            slots=None,
            query_start_loc=qsl_d,
            seq_lens=lens_d,
            block_tables=tables_d,
            decode_seqs=qsl_d[:n],
            num_decodes=n,
            num_splits=self.num_splits(n, int(lens.max())),
        )

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: TritonMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, heads, dim]; the step's k, v are in the cache already (the fused RoPE op).
        ``out``: where to write (a piecewise graph's static buffer); new when None."""
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.kernels.decode_attention(
            out,
            q,
            k_cache,
            v_cache,
            meta.decode_seqs,
            meta.num_decodes,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.num_splits,
        )
        self.kernels.prefill_attention(
            out,
            q,
            k_cache,
            v_cache,
            meta.tile_seq,
            meta.tile_q,
            meta.num_tiles,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            self.block_q,
        )
        return out


def create(
    name: str, config: ModelConfig, block_size: int, device: torch.device
) -> AttentionBackend:
    if name == "triton":
        return TritonBackend(config, block_size, device)
    return CpuBackend() if name == "cpu" else TorchBackend()
