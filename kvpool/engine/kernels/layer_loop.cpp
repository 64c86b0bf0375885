// A decode-sized step's whole decoder stack in one op. The Python loop over fused layers
// (llama.py: LlamaLayer.fused_forward) makes ~13 op calls per layer, and on a small model each
// call's Python and dispatch cost is as large as the kernel's work: at batch 8 a fifth of the
// step. This op makes the same calls, to the same registered kernels, in the same order, through
// the dispatcher from C++: its output equals the Python loop's bit for bit. It covers what
// decode steps take: Llama-style layers whose four projections all run on 4-bit groups (so no
// row padding and no bias), RoPE + the K/V write fused, and the native paged attention for every
// sequence. Anything else stays on the Python loop.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

using at::Tensor;

template <class Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      find<Tensor(const Tensor&, const Tensor&, double)>("kvpool_fused::rms_norm");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)> add_rms_norm =
      find<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>("kvpool_fused::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul = find<Tensor(const Tensor&)>("kvpool_fused::silu_mul");
  using Rope = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                          const Tensor&, int64_t, int64_t);
  c10::TypedOperatorHandle<Rope> rope_write_kv = find<Rope>("kvpool_fused::rope_write_kv");
  using Attn = void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                    const Tensor&, double, int64_t, double);
  c10::TypedOperatorHandle<Attn> attention = find<Attn>("kvpool_attn::paged_attention_out");
  using Linear = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  c10::TypedOperatorHandle<Linear> q4_linear = find<Linear>("kvpool::q4_linear");
  c10::TypedOperatorHandle<Linear> q4_linear_amx = find<Linear>("kvpool::q4_linear_amx");
  c10::TypedOperatorHandle<Linear> q4_vnni_linear_amx = find<Linear>("kvpool::q4_vnni_linear_amx");
};

const Ops& ops() {
  static const Ops found;  // the kernels' libraries are loaded before this one is first called
  return found;
}

// Per layer, in `weights`: the input norm's weight, the QKV projection's (nibbles, scales, mins),
// o_proj's three, the post-attention norm's weight, gate_up's three, down's three. `kernel` is
// the projections' 4-bit kernel: 0 the vector one, 1 the AMX one over groups as they are, 2 the
// AMX one over groups repacked in the B tiles' order (layers/linear.py: Q4Linear, Q4TileLinear).
constexpr int64_t kPerLayer = 14;

Tensor decode_layers(const Tensor& x, at::TensorList weights, at::TensorList caches, const Tensor& cos,
                     const Tensor& sin, const Tensor& local_cos, const Tensor& local_sin, at::IntArrayRef local_layers,
                     at::IntArrayRef windows, const Tensor& final_norm, const Tensor& slots,
                     const Tensor& block_tables, const Tensor& query_start, const Tensor& seq_lens, const Tensor& seqs,
                     int64_t heads, int64_t kv_heads, double scale, double softcap, double eps, int64_t kernel) {
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(weights.size()) == layers * kPerLayer &&
                  static_cast<int64_t>(caches.size()) == 2 * layers &&
                  static_cast<int64_t>(local_layers.size()) == layers,
              "decode_layers: per layer ", kPerLayer, " weights, a (k, v) cache pair, a window and a local-rope flag");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x must be [T, hidden], contiguous");
  const Ops& op = ops();
  TORCH_CHECK(kernel >= 0 && kernel <= 2, "decode_layers: kernel must be 0, 1 or 2");
  const auto& linear = kernel == 2 ? op.q4_vnni_linear_amx : kernel == 1 ? op.q4_linear_amx : op.q4_linear;
  const int64_t t = x.size(0);
  Tensor hidden = x, residual;
  for (int64_t i = 0; i < layers; ++i) {
    const Tensor* w = weights.data() + i * kPerLayer;
    Tensor h;
    if (i == 0) {
      h = op.rms_norm.call(hidden, w[0], eps);
      residual = hidden;
    } else {
      std::tie(h, residual) = op.add_rms_norm.call(hidden, residual, w[0], eps);
    }
    const Tensor qkv = linear.call(h, w[1], w[2], w[3]);
    const Tensor &k_cache = caches[2 * i], &v_cache = caches[2 * i + 1];
    const bool local = local_layers[i] != 0;
    auto [q, k] = op.rope_write_kv.call(qkv, local ? local_cos : cos, local ? local_sin : sin, k_cache, v_cache, slots,
                                        heads, kv_heads);
    Tensor attn = at::empty(q.sizes(), q.options());
    op.attention.call(attn, q, k_cache, v_cache, block_tables, query_start, seq_lens, seqs, scale, windows[i], softcap);
    const Tensor o = linear.call(attn.view({t, -1}), w[4], w[5], w[6]);
    std::tie(h, residual) = op.add_rms_norm.call(o, residual, w[7], eps);
    hidden = linear.call(op.silu_mul.call(linear.call(h, w[8], w[9], w[10])), w[11], w[12], w[13]);
  }
  return std::get<0>(op.add_rms_norm.call(hidden, residual, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY(kvpool_loop, m) {
  m.def("decode_layers(Tensor x, Tensor[] weights, Tensor(a!)[] caches, Tensor cos, Tensor sin, Tensor local_cos, "
        "Tensor local_sin, int[] local_layers, int[] windows, Tensor final_norm, Tensor slots, Tensor block_tables, "
        "Tensor query_start, Tensor seq_lens, Tensor seqs, int heads, int kv_heads, float scale, float softcap, "
        "float eps, int kernel) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvpool_loop, CPU, m) { m.impl("decode_layers", decode_layers); }
