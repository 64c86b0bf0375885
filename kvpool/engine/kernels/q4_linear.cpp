// y = x @ W^T for W stored as groups of 32 weights along K: GGUF's Q4_1 (w = d * q + m, q in
// 0..15) and Q8_0 (w = d * q, q in -127..127).
// float32: weights are dequantized in registers exactly as the checkpoint's float copy was
// made (a multiply, then an add: no fused multiply-add), so the result differs from a dense
// fp32 matmul by summation order only, while reading 8x fewer weight bytes per decode step.
// bfloat16: each dequantized float32 weight is then rounded to bfloat16 (to nearest even, as
// `Tensor.to(torch.bfloat16)` made the dense bf16 copy), so the kernel multiplies by the dense
// copy's weights bit for bit; products accumulate in float32 and the output is rounded to
// bfloat16 once, as oneDNN's bf16 GEMM does. AVX512-BF16 dot products where the CPU has them,
// AVX2 + FMA or scalar loops elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;  // activation rows one weight pass serves

#ifdef __AVX512F__
template <int R>
void q4_rows(const float* x, int64_t k, const uint8_t* qs, const float* scale, const float* mins,
             float* y, int64_t n_out, int64_t n_begin, int64_t n_end) {
  const int64_t groups = k / kGroup;
  const __m512i low_mask = _mm512_set1_epi32(15);
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m512 acc_lo[R], acc_hi[R];
    for (int r = 0; r < R; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
    const uint8_t* q = qs + n * (k / 2);
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i nibbles = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16)));
      const __m512 d = _mm512_set1_ps(scale[n * groups + g]);
      const __m512 m = _mm512_set1_ps(mins[n * groups + g]);
      const __m512 w_lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(nibbles, low_mask)), d), m);
      const __m512 w_hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(nibbles, 4)), d), m);
      for (int r = 0; r < R; ++r) {
        const float* xg = x + r * k + g * kGroup;
        acc_lo[r] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xg), acc_lo[r]);
        acc_hi[r] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xg + 16), acc_hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
  }
}
#else
template <int R>
void q4_rows(const float* x, int64_t k, const uint8_t* qs, const float* scale, const float* mins,
             float* y, int64_t n_out, int64_t n_begin, int64_t n_end) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    float acc[R] = {};
    const uint8_t* q = qs + n * (k / 2);
    for (int64_t g = 0; g < groups; ++g) {
      const float d = scale[n * groups + g], m = mins[n * groups + g];
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t byte = q[g * 16 + j];
        const float w_lo = static_cast<float>(byte & 15) * d + m;
        const float w_hi = static_cast<float>(byte >> 4) * d + m;
        for (int r = 0; r < R; ++r) acc[r] += w_lo * x[r * k + g * kGroup + j] + w_hi * x[r * k + g * kGroup + 16 + j];
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = acc[r];
  }
}
#endif

using RowsFn = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, float*, int64_t, int64_t, int64_t);
constexpr RowsFn kRowsFns[kMaxRows] = {q4_rows<1>, q4_rows<2>, q4_rows<3>, q4_rows<4>,
                                       q4_rows<5>, q4_rows<6>, q4_rows<7>, q4_rows<8>};

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x: 2-D float32 CPU");
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte, "qs: 2-D uint8 [N, K/2]");
  const int64_t rows = x.size(0), k = x.size(1), n_out = qs.size(0);
  TORCH_CHECK(k % kGroup == 0 && qs.size(1) * 2 == k, "K must be a multiple of 32 and match qs");
  TORCH_CHECK(scale.sizes() == mins.sizes() && scale.size(0) == n_out && scale.size(1) == k / kGroup,
              "scale and mins: float32 [N, K/32]");
  const at::Tensor xc = x.contiguous(), qc = qs.contiguous(), sc = scale.contiguous(), mc = mins.contiguous();
  at::Tensor y = at::empty({rows, n_out}, x.options());
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t r = std::min(kMaxRows, rows - r0);
    const float* xp = xc.data_ptr<float>() + r0 * k;
    float* yp = y.data_ptr<float>() + r0 * n_out;
    at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
      kRowsFns[r - 1](xp, k, qc.data_ptr<uint8_t>(), sc.data_ptr<float>(), mc.data_ptr<float>(), yp, n_out, begin, end);
    });
  }
  return y;
}


