// A Llama decoder stack for decode steps on the CPU: every layer of a step in which each row is
// one request's next token, in one call.
//
//   DecodeStack(heads, kv_heads, head_dim, scale, eps, final_norm, cos, sin)
//   .add_layer(input_norm, qkv, o, post_norm, gate_up, down)   each linear: (panels, N, bias?)
//   .set_kv_caches([k per layer], [v per layer])
//   .forward(x, positions, slots, block_tables, ctx_lens) -> final-norm hidden states [R, hidden]
//
// Why: at decode sizes a layer is eight kernel calls of tens of microseconds to a few
// milliseconds, and the Python between them (module calls, views, splits, the linears' wrappers)
// cost about 4 ms of a 60 ms step of 16 rows on SmolLM2-135M. This runs the same kernels
// (fused_ops_cpu, panel_linear_cpu, paged_attention_cpu) in the same order on the same
// tensors, so its results are the Python path's, bit for bit (tests/engine/test_decode_stack.py);
// llama.py uses it only for steps it covers: fp32 or bf16, every linear on panels, every row a
// decode.
#include <vector>

#include "cpu_ops.h"

namespace {

struct PanelWeight {
  torch::Tensor panels;
  int64_t n;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const { return panel_linear(x, panels, n, bias); }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  PanelWeight qkv, o, gate_up, down;
};

PanelWeight panel_weight(torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(panels.dim() == 3 && (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16),
              "DecodeStack: fp32 or bf16 panel-packed weights");
  if (bias.has_value() && !bias->defined()) bias = c10::nullopt;
  return PanelWeight{panels, n, bias};
}

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
              torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        final_norm_(final_norm), cos_(cos), sin_(sin) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, int64_t qkv_n, c10::optional<torch::Tensor> qkv_bias,
                 torch::Tensor o, int64_t o_n, c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm,
                 torch::Tensor gate_up, int64_t gate_up_n, c10::optional<torch::Tensor> gate_up_bias,
                 torch::Tensor down, int64_t down_n, c10::optional<torch::Tensor> down_bias) {
    layers_.push_back(Layer{input_norm, post_norm, panel_weight(qkv, qkv_n, qkv_bias), panel_weight(o, o_n, o_bias),
                            panel_weight(gate_up, gate_up_n, gate_up_bias), panel_weight(down, down_n, down_bias)});
  }

  void set_kv_caches(std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches) {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "DecodeStack: one K and one V cache per layer");
    k_caches_ = std::move(k_caches);
    v_caches_ = std::move(v_caches);
  }

  // x: the rows' embeddings [R, hidden], contiguous, in the weights' dtype; it becomes the residual stream and is
  // overwritten, as in the Python path. Mirrors LlamaForCausalLM.forward with every row sampling
  // (DecoderLayer.forward: vLLM's residual convention).
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                        torch::Tensor ctx_lens) {
    TORCH_CHECK(k_caches_.size() == layers_.size(), "DecodeStack: set_kv_caches first");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                    x.scalar_type() == layers_.front().qkv.panels.scalar_type(),
                "DecodeStack: x is [R, hidden] in the weights' dtype");
    const int64_t rows = x.size(0), q_size = num_heads_ * head_dim_;
    torch::Tensor residual = x;
    torch::Tensor h = torch::empty_like(x);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i == 0) {
        rms_norm(h, x, layer.input_norm, eps_);
      } else {
        fused_add_rms_norm(h, residual, layer.input_norm, eps_);
      }
      torch::Tensor qkv = layer.qkv(h);
      rotary_qk_store_kv_(qkv, positions, cos_, sin_, num_heads_, num_kv_heads_, head_dim_, k_caches_[i],
                          v_caches_[i], slots);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
      torch::Tensor attn = paged_decode_attention(q, k_caches_[i], v_caches_[i], block_tables, ctx_lens, scale_);
      torch::Tensor o = layer.o(attn.view({rows, q_size}));
      fused_add_rms_norm(o, residual, layer.post_norm, eps_);
      h = layer.down(silu_and_mul(layer.gate_up(o)));
    }
    fused_add_rms_norm(h, residual, final_norm_, eps_);
    return h;
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_, eps_;
  torch::Tensor final_norm_, cos_, sin_;
  std::vector<Layer> layers_;
  std::vector<torch::Tensor> k_caches_, v_caches_;
};

void bind_decode_stack(pybind11::module& m) {
  // module_local: two builds of the kernels can live in one process (the tests load the AVX2 one
  // beside the machine's own), each with its own DecodeStack type.
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local(),
                                "a Llama decoder stack for decode steps (decode_stack_cpu.cpp)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor, torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_kv_caches", &DecodeStack::set_kv_caches)
      .def("forward", &DecodeStack::forward);
}
