// Per-layer elementwise work of a step in one op each, where torch runs 5-9: RMSNorm (+ the
// residual add before it), SiLU(gate) * up (bf16 only), and RoPE on Q and K with the K/V write into
// the paged cache. In a decode step (~1,700 small ops at batch 8) they save dispatch; in a
// prefill step they save the memory passes of torch's op chain (each op reads and writes the
// whole activation). Each op rounds to bfloat16 where torch's sequence of bf16 ops rounds, so
// results match those ops but for float32 summation order (norm) and exp's last bits. Every row
// is computed alone; only the norm's summation order depends on the step's size (see norm_row).
// float32 steps: RoPE + the K/V write bit for bit equal to torch's float32 ops, the norm but for
// the summation order of its squares.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

#include "vec_exp.h"

namespace {

using namespace kvpool_vec;  // exp16, exp8

using bf16 = c10::BFloat16;
// Rows one thread takes at least: a decode step's elementwise work is microseconds, less than
// waking a second thread costs (on a shared machine far less), so steps of up to 32 rows stay on
// one; a prefix hit's 64-token step and prefill steps split their rows over every thread.
constexpr int64_t kRowsPerThread = 32;
// Steps of more rows than this sum a norm's squares in 16 lanes even when not batch-invariant
// (as before: the split above does not change which rows do).
constexpr int64_t kLaneRows = 64;

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

// Batch-invariant (docs/determinism.md; KVPOOL_BATCH_INVARIANT=0 turns it off for comparison):
// every row sums its squares in lanes, whatever the step's row count.
bool batch_invariant() {
  static const bool on = [] {
    const char* v = std::getenv("KVPOOL_BATCH_INVARIANT");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512 round16(__m512 v) {  // to bf16, nearest even, kept as float32 (finite values)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline void store16(bf16* p, __m512 rounded) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
#endif

// One row: sum = x + residual when residual is given; out = w * (sum * rsqrt(mean(sum^2) + eps)).
// bf16: the sum and the normalized row rounded to bf16 before the weight multiplies, the product
// rounded again (torch's `weight * normed.to(bf16)`). float32: each product rounded once, as
// torch's float32 ops (built without contraction); only the summation order of the squares differs.
// `lanes`: sum the squares in 16 float32 lanes (every row when batch-invariant, else prefill
// steps); otherwise in one running sum, element by element (decode steps of earlier builds).
template <class T>
void norm_row(const T* x, const T* residual, const T* w, float eps, int64_t n, T* out, T* sum_out, float* scratch,
              bool lanes) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  const auto rounded = [](float v) { return kBf16 ? round_bf16(v) : v; };
  float ss = 0.f;
  int64_t i = 0;
  if (lanes) {
#ifdef __AVX512F__
    if constexpr (kBf16) {
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= n; i += 16) {
        __m512 v = load16(x + i);
        if (residual != nullptr) {
          v = round16(_mm512_add_ps(v, load16(residual + i)));
          store16(sum_out + i, v);
        }
        _mm512_storeu_ps(scratch + i, v);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      ss = _mm512_reduce_add_ps(acc);
    }
#endif
    if constexpr (!kBf16) {  // 16 running sums the compiler keeps in vector registers
      float acc[16] = {};
      for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) {
          float v = x[i + j];
          if (residual != nullptr) sum_out[i + j] = v = v + residual[i + j];
          scratch[i + j] = v;
          acc[j] += v * v;
        }
      for (float a : acc) ss += a;
    }
  }
  for (; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    if (residual != nullptr) {
      v = rounded(v + static_cast<float>(residual[i]));
      sum_out[i] = T(v);
    }
    scratch[i] = v;
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#ifdef __AVX512F__
  if constexpr (kBf16) {
    const __m512 rv = _mm512_set1_ps(r);
    for (; i + 16 <= n; i += 16)
      store16(out + i, round16(_mm512_mul_ps(load16(w + i), round16(_mm512_mul_ps(_mm512_loadu_ps(scratch + i), rv)))));
  }
#endif
  for (; i < n; ++i) out[i] = T(static_cast<float>(w[i]) * rounded(scratch[i] * r));
}

template <class T>
void norm_rows(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight, double eps,
               at::Tensor& out, at::Tensor& sum) {
  const int64_t rows = x.size(0), n = x.size(1);
  const bool add = residual.has_value(), lanes = batch_invariant() || rows > kLaneRows;
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerThread, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(n);
    for (int64_t r = begin; r < end; ++r) {
      norm_row<T>(x.data_ptr<T>() + r * x.stride(0), add ? residual->data_ptr<T>() + r * residual->stride(0) : nullptr,
                  wp, static_cast<float>(eps), n, out.data_ptr<T>() + r * n, add ? sum.data_ptr<T>() + r * n : nullptr,
                  scratch.data(), lanes);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                     const at::Tensor& weight, double eps) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && (dt == at::kBFloat16 || dt == at::kFloat) && x.dim() == 2 && x.stride(1) == 1,
              "x: 2-D float32 or bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == dt && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight: [hidden], x's dtype");
  if (residual.has_value())
    TORCH_CHECK(residual->scalar_type() == dt && residual->sizes() == x.sizes() && residual->stride(1) == 1,
                "residual: shaped and typed like x, contiguous rows");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = residual.has_value() ? at::empty(x.sizes(), x.options()) : x;
  if (dt == at::kFloat)
    norm_rows<float>(x, residual, weight, eps, out, sum);
  else
    norm_rows<bf16>(x, residual, weight, eps, out, sum);
  return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(add_rms_norm_impl(x, c10::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                                double eps) {
  return add_rms_norm_impl(x, residual, weight, eps);
}


// out = silu(gate) * up, silu(x) = x / (1 + exp(-x)), each op rounded as torch's F.silu then `*`
// round it (bf16: to bf16 after each); exp's last bits differ from torch's.
template <class T>
void silu_mul_row(const T* g, const T* u, int64_t n, T* o) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, bf16>) {
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
      const __m512 x = load16(g + i);
      const __m512 s = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
      store16(o + i, round16(_mm512_mul_ps(s, load16(u + i))));
    }
#endif
    for (; i < n; ++i) {
      const float x = static_cast<float>(g[i]);
      o[i] = bf16(round_bf16(x / (1.f + std::exp(-x))) * static_cast<float>(u[i]));
    }
  } else {
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
      const __m512 x = _mm512_loadu_ps(g + i);
      const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const auto dt = gate_up.scalar_type();
  TORCH_CHECK(gate_up.device().is_cpu() && (dt == at::kBFloat16 || dt == at::kFloat) && gate_up.dim() == 2 &&
                  gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up: 2-D float32 or bfloat16 CPU tensor [T, 2 * intermediate] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const auto rows_of = [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, rows, kRowsPerThread, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = gate_up.data_ptr<T>() + r * gate_up.stride(0);
        silu_mul_row<T>(g, g + inter, inter, out.data_ptr<T>() + r * inter);
      }
    });
  };
  if (dt == at::kFloat)
    rows_of(float{});
  else
    rows_of(bf16{});
  return out;
}