// --- bfloat16 activations ------------------------------------------------------------------

constexpr int64_t kMaxRowsBf16 = 16;  // accumulators one weight pass keeps in registers
using bf16 = c10::BFloat16;

// A weight format: per output row n and group g, the group's 32 dequantized float32 weights.
struct Q4Format {
  const uint8_t* qs;  // [N, K/2]
  const float* scale;
  const float* mins;  // [N, K/32]
  int64_t groups;
  float weight(int64_t n, int64_t g, int j) const {  // scalar reference of the vector paths
    const uint8_t byte = qs[(n * groups + g) * 16 + (j & 15)];
    const float q = static_cast<float>(j < 16 ? byte & 15 : byte >> 4);
    return q * scale[n * groups + g] + mins[n * groups + g];
  }
#if defined(__AVX512F__)
  // weights 0..15 and 16..31 of the group
  std::pair<__m512, __m512> group16(int64_t n, int64_t g) const {
    const __m512i nib = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (n * groups + g) * 16)));
    const __m512 d = _mm512_set1_ps(scale[n * groups + g]), m = _mm512_set1_ps(mins[n * groups + g]);
    const __m512 lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(nib, _mm512_set1_epi32(15))), d), m);
    const __m512 hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(nib, 4)), d), m);
    return {lo, hi};
  }
#elif defined(__AVX2__)
  // weights 8h..8h+7 of the group (h in 0..3)
  __m256 group8(int64_t n, int64_t g, int h) const {
    const uint8_t* q = qs + (n * groups + g) * 16 + (h & 1) * 8;
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    v = h < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
    const __m256 d = _mm256_set1_ps(scale[n * groups + g]), m = _mm256_set1_ps(mins[n * groups + g]);
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), d), m);
  }
#endif
};

struct Q8Format {
  const int8_t* qs;  // [N, K]
  const float* scale;  // [N, K/32]
  int64_t groups;
  float weight(int64_t n, int64_t g, int j) const {
    return static_cast<float>(qs[(n * groups + g) * 32 + j]) * scale[n * groups + g];
  }
#if defined(__AVX512F__)
  std::pair<__m512, __m512> group16(int64_t n, int64_t g) const {
    const int8_t* q = qs + (n * groups + g) * 32;
    const __m512 d = _mm512_set1_ps(scale[n * groups + g]);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), d);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), d);
    return {lo, hi};
  }
#elif defined(__AVX2__)
  __m256 group8(int64_t n, int64_t g, int h) const {
    const int8_t* q = qs + (n * groups + g) * 32 + h * 8;
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(scale[n * groups + g]));
  }
