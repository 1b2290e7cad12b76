"""Builds each step's flattened batch, runs the model over the paged cache, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvmesh.engine.attention import AttentionMetadata, PrefillSeq
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.models.llama import LlamaForCausalLM, RotaryEmbedding
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import Sampler, TokenLogprobs, token_logprobs
from kvmesh.engine.scheduler import SchedulerOutput
from kvmesh.engine.weights import load_weights

log = logging.getLogger(__name__)


def _pad(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one [n, longest] int64 array, zero-padded."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


class ModelRunner:
    def __init__(self, config: ModelConfig, model_dir: str | Path, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, block_size: int, max_model_len: int,
                 seed: int = 0, batch_hint: int = 128, attention_backend: str = "auto"):
        from kvmesh.engine import attention_backends

        self.config = config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        # Build on the meta device (no random init), then materialise and load.
        with torch.device("meta"):
            model = LlamaForCausalLM(config, max_positions=max_model_len)
        model = model.to_empty(device=device)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        model.rope = RotaryEmbedding(config, max_model_len).to(device)  # fp32 tables
        load_weights(model, model_dir, dtype)
        from kvmesh.engine.kernels import onednn_linear

        backend_name = attention_backends.choose(attention_backend, device)
        if onednn_linear.available(device, dtype):
            panel_ops = None  # decode-size inputs on the compiled panel kernel (fp32, CPU kernels built)
            if backend_name == "cpu" and onednn_linear.panels_enabled(dtype):
                from kvmesh.engine.kernels import cpu as cpu_kernels

                panel_ops = cpu_kernels.load()
            log.debug("prepacked %d linear layers for oneDNN%s", model.use_onednn(batch_hint, panel_ops),
                      " and panels" if panel_ops is not None else "")
        self.model = model.eval()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler(seed, device)
        self.cpu_ops = None  # the compiled CPU kernels (kernels/cpu.py), when they build
        self.cpu_prefill_attention = False  # whether they cover this model's prefill attention
        self.graphs = None  # the CUDA graphs of decode steps (cuda_graphs.py), once captured
        self.backend = attention_backends.create(backend_name, config, block_size, device)
        log.info("attention backend: %s", self.backend.name)
        if device.type == "cpu":
            from kvmesh.engine.kernels.malloc_tuning import tune_malloc

            tune_malloc()  # reuse freed activations instead of faulting them in every step
        if self.backend.ops is not None:  # Triton: its fused ops and attention
            self.model.use_fused_ops(self.backend.ops)
            self.model.use_attention_backend(self.backend)
        elif self.backend.name == "cpu":
            from kvmesh.engine.kernels import cpu as cpu_kernels

            self.cpu_ops = cpu_kernels.load()
            if self.cpu_ops is not None:
                self.model.use_fused_ops(self.cpu_ops)
                self.cpu_prefill_attention = self.cpu_ops.prefill_attention_supported(
                    dtype, config.head_dim, block_size)
                if self.model.use_decode_stack(self.cpu_ops):
                    log.debug("decode steps run on the compiled decode stack")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One K and one V tensor per layer, [kv_heads, num_blocks, block_size, head_dim]."""
        self.kv_caches = []  # the old cache goes first
        shape = (self.config.num_key_value_heads, num_blocks, self.block_size, self.config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.config.num_hidden_layers)
        ]

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, api=None) -> None:
        """Capture the decode step's CUDA graphs (cuda_graphs.py); `api` stubs torch.cuda in tests."""
        from kvmesh.engine.cuda_graphs import CUDAGraphRunner

        if not self.backend.supports_cuda_graphs:
            log.info("attention backend %s: no CUDA graphs", self.backend.name)
            return
        self.graphs = CUDAGraphRunner(self.model, self.backend, self.kv_caches, max_num_seqs, max_model_len,
                                      self.block_size, self.device, api)
        self.graphs.capture()

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=dtype)
        if self.device.type == "cuda":  # pinned: the copy does not wait for the device's queued work
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _step_buffers(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The per-step input buffers (token ids, positions, slots), reused from step to step."""
        bufs = getattr(self, "_bufs", None)
        if bufs is None or len(bufs[0]) < num_tokens:
            size = max(num_tokens, 2048)
            bufs = self._bufs = tuple(np.empty(size, dtype=np.int64) for _ in range(3))
        return bufs

    def prepare(self, out: SchedulerOutput, kv: KVCacheManager, prev_rows: dict[str, int] | None = None
                ) -> "PreparedStep":
        """The step's inputs on the device. Async scheduling: a position past the request's known
        tokens is a placeholder for the token the previous step samples; its input id is left 0
        here and filled on the device from that step's sampled ids (``fill_dst`` <- row
        ``fill_src`` of them, ``prev_rows`` giving each request's row there)."""
        bs = self.block_size
        fill_dst: list[int] = []
        fill_src: list[int] = []
        self._current_requests = list(out.requests)
        ids_buf, pos_buf, slot_buf = self._step_buffers(out.total_tokens)
        logits_indices: list[int] = []
        sampling_requests = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        sample_tables: list[list[int]] = []  # the sampling rows' contexts, for the last layer
        sample_ctx: list[int] = []
        prefills: list[PrefillSeq] = []
        prefill_rows: list[tuple[int, int, int]] = []  # for the compiled kernel
        prefill_tables: list[list[int]] = []
        prompt_rows: list[tuple[Request, int]] = []  # (request, position) rows that give prompt logprobs
        prompt_idx: list[int] = []
        prompt_tables: list[list[int]] = []
        rows = [] if self.backend.builds_metadata else None  # (new, cached, table): the backend's input
        spec_rows: list[tuple[Request, list[int]]] = []  # requests verifying drafts, and the drafts
        spec_idx: list[int] = []
        spec_tables: list[list[int]] = []
        spec_ctx: list[int] = []
        offset = 0
        starts = out.starts
        for req in out.requests:
            n = out.num_scheduled_tokens[req.request_id]
            start = starts[req.request_id] if starts else req.num_computed_tokens
            table = kv.block_table(req.request_id)
            known = req.num_tokens
            past = start + n - known  # > 0: drafts follow (speculative), or a placeholder (async)
            num_drafts = past if past > 0 and req.spec_token_ids else 0
            if past > 0 and not num_drafts:  # the last position is the previous step's token
                if past != 1 or prev_rows is None or req.request_id not in prev_rows:
                    raise RuntimeError(f"request {req.request_id}: {past} unknown input token(s) and no "
                                       "previous step that samples them")
                fill_dst.append(offset + n - 1)
                fill_src.append(prev_rows[req.request_id])
            if n == 1:  # a decode row: scalars, no per-row numpy work
                ids_buf[offset] = req.all_token_ids[start] if start < known else 0
                pos_buf[offset] = start
                slot_buf[offset] = table[start // bs] * bs + start % bs
            else:
                if num_drafts > 0:
                    drafts = req.spec_token_ids[:num_drafts]
                    ids_buf[offset:offset + n] = req.all_token_ids[start:] + drafts
                elif past > 0:
                    ids_buf[offset:offset + n] = req.all_token_ids[start:] + [0] * past
                else:
                    ids_buf[offset:offset + n] = req.all_token_ids[start:start + n]
                pos = np.arange(start, start + n)
                pos_buf[offset:offset + n] = pos
                slot_buf[offset:offset + n] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            if num_drafts > 0:  # every position from the last verified token on gives logits
                spec_rows.append((req, drafts))
                for p in range(req.num_tokens - 1, start + n):
                    spec_idx.append(offset + p - start)
                    spec_tables.append(table[:cdiv(p + 1, bs)])
                    spec_ctx.append(p + 1)
            elif start + n >= known:
                logits_indices.append(offset + n - 1)
                sampling_requests.append(req)
                sample_tables.append(table[:cdiv(start + n, bs)])
                sample_ctx.append(start + n)
            if req.prompt_logprobs is not None:  # position p's logits score prompt token p + 1
                for p in range(start, min(start + n, req.num_prompt_tokens - 1)):
                    prompt_rows.append((req, p))
                    prompt_idx.append(offset + p - start)
                    prompt_tables.append(table[:cdiv(p + 1, bs)])
            if rows is not None:
                rows.append((n, start, table))
            elif n == 1:
                decode_idx.append(offset)
                decode_tables.append(table[:cdiv(start + 1, bs)])
                decode_ctx.append(start + 1)
            elif num_drafts > 0 and start == known - 1:  # one spec row per position, as above
                # Drafts under verification: each row is a decode over the context up to itself
                # (the rows' K/V are stored before attention). The decode kernel does a handful
                # of query rows far cheaper than the prefill kernel, which is made for chunks.
                decode_idx.extend(range(offset, offset + n))
                decode_tables.extend(spec_tables[-n:])
                decode_ctx.extend(spec_ctx[-n:])
            elif self.cpu_prefill_attention:
                prefill_rows.append((offset, n, start))
                prefill_tables.append(table[:cdiv(start + n, bs)])
            else:
                prefills.append(PrefillSeq(offset, n, start, self._tensor(table) if start else None))
            offset += n

        # copies of the buffers' first `offset` entries: a step's tensors never alias the next step's
        ids, pos_all, slots = ids_buf[:offset].copy(), pos_buf[:offset].copy(), slot_buf[:offset].copy()
        if rows is not None:
            logits_indices += spec_idx + prompt_idx
            meta = self.backend.build_metadata(rows, self._tensor(slots),
                                               sample_tables + spec_tables + prompt_tables,
                                               sample_ctx + spec_ctx + [p + 1 for _, p in prompt_rows])
            return self._prepared(ids, pos_all, meta, logits_indices, sampling_requests, prompt_rows, spec_rows,
                                  fill_dst, fill_src)
        meta = AttentionMetadata(
            slots=self._tensor(slots),
            decode_indices=None, decode_block_tables=None, decode_mask=None,
            prefills=prefills,
        )
        if prefill_rows:
            meta.cpu_ops = self.cpu_ops
            meta.prefill_seqs = self._tensor(prefill_rows)
            meta.prefill_block_tables = self._tensor(_pad(prefill_tables))
        if decode_idx:
            meta.decode_indices = self._tensor(decode_idx)
            self._set_decodes(meta, decode_tables, decode_ctx)
        if spec_rows:  # after the plain sampling rows, before the prompt rows
            logits_indices += spec_idx
            sample_tables += spec_tables
            sample_ctx += spec_ctx
        if prompt_rows:  # after the sampling rows, so the sampler's logits come first
            logits_indices += prompt_idx
            sample_tables += prompt_tables
            sample_ctx += [p + 1 for _, p in prompt_rows]
        if sample_ctx and len(decode_idx) == len(out.requests) == len(sample_ctx):
            # Every row decodes and samples: the last layer's view is the decode rows' own.
            meta.sample_meta = AttentionMetadata(
                slots=None, decode_indices=meta.decode_indices, decode_block_tables=meta.decode_block_tables,
                decode_mask=meta.decode_mask, prefills=[], decode_ctx_lens=meta.decode_ctx_lens,
                cpu_ops=meta.cpu_ops)
            meta.all_decode = True
        elif sample_ctx:
            # The last layer only carries on for the rows that sample: to them it is a decode
            # step over their whole context (this step's K/V are stored by then).
            meta.sample_meta = AttentionMetadata(
                slots=None, decode_indices=self._tensor(range(len(sample_ctx))),
                decode_block_tables=None, decode_mask=None, prefills=[])
            self._set_decodes(meta.sample_meta, sample_tables, sample_ctx)
        return self._prepared(ids, pos_all, meta, logits_indices, sampling_requests, prompt_rows, spec_rows,
                              fill_dst, fill_src)

    def _prepared(self, ids, positions, meta, logits_indices, sampling_requests, prompt_rows, spec_rows,
                  fill_dst, fill_src) -> "PreparedStep":
        return PreparedStep(
            self._current_requests, self._tensor(ids), self._tensor(positions), meta, self._tensor(logits_indices), sampling_requests,
            prompt_rows, spec_rows,
            self._tensor(fill_dst) if fill_dst else None, self._tensor(fill_src) if fill_src else None,
            {r.request_id: i for i, r in enumerate(sampling_requests)})

    def _set_decodes(self, meta: AttentionMetadata, tables: list[list[int]], ctx_lens: list[int]) -> None:
        """Block tables and context lengths (kernel) or a length mask (torch path) of decode rows."""
        padded = _pad(tables)
        meta.decode_block_tables = self._tensor(padded)
        ctx = np.asarray(ctx_lens)
        if self.cpu_ops is not None:
            meta.cpu_ops = self.cpu_ops
            meta.decode_ctx_lens = self._tensor(ctx)
        else:
            width = padded.shape[1] * self.block_size
            meta.decode_mask = self._tensor(np.where(np.arange(width)[None, :] < ctx[:, None], 0.0, -np.inf),
                                            torch.float32)

    def execute(self, out: SchedulerOutput, kv: KVCacheManager
                ) -> tuple[dict[str, int], dict[str, TokenLogprobs], dict[str, list[tuple[int, TokenLogprobs]]]]:
        """Sampled tokens, their logprobs, and prompt logprobs as (position, logprob) per request.

        A request that verified drafts this step gets a list: the accepted drafts, then one sampled
        token (and a list of logprobs, one per token)."""
        return self.finish(self.run(self.prepare(out, kv)))

    @torch.inference_mode()
    def run(self, step: "PreparedStep", prev: "StepResult | None" = None) -> "StepResult":
        """The device part of a step: placeholder fill, forward, sampling. Nothing here waits for
        the device but what logprobs need; the sampled ids come back through ``finish``. With
        async scheduling this runs on the engine's step thread, one step after the other."""
        input_ids = step.input_ids
        if step.fill_dst is not None:
            if prev is None or prev.tokens is None:
                raise RuntimeError("the previous step left no sampled ids to fill this step's inputs")
            # The previous step's sampled ids into this step's inputs, on the device (before the
            # forward, and so before a CUDA graph's static buffers take the inputs).
            input_ids.index_copy_(0, step.fill_dst, prev.tokens.index_select(0, step.fill_src))
        meta, sampling_requests, prompt_rows, spec_rows = (step.meta, step.sampling_requests, step.prompt_rows,
                                                           step.spec_rows)
        if not spec_rows and self.graphs is not None and self.graphs.can_replay(meta, len(sampling_requests)):
            logits = self.graphs.replay(input_ids, step.positions, meta)
        else:
            logits = self.model(input_ids, step.positions, self.kv_caches, meta, step.logits_indices)
        result = StepResult()
        num_plain = len(sampling_requests)
        num_sampling = num_plain + sum(len(d) + 1 for _, d in spec_rows)
        if prompt_rows:
            result.prompt_lps = prompt_logprobs(logits[num_sampling:], prompt_rows)
        if spec_rows:
            from kvmesh.engine.spec_decode.rejection import verify

            for (req, _), v in zip(spec_rows, verify(self.sampler, logits[num_plain:num_sampling],
                                                     [r for r, _ in spec_rows], [d for _, d in spec_rows])):
                result.sampled[req.request_id] = v.tokens
                if v.logprobs is not None:
                    result.logprobs[req.request_id] = v.logprobs
        if not sampling_requests:
            return result
        if prompt_rows or spec_rows:
            logits = logits[:num_plain]
        tokens, logprobs = self.sampler(logits, sampling_requests, to_host=False)
        result.tokens = tokens
        result.requests = sampling_requests
        result.logprobs.update((r.request_id, lp) for r, lp in zip(sampling_requests, logprobs) if lp is not None)
        if tokens.device.type == "cuda":  # the step's one device-to-host copy, without waiting for it
            result.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            result.host.copy_(tokens, non_blocking=True)
            result.event = torch.cuda.Event()
            result.event.record()
        else:
            result.host = tokens
        return result

    @staticmethod
    def finish(result: "StepResult"
               ) -> tuple[dict[str, int], dict[str, TokenLogprobs], dict[str, list[tuple[int, TokenLogprobs]]]]:
        """The host side of a step's result: waits for its sampled ids (the copy ``run`` started)."""
        sampled = dict(result.sampled)
        if result.requests:
            if result.event is not None:
                result.event.synchronize()
            sampled.update((r.request_id, t) for r, t in zip(result.requests, result.host.tolist()))
        return sampled, result.logprobs, result.prompt_lps


@dataclass
class PreparedStep:
    """A step's inputs, built on the host (``ModelRunner.prepare``)."""

    requests: list[Request]  # in row order
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object
    logits_indices: torch.Tensor
    sampling_requests: list[Request]
    prompt_rows: list
    spec_rows: list
    fill_dst: torch.Tensor | None  # placeholder rows of input_ids (async scheduling)
    fill_src: torch.Tensor | None  # ... and their rows in the previous step's sampled ids
    sample_rows: dict[str, int]  # request id -> its row in this step's sampled ids


@dataclass
class StepResult:
    """What ``ModelRunner.run`` leaves: sampled ids on the device and their host copy under way."""

    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: object = None
    requests: list[Request] = field(default_factory=list)
    sampled: dict = field(default_factory=dict)  # verified drafts (lists), already on the host
    logprobs: dict = field(default_factory=dict)
    prompt_lps: dict = field(default_factory=dict)


def prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Request, int]]
                    ) -> dict[str, list[tuple[int, TokenLogprobs]]]:
    """Per request, (position, logprob) of prompt token p + 1 under row p's logits."""
    found = token_logprobs(logits, [req.all_token_ids[p + 1] for req, p in rows],
                           [req.sampling_params.prompt_logprobs for req, _ in rows])
    result: dict[str, list[tuple[int, TokenLogprobs]]] = {}
    for (req, p), lp in zip(rows, found):
        result.setdefault(req.request_id, []).append((p + 1, lp))
    return result