// One head's RoPE, HF's rotate_half: dst = (x1*c - x2*s, x2*c + x1*s). float32: each product
// and sum rounded once, no contraction (built with -ffp-contract=off), as torch's ops round, so
// the result equals the op-by-op path bit for bit. bf16: torch's bf16 rounding order (x1*c,
// x2*s, their difference, ... each rounded).
inline void rope_head(const float* x, const float* c, const float* s, int64_t half, float* dst) {
  for (int64_t j = 0; j < half; ++j) {
    dst[j] = x[j] * c[j] - x[j + half] * s[j];
    dst[j + half] = x[j + half] * c[j] + x[j] * s[j];
  }
}

inline void rope_head(const bf16* x, const bf16* c, const bf16* s, int64_t half, bf16* dst) {
  int64_t j = 0;
#ifdef __AVX512F__
  for (; j + 16 <= half; j += 16) {
    const __m512 x1 = load16(x + j), x2 = load16(x + j + half), cj = load16(c + j), sj = load16(s + j);
    store16(dst + j, round16(_mm512_sub_ps(round16(_mm512_mul_ps(x1, cj)), round16(_mm512_mul_ps(x2, sj)))));
    store16(dst + j + half, round16(_mm512_add_ps(round16(_mm512_mul_ps(x2, cj)), round16(_mm512_mul_ps(x1, sj)))));
  }
#endif
  for (; j < half; ++j) {
    const float x1 = static_cast<float>(x[j]), x2 = static_cast<float>(x[j + half]);
    const float cj = static_cast<float>(c[j]), sj = static_cast<float>(s[j]);
    dst[j] = bf16(round_bf16(x1 * cj) - round_bf16(x2 * sj));
    dst[j + half] = bf16(round_bf16(x2 * cj) + round_bf16(x1 * sj));
  }
}

