"""Llama-family decoder over a flattened batch (SmolLM2, Llama 2/3, Mistral, Qwen2).

All scheduled tokens of all requests run as one [T, hidden] batch; attention
reads and writes the paged KV cache. q/k/v and gate/up projections are fused
into one matmul each. Logits are computed only for the rows that sample, and the
last layer carries on past its K/V only for those rows. With a step's LoRA adapter rows
(lora/step.py), each projection adds their adapters' terms to those rows.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.attention import AttentionMetadata, paged_attention, write_kv
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.kernels.onednn_linear import panel_max_rows


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = None  # fused ops (the compiled CPU ops or the Triton ones; set by use_fused_ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the residual stream updated."""
        if self.ops is not None and x.dim() == 2:
            if residual is None:
                out = torch.empty_like(x)
                self.ops.rms_norm(out, x, self.weight, self.eps)
                return out
            self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)  # both in place
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm.
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE variant."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's positions, [T, 1, head_dim]: looked up once per step, not per layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


class StepRope:
    """The step's RoPE inputs, built once per step: positions for the fused CPU op, or the
    looked-up cos/sin rows for the torch path."""

    def __init__(
        self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, fused: bool
    ):
        self.rope, self.positions = rope, positions
        self.cos_sin = None if fused else rope(positions, dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _lora_add(lora, out: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
    """The step's adapter terms into a projection's output; nothing when no adapter is in it."""
    if lora is not None and lora.rows is not None:
        lora.add(out, x, layer, proj)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.lora = None  # the shared LoRAContext (lora/step.py), set by use_lora
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            self.q_size,
            config.hidden_size,
            bias=config.attention_bias and config.model_type != "qwen2",
        )
        self.scale = self.head_dim**-0.5
        self.ops = None
        self.attend = paged_attention  # the attention backend's forward (use_attention_backend)

    def project_and_store(self, x, step_rope: StepRope, k_cache, v_cache, meta: AttentionMetadata):
        """q, k, v of the rows ([T, heads, dim], RoPE applied), with k and v stored in the cache."""
        qkv = self.qkv_proj(x)
        _lora_add(self.lora, qkv, x, self.layer, "qkv_proj")
        fused = step_rope.cos_sin is None
        if fused:  # rotate the q and k heads inside qkv in place, storing K/V in the same pass
            rope = step_rope.rope
            self.ops.rotary_qk_store_kv_(
                qkv,
                step_rope.positions,
                rope.cos,
                rope.sin,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                k_cache,
                v_cache,
                meta.slots,
            )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not fused:
            cos, sin = step_rope.cos_sin
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            write_kv(k_cache, v_cache, k, v, meta)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.lora = None
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        self.ops = None

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        _lora_add(self.lora, gate_up, x, self.layer, "gate_up_proj")
        if self.ops is not None and gate_up.dim() == 2:
            act = self.ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate).mul_(up)
        out = self.down_proj(act)
        _lora_add(self.lora, out, act, self.layer, "down_proj")
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer)

    def forward(self, x, residual, step_rope, k_cache, v_cache, meta, sample_rows=None):
        """vLLM's residual convention: returns (this layer's output, the residual stream before it).
        With `sample_rows`, every row's K/V is stored but only those rows attend and come out
        (the last layer: nothing else reads the other rows' outputs)."""
        q, k, v, residual = self.pre_attention(x, residual, step_rope, k_cache, v_cache, meta)
        if sample_rows is not None:
            if meta.sample_meta is None:  # nothing samples: the K/V store was all
                return residual[:0], residual[:0]
            q, meta, residual = q[sample_rows], meta.sample_meta, residual[sample_rows]
            if self.self_attn.lora is not None:
                self.self_attn.lora.to_logits_rows()
        attn = self.self_attn.attend(q, k, v, k_cache, v_cache, meta, self.self_attn.scale)
        return self.post_attention(attn, residual)

    # The layer in two halves around attention: the eager forward above runs both; the
    # piecewise CUDA graphs (piecewise_graphs.py) capture them and attend between.
    def pre_attention(self, x, residual, step_rope, k_cache, v_cache, meta):
        """Input norm (with the residual add), qkv projection, RoPE, the K/V store:
        (q, k, v, residual stream)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        q, k, v = self.self_attn.project_and_store(x, step_rope, k_cache, v_cache, meta)
        return q, k, v, residual

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor):
        """o_proj, the post-attention norm (with the residual add), MLP: (output, residual stream)."""
        attn = attn.reshape(-1, self.self_attn.q_size)
        x = self.self_attn.o_proj(attn)
        _lora_add(self.self_attn.lora, x, attn, self.self_attn.layer, "o_proj")
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def _panel_args(linear) -> tuple:
    return linear.panels, linear.out_features, linear.bias


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config, max_positions)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.packed_lm_head: nn.Module | None = None  # set by use_onednn()
        self.fused_ops = None  # set by use_fused_ops()
        self.decode_stack = None  # set by use_decode_stack()
        self._stack_caches = None  # the KV cache list the decode stack was given
        self.lora = None  # the LoRAContext of the step's adapter rows (use_lora)

    def use_fused_ops(self, ops) -> None:
        """Run norms, RoPE (+ the KV store) and SiLU-and-mul through fused ops: the compiled CPU
        ops (kernels/cpu.py) or the Triton ones (kernels/triton_ops.py), same signatures."""
        self.fused_ops = ops
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.ops = ops

    def use_lora(self, context) -> None:
        """Add the adapters' terms to the projections of a step's adapter rows (lora/step.py)."""
        self.lora = context
        for layer in self.layers:
            layer.self_attn.lora = layer.mlp.lora = context

    def use_attention_backend(self, backend) -> None:
        """Attend through this backend (attention_backends.py) in every layer."""
        for layer in self.layers:
            layer.self_attn.attend = backend.forward

    def use_onednn(self, batch_hint: int, panel_ops=None) -> int:
        """Swap every projection (and the LM head) for prepacked oneDNN linears; with `panel_ops`
        (the compiled CPU ops) they also run decode-size inputs on panels. See onednn_linear."""
        from kvmesh.engine.kernels.onednn_linear import OneDNNLinear, pack_model

        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_lm_head = OneDNNLinear(head, None, batch_hint, panel_ops)
        self.lm_head = None  # the packed copy replaces it (a tied head keeps the embedding)
        return pack_model(self.layers, batch_hint, panel_ops) + 1

    def use_decode_stack(self, ops) -> bool:
        """Run decode steps' layers in one call of the compiled CPU ops' DecodeStack
        (kernels/decode_stack_cpu.cpp): the same kernels in the same order, without Python
        between them. Only where it computes exactly what the layers do: fp32 or bf16, every
        projection on panels (use_onednn with panel_ops), fused ops and attention from these ops.
        ``KVMESH_DECODE_STACK=0`` keeps the Python layers."""
        linears = [
            m
            for layer in self.layers
            for m in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]
        if (
            os.environ.get("KVMESH_DECODE_STACK", "1") == "0"
            or ops is None
            or not hasattr(ops, "DecodeStack")
            or self.fused_ops is not ops
            or any(getattr(m, "panels", None) is None for m in linears)
            or any(layer.self_attn.attend is not paged_attention for layer in self.layers)
        ):
            self.decode_stack = None
            return False
        c = self.config
        stack = ops.DecodeStack(
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            self.layers[0].self_attn.scale,
            self.norm.eps,
            self.norm.weight,
            self.rope.cos,
            self.rope.sin,
        )
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(
                layer.input_layernorm.weight,
                *_panel_args(attn.qkv_proj),
                *_panel_args(attn.o_proj),
                layer.post_attention_layernorm.weight,
                *_panel_args(mlp.gate_up_proj),
                *_panel_args(mlp.down_proj),
            )
        self.decode_stack, self._stack_caches = stack, None
        return True

    def _decode_stack_covers(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return (
            self.decode_stack is not None
            and (self.lora is None or self.lora.rows is None)  # it has no LoRA terms
            and meta.all_decode
            and meta.cpu_ops is not None
            and x.dtype == self.packed_lm_head.panels.dtype
            and 0 < x.shape[0] <= panel_max_rows(x.dtype)
        )

    def forward(
        self, input_ids, positions, kv_caches, meta: AttentionMetadata, logits_indices, lora=None
    ):
        """Logits of the ``logits_indices`` rows; ``lora``: the step's adapter rows (a LoRAStep,
        lora/step.py; None: every row runs on the base model)."""
        if self.lora is None:
            if lora is not None:
                raise RuntimeError("a step with adapter rows on a model without use_lora")
            return self._forward(input_ids, positions, kv_caches, meta, logits_indices)
        self.lora.begin(lora)
        try:
            return self._forward(input_ids, positions, kv_caches, meta, logits_indices)
        finally:
            self.lora.begin(None)

    def _forward(self, input_ids, positions, kv_caches, meta, logits_indices):
        x = self.embed_tokens(input_ids)
        if self._decode_stack_covers(x, meta):
            if self._stack_caches is not kv_caches:
                self.decode_stack.set_kv_caches(
                    [k for k, _ in kv_caches], [v for _, v in kv_caches]
                )
                self._stack_caches = kv_caches
            x = self.decode_stack.forward(
                x, positions, meta.slots, meta.decode_block_tables, meta.decode_ctx_lens
            )
            return self.packed_lm_head(x).float()
        step_rope = StepRope(self.rope, positions, x.dtype, fused=self.fused_ops is not None)
        residual = None
        last = len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            # The last layer's attention output, o_proj and MLP are only needed for the rows
            # that sample: for a prefill that is one row in hundreds.
            x, residual = layer(
                x,
                residual,
                step_rope,
                k_cache,
                v_cache,
                meta,
                logits_indices if i == last else None,
            )
        return self.compute_logits(self.final_norm(x, residual))

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(x + residual)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(x).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()
