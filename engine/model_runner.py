"""Builds each step's flattened batch, runs the model over the paged cache, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.input_batch import InputBatch
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.models.llama import LlamaForCausalLM, RotaryEmbedding
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import Sampler, TokenLogprobs, token_logprobs
from kvmesh.engine.scheduler import SchedulerOutput
from kvmesh.engine.step_rows import StepBuffers, build_step_rows
from kvmesh.engine.weights import load_weights

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        seed: int = 0,
        batch_hint: int = 128,
        attention_backend: str = "auto",
    ):
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
            panel_ops = (
                None  # decode-size inputs on the compiled panel kernel (fp32, CPU kernels built)
            )
            if backend_name == "cpu" and onednn_linear.panels_enabled(dtype):
                from kvmesh.engine.kernels import cpu as cpu_kernels

                panel_ops = cpu_kernels.load()
            log.debug(
                "prepacked %d linear layers for oneDNN%s",
                model.use_onednn(batch_hint, panel_ops),
                " and panels" if panel_ops is not None else "",
            )
        self.model = model.eval()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler(seed, device)
        self._buffers = StepBuffers()
        self.input_batch = InputBatch(
            block_size, max_rows=batch_hint
        )  # block tables kept across steps
        self.cpu_ops = None  # the compiled CPU kernels (kernels/cpu.py), when they build
        self.graphs = None  # the CUDA graphs of decode steps (cuda_graphs.py), once captured
        self.piecewise = None  # the piecewise CUDA graphs of the other steps (piecewise_graphs.py)
        self.kv_transfer = None  # the KV tiers' copies (kv_offload/transfer.py), when tiers are on
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
                self.backend.use_cpu_ops(
                    self.cpu_ops,
                    self.cpu_ops.prefill_attention_supported(dtype, config.head_dim, block_size),
                )
                if self.model.use_decode_stack(self.cpu_ops):
                    log.debug("decode steps run on the compiled decode stack")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One K and one V tensor per layer, [kv_heads, num_blocks, block_size, head_dim]."""
        self.kv_caches = []  # the old cache goes first
        shape = (self.config.num_key_value_heads, num_blocks, self.block_size, self.config.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.config.num_hidden_layers)
        ]

    def use_kv_tiers(self, host_slots: int, meter=None) -> None:
        """Hold a host tier of ``host_slots`` blocks (0: none, loads from payloads only)."""
        from kvmesh.engine.kv_offload.transfer import TransferEngine

        self.kv_transfer = TransferEngine(self.kv_caches, host_slots, self.device, meter)

    def transfer(self, transfers) -> None:
        """Run a step's tier copies (stores, then loads) before anything reads the KV cache."""
        if transfers:
            self.kv_transfer.run(self.kv_caches, transfers)

    def capture_cuda_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        api=None,
        decode: bool = True,
        piecewise_sizes: list[int] | None = None,
    ) -> None:
        """Capture the decode steps' full CUDA graphs (cuda_graphs.py) and, with
        ``piecewise_sizes``, the other steps' piecewise graphs for those token counts
        (piecewise_graphs.py). ``api`` stubs torch.cuda in tests."""
        from kvmesh.engine.cuda_graphs import CUDAGraphRunner, GraphAPI

        if not self.backend.supports_cuda_graphs:
            log.info("attention backend %s: no CUDA graphs", self.backend.name)
            return
        api = api or GraphAPI()  # one memory pool for both kinds: they never run at once
        if decode:
            self.graphs = CUDAGraphRunner(
                self.model,
                self.backend,
                self.kv_caches,
                max_num_seqs,
                max_model_len,
                self.block_size,
                self.device,
                api,
            )
            self.graphs.capture()
        if piecewise_sizes:
            from kvmesh.engine.piecewise_graphs import PiecewiseGraphRunner

            self.piecewise = PiecewiseGraphRunner(
                self.model,
                self.backend,
                self.kv_caches,
                piecewise_sizes,
                self.device,
                self.dtype,
                api,
            )
            self.piecewise.capture()

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=dtype)
        if (
            self.device.type == "cuda"
        ):  # pinned: the copy does not wait for the device's queued work
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def prepare(
        self, out: SchedulerOutput, kv: KVCacheManager, prev_rows: dict[str, int] | None = None
    ) -> PreparedStep:
        """The step's inputs on the device: its rows (step_rows.py), then the attention backend's
        metadata for them. ``prev_rows``: each request's row in the previous step's sampled ids
        (async scheduling fills placeholder inputs from them on the device)."""
        rows = build_step_rows(out, kv, self.block_size, self._buffers, self.input_batch, prev_rows)
        meta = self.backend.step_metadata(rows, self._tensor, self.block_size)
        grammar = None
        if any(
            r.structured is not None for r in out.requests
        ):  # constrained decoding: the next-token masks
            from kvmesh.engine.structured import bitmask

            grammar = bitmask.for_step(
                rows.sampling_requests, rows.spec_rows, self.config.vocab_size
            )
        return PreparedStep(
            rows.requests,
            self._tensor(rows.ids),
            self._tensor(rows.positions),
            meta,
            self._tensor(rows.logits().indices),
            rows.sampling_requests,
            rows.prompt_rows,
            rows.spec_rows,
            self._tensor(rows.fill_dst) if rows.fill_dst else None,
            self._tensor(rows.fill_src) if rows.fill_src else None,
            {r.request_id: i for i, r in enumerate(rows.sampling_requests)},
            grammar,
            sample_positions=rows.sample_positions,
            lora=self._lora_step(rows),
        )

    def _lora_step(self, rows):
        """The step's adapter rows (lora/step.py); None, and no LoRA work, for a base-only step."""
        if all(r.lora is None for r in rows.requests):
            return None
        from kvmesh.engine.lora.packed import packed_weights
        from kvmesh.engine.lora.step import LoRAContext, build_lora_step

        if self.model.lora is None:  # installed with the first adapter step
            kernel = _lora_kernel(self.backend.name)
            self.model.use_lora(LoRAContext(kernel, self.cpu_ops))
        return build_lora_step(
            rows.requests,
            rows.query_start_loc,
            rows.logits().indices,
            lambda a: packed_weights(a, self.config, self.device, self.dtype),
            self._tensor,
            stack=self.model.lora.stacks,
        )

    def execute(
        self, out: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[
        dict[str, int], dict[str, TokenLogprobs], dict[str, list[tuple[int, TokenLogprobs]]]
    ]:
        """Sampled tokens, their logprobs, and prompt logprobs as (position, logprob) per request.

        A request that verified drafts this step gets a list: the accepted drafts, then one sampled
        token (and a list of logprobs, one per token). The step's tier copies run first, before
        anything that can fail (a rerun of part of the step finds them done)."""
        self.transfer(kv.take_transfers())
        return self.finish(self.run(self.prepare(out, kv)))

    @torch.inference_mode()
    def run(self, step: PreparedStep, prev: StepResult | None = None) -> StepResult:
        """The device part of a step: placeholder fill, forward, sampling. Nothing here waits for
        the device but what logprobs need; the sampled ids come back through ``finish``. With
        async scheduling this runs on the engine's step thread, one step after the other (so a
        step's tier copies never race the step before it)."""
        self.transfer(step.transfers)
        input_ids = step.input_ids
        if step.fill_dst is not None:
            if prev is None or prev.tokens is None:
                raise RuntimeError(
                    "the previous step left no sampled ids to fill this step's inputs"
                )
            # The previous step's sampled ids into this step's inputs, on the device (before the
            # forward, and so before a CUDA graph's static buffers take the inputs).
            input_ids.index_copy_(0, step.fill_dst, prev.tokens.index_select(0, step.fill_src))
        sampling_requests, prompt_rows, spec_rows = (
            step.sampling_requests,
            step.prompt_rows,
            step.spec_rows,
        )
        logits = self._forward(step, input_ids)
        result = StepResult()
        num_plain = len(sampling_requests)
        num_sampling = num_plain + sum(len(d) + 1 for _, d in spec_rows)
        if step.grammar is not None:  # before greedy, sampling and draft verification alike
            from kvmesh.engine.structured import bitmask

            mask, rows = step.grammar
            bitmask.apply(logits, mask, rows, self.config.vocab_size)
        if prompt_rows:
            result.prompt_lps = prompt_logprobs(logits[num_sampling:], prompt_rows)
        if spec_rows:
            from kvmesh.engine.spec_decode.rejection import verify

            for (req, _), v in zip(
                spec_rows,
                verify(
                    self.sampler,
                    logits[num_plain:num_sampling],
                    [r for r, _ in spec_rows],
                    [d for _, d in spec_rows],
                ),
            ):
                result.sampled[req.request_id] = v.tokens
                if v.logprobs is not None:
                    result.logprobs[req.request_id] = v.logprobs
        if not sampling_requests:
            return result
        if prompt_rows or spec_rows:
            logits = logits[:num_plain]
        tokens, logprobs = self.sampler(
            logits, sampling_requests, to_host=False, positions=step.sample_positions
        )
        result.tokens = tokens
        result.requests = sampling_requests
        result.logprobs.update(
            (r.request_id, lp) for r, lp in zip(sampling_requests, logprobs) if lp is not None
        )
        if (
            tokens.device.type == "cuda"
        ):  # the step's one device-to-host copy, without waiting for it
            result.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            result.host.copy_(tokens, non_blocking=True)
            result.event = torch.cuda.Event()
            result.event.record()
        else:
            result.host = tokens
        return result

    def _forward(self, step: PreparedStep, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's logits: from a CUDA graph where one covers the step, else the eager model.
        The graphs hold no LoRA terms: a step with adapter rows runs eagerly."""
        meta, positions = step.meta, step.positions
        if step.lora is not None:
            return self.model(
                input_ids, positions, self.kv_caches, meta, step.logits_indices, lora=step.lora
            )
        if (
            not step.spec_rows
            and self.graphs is not None
            and self.graphs.can_replay(meta, len(step.sampling_requests))
        ):
            return self.graphs.replay(input_ids, positions, meta)
        if self.piecewise is not None and self.piecewise.covers(meta, input_ids.shape[0]):
            return self.piecewise.forward(input_ids, positions, meta, step.logits_indices)
        return self.model(input_ids, positions, self.kv_caches, meta, step.logits_indices)

    @staticmethod
    def finish(
        result: StepResult,
    ) -> tuple[
        dict[str, int], dict[str, TokenLogprobs], dict[str, list[tuple[int, TokenLogprobs]]]
    ]:
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
    # Constrained decoding: the next-token bitmask and the sampling rows it applies to (None: none)
    grammar: tuple[torch.Tensor, list[int]] | None = None
    sample_positions: list[int] | None = (
        None  # per sampling request: the output position it samples
    )
    lora: object = None  # the adapter rows (lora/step.py LoRAStep); None: base rows only
    transfers: object = None  # async steps: the tier copies to run first (kv_offload/transfer.py)


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


def _lora_kernel(backend_name: str):
    """The LoRA shrink/expand: Triton kernels with the Triton backend (CUDA), torch GEMMs elsewhere."""
    if backend_name == "triton":
        from kvmesh.engine.kernels.triton_lora import add_lora_triton

        return add_lora_triton
    from kvmesh.engine.lora.step import add_lora_torch

    return add_lora_torch


def prompt_logprobs(
    logits: torch.Tensor, rows: list[tuple[Request, int]]
) -> dict[str, list[tuple[int, TokenLogprobs]]]:
    """Per request, (position, logprob) of prompt token p + 1 under row p's logits."""
    found = token_logprobs(
        logits,
        [req.all_token_ids[p + 1] for req, p in rows],
        [req.sampling_params.prompt_logprobs for req, _ in rows],
    )
    result: dict[str, list[tuple[int, TokenLogprobs]]] = {}
    for (req, p), lp in zip(rows, found):
        result.setdefault(req.request_id, []).append((p + 1, lp))
    return result