#endif
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
template <class Fmt, int R>
void rows_bf16(const Fmt& f, const bf16* x, int64_t k, bf16* y, int64_t n_out, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < f.groups; ++g) {
      const auto [lo, hi] = f.group16(n, g);
      const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);  // to nearest even: the dense copy's weights
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(x + r * k + g * kGroup);
        acc[r] = _mm512_dpbf16_ps(acc[r], w, reinterpret_cast<const __m512bh&>(xv));
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = bf16(_mm512_reduce_add_ps(acc[r]));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 round_bf16(__m256 v) {  // to nearest even, kept as float32 (finite weights only)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __m256 load_bf16x8(const bf16* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

template <class Fmt, int R>
void rows_bf16(const Fmt& f, const bf16* x, int64_t k, bf16* y, int64_t n_out, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < f.groups; ++g) {
      for (int h = 0; h < 4; ++h) {
        const __m256 w = round_bf16(f.group8(n, g, h));
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, load_bf16x8(x + r * k + g * kGroup + h * 8), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      float sum = 0;
      for (float v : lanes) sum += v;
      y[r * n_out + n] = bf16(sum);
    }
  }
}
#else
template <class Fmt, int R>
void rows_bf16(const Fmt& f, const bf16* x, int64_t k, bf16* y, int64_t n_out, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    float acc[R] = {};
    for (int64_t g = 0; g < f.groups; ++g) {
      for (int j = 0; j < kGroup; ++j) {
        const float w = static_cast<float>(bf16(f.weight(n, g, j)));  // the dense copy's weight
        for (int r = 0; r < R; ++r) acc[r] += w * static_cast<float>(x[r * k + g * kGroup + j]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = bf16(acc[r]);
  }
}
#endif

template <class Fmt>
using RowsBf16Fn = void (*)(const Fmt&, const bf16*, int64_t, bf16*, int64_t, int64_t, int64_t);

template <class Fmt, int... R>
constexpr auto rows_table(std::integer_sequence<int, R...>) {
  return std::array<RowsBf16Fn<Fmt>, sizeof...(R)>{rows_bf16<Fmt, R + 1>...};
}

// Output blocks of 16 rows of W: a block's weights are read from memory once and stay in cache
// while every chunk of kMaxRowsBf16 activation rows passes over them.
template <class Fmt>
at::Tensor linear_bf16(const Fmt& f, const at::Tensor& x, int64_t n_out) {
  static constexpr auto fns = rows_table<Fmt>(std::make_integer_sequence<int, kMaxRowsBf16>{});
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1);
  at::Tensor y = at::empty({rows, n_out}, xc.options());
  const bf16* xp = xc.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += 16) {
      const int64_t n1 = std::min(end, n0 + 16);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRowsBf16) {
        const int64_t r = std::min(kMaxRowsBf16, rows - r0);
        fns[r - 1](f, xp + r0 * k, k, yp + r0 * n_out, n_out, n0, n1);
      }
    }
  });
  return y;
}

void check_groups(const at::Tensor& x, const at::Tensor& scale, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x: 2-D CPU tensor");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n_out && scale.size(1) == k / kGroup,
              "scale: contiguous float32 [N, K/32]");
}

at::Tensor q4_linear_any(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins) {
  if (x.scalar_type() != at::kBFloat16) return q4_linear(x, qs, scale, mins);
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous(), "qs: contiguous uint8 [N, K/2]");
  const int64_t n_out = qs.size(0);
  check_groups(x, scale, n_out);
  TORCH_CHECK(qs.size(1) * 2 == x.size(1), "qs: [N, K/2]");
  TORCH_CHECK(mins.sizes() == scale.sizes() && mins.scalar_type() == at::kFloat && mins.is_contiguous(),
              "mins: contiguous float32 like scale");
  const Q4Format f{qs.data_ptr<uint8_t>(), scale.data_ptr<float>(), mins.data_ptr<float>(), x.size(1) / kGroup};
  return linear_bf16(f, x, n_out);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "q8_linear: x must be bfloat16");
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.is_contiguous(), "qs: contiguous int8 [N, K]");
  const int64_t n_out = qs.size(0);
  check_groups(x, scale, n_out);
  TORCH_CHECK(qs.size(1) == x.size(1), "qs: [N, K]");
  const Q8Format f{qs.data_ptr<int8_t>(), scale.data_ptr<float>(), x.size(1) / kGroup};
  return linear_bf16(f, x, n_out);
}

}  // namespace

TORCH_LIBRARY(kvpool, m) {
  m.def("q4_linear(Tensor x, Tensor qs, Tensor scale, Tensor mins) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qs, Tensor scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvpool, CPU, m) {
  m.impl("q4_linear", q4_linear_any);
  m.impl("q8_linear", q8_linear);
}
