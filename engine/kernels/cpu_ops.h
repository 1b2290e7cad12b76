// The CPU extension's ops, declared once: bindings_cpu.cpp binds them, decode_stack_cpu.cpp
// calls them. Each is defined (and documented) in its own file.
#pragma once

#include <torch/extension.h>

// paged_attention_cpu.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, double scale);
// fused_ops_cpu.cpp
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_qk_store_kv_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor slots);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void lora_add_rows(torch::Tensor out, torch::Tensor x, torch::Tensor gather, torch::Tensor counts,
                   torch::Tensor a, torch::Tensor bt, torch::Tensor ranks);
// prefill_attention_cpu.cpp
bool prefill_attention_supported(c10::ScalarType dtype, int64_t head_dim, int64_t block_size);
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor seqs, torch::Tensor block_tables, double scale);
// panel_linear_cpu.cpp
torch::Tensor pack_panels(torch::Tensor w);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias);
// panel_linear_bf16_cpu.cpp
torch::Tensor pack_panels_bf16(torch::Tensor w);
torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias);
// decode_stack_cpu.cpp
void bind_decode_stack(pybind11::module& m);
