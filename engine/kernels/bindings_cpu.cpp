// The CPU extension module: decode attention (paged_attention_cpu.cpp), prefill
// attention (prefill_attention_cpu.cpp), the fused elementwise ops (fused_ops_cpu.cpp), the
// decode-size linear layers over panel-packed weights (panel_linear_cpu.cpp) and a decoder
// stack for decode steps built from them (decode_stack_cpu.cpp), and the LoRA terms of a short
// step's adapter rows (lora_cpu.cpp).
#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache");
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual) * weight (in place)");
  m.def("rotary_qk_store_kv_", &rotary_qk_store_kv_,
        "RoPE on the q and k heads of a fused qkv tensor, in place, and each row's k and v heads stored in "
        "its slot (block * block_size + offset) of the cache");
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether paged_prefill_attention handles this dtype, head size and block size");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of the step's prefill rows over the paged KV cache (written into out)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("pack_panels", &pack_panels, "a weight [N, K] as panels of 16 output features: fp32 [ceil(N/16), K, 16], bf16 [ceil(N/16), ceil(K/2), 32]");
  m.def("panel_linear", &panel_linear, "x @ w.T (+ bias) over panel-packed weights (decode-size row counts)",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("N"), pybind11::arg("bias") = pybind11::none());
  m.def("lora_add_rows", &lora_add_rows,
        "each adapter's rows of a short step: out[row] += (A x[row]) @ B^T, up to the adapter's rank");
  bind_decode_stack(m);
}