// q, k = rope(qkv's Q and K heads); k and qkv's V heads written to their cache slots.
template <typename T>
void rope_write_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const int64_t* sp, int64_t heads, int64_t kv_heads, at::Tensor& q,
                     at::Tensor& k) {
  const int64_t t = qkv.size(0), d = k_cache.size(3), half = d / 2;
  at::parallel_for(0, t, kRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = qkv.data_ptr<T>() + i * qkv.stride(0);
      const T* c = cos.data_ptr<T>() + i * half;
      const T* s = sin.data_ptr<T>() + i * half;
      T* kc = k_cache.data_ptr<T>() + sp[i] * kv_heads * d;
      T* vc = v_cache.data_ptr<T>() + sp[i] * kv_heads * d;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* dst = h < heads ? q.data_ptr<T>() + (i * heads + h) * d : k.data_ptr<T>() + (i * kv_heads + h - heads) * d;
        rope_head(row + h * d, c, s, half, dst);
        if (h >= heads) std::memcpy(kc + (h - heads) * d, dst, d * sizeof(T));
      }
      std::memcpy(vc, row + (heads + kv_heads) * d, kv_heads * d * sizeof(T));
    }
  });
}

// float32 or bfloat16 rows, tables and caches alike.
std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                 const at::Tensor& slots, int64_t heads, int64_t kv_heads) {
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(qkv.device().is_cpu() && (dt == at::kBFloat16 || dt == at::kFloat) && qkv.dim() == 2 && qkv.stride(1) == 1,
              "qkv: 2-D float32 or bfloat16 CPU tensor with contiguous rows");
  const int64_t t = qkv.size(0);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == dt && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == dt && v_cache.is_contiguous(),
              "caches: contiguous [blocks, block_size, kv_heads, head_dim] of qkv's dtype");
  const int64_t d = k_cache.size(3), half = d / 2;
  TORCH_CHECK(k_cache.size(2) == kv_heads && qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv: [T, (H + 2 Hkv) * D]");
  TORCH_CHECK(cos.scalar_type() == dt && cos.is_contiguous() && cos.numel() == t * half && sin.scalar_type() == dt &&
                  sin.is_contiguous() && sin.numel() == t * half,
              "cos, sin: contiguous [T, 1, D/2] of qkv's dtype (full rotary)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == t, "slots: int64 [T]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  at::Tensor q = at::empty({t, heads, d}, qkv.options());
  at::Tensor k = at::empty({t, kv_heads, d}, qkv.options());
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot ", sp[i], " out of the cache");
  if (dt == at::kFloat)
    rope_write_rows<float>(qkv, cos, sin, k_cache, v_cache, sp, heads, kv_heads, q, k);
  else
    rope_write_rows<bf16>(qkv, cos, sin, k_cache, v_cache, sp, heads, kv_heads, q, k);
  return {q, k};
}


// Sampling's passes over a step's [N, V] logits, float32 or the model's bfloat16 read as the
// float32 values they are (exact), a row per task (torch's argmax and log_softmax take 1-2 ms at
// 32 x 49k here, ~5x these). Each row alone, whatever N.

inline float value(float v) { return v; }
inline float value(bf16 v) { return static_cast<float>(v); }

// The first index of the row's maximum; a NaN counts as the maximum (the first NaN's index), as
// torch.argmax.
template <class T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0, best_i = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
#ifdef __AVX512F__
  if (n >= 16) {
    __m512 vbest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i vidx = _mm512_setzero_si512(), at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16, at = _mm512_add_epi32(at, step)) {
      const __m512 v = load16(x + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);  // strictly: a lane keeps its first
      vbest = _mm512_mask_mov_ps(vbest, greater, v);
      vidx = _mm512_mask_mov_epi32(vidx, greater, at);
    }
    nan = unordered != 0;
    alignas(64) float vals[16];
    alignas(64) int32_t idx[16];
    _mm512_store_ps(vals, vbest);
    _mm512_store_si512(idx, vidx);
    for (int l = 0; l < 16; ++l)
      if (vals[l] > best || (vals[l] == best && idx[l] < best_i)) best = vals[l], best_i = idx[l];
  }
