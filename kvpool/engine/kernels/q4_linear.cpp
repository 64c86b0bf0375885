// y = x @ W^T for W stored as 4-bit affine groups of 32 along K (GGUF's Q4_1): w = d * q + m.
// Weights are dequantized in registers exactly as the checkpoint's float copy was made
// (a multiply, then an add: no fused multiply-add), so the result differs from a dense fp32
// matmul by summation order only, while reading 8x fewer weight bytes per decode step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __AVX512F__
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

}  // namespace

TORCH_LIBRARY(kvpool, m) { m.def("q4_linear(Tensor x, Tensor qs, Tensor scale, Tensor mins) -> Tensor"); }
TORCH_LIBRARY_IMPL(kvpool, CPU, m) { m.impl("q4_linear", q4_linear); }