#endif
  for (; i < n; ++i) {
    const float v = value(x[i]);
    if (std::isnan(v)) nan = true;
    if (v > best) best = v, best_i = i;
  }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(value(x[j]))) return j;
  return best_i;
}

// The two terms of log_softmax(x)[t] = (x[t] - max) - log(sum(exp(x - max))) as torch forms it
// (but for the order of the sum and exp's last bits): (max, log of the sum); both NaN when the
// row holds a NaN.
template <class T>
std::pair<float, float> log_softmax_row(const T* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vmax = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  nan = unordered != 0;
  m = _mm512_reduce_max_ps(vmax);
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(value(x[i]));
    m = std::max(m, value(x[i]));
  }
  if (nan) return {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::quiet_NaN()};
  i = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, exp16(_mm512_sub_ps(load16(x + i), vm)));
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += std::exp(value(x[i]) - m);
  return {m, std::log(sum)};
}

void check_logits(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              what, ": contiguous float32 or bfloat16 [N, V] CPU logits, V >= 1");
}

// f(rows) on the logits' elements as float32 or bf16
template <class F>
void with_rows(const at::Tensor& logits, const F& f) {
  if (logits.scalar_type() == at::kFloat)
    f(logits.data_ptr<float>());
  else
    f(logits.data_ptr<bf16>());
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_logits(logits, "argmax_rows");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  with_rows(logits, [&](const auto* x) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * n, n);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> log_softmax_parts(const at::Tensor& logits) {
  check_logits(logits, "log_softmax_parts");
  const int64_t rows = logits.size(0), n = logits.size(1);
  const auto options = logits.options().dtype(at::kFloat);
  at::Tensor top = at::empty({rows}, options), log_sum = at::empty({rows}, options);
  float *t = top.data_ptr<float>(), *l = log_sum.data_ptr<float>();
  with_rows(logits, [&](const auto* x) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) std::tie(t[r], l[r]) = log_softmax_row(x + r * n, n);
    });
  });
  return {top, log_sum};
}

}  // namespace

TORCH_LIBRARY(kvpool_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("log_softmax_parts(Tensor logits) -> (Tensor, Tensor)");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int heads, int kv_heads) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(kvpool_fused, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("argmax_rows", argmax_rows);
  m.impl("log_softmax_parts", log_softmax_parts);
  m.impl("rope_write_kv", rope_write_kv);
}
