// float32 rows over 4-bit / 8-bit groups in oneDNN's float32 summation order, so that a
// projection gives the same bits whether a step's row count sends it here or to the dense oneDNN
// GEMM (the batch-invariant path, docs/determinism.md). oneDNN's float32 GEMM (brgemm, outputs
// in the vector lanes, one A value broadcast per K) accumulates each output in one fused
// multiply-add chain over a block of K, in order, from zero, and adds the blocks' chains to the
// output in order (found by comparison: AVX2, K block = all of K up to 576, 1024 above). Here
// likewise, 8 outputs a vector: the groups are repacked once into blocks of 64 outputs x K, so
// each K's (Q4_1: pair of K's) weights of a block are one cache line read in K order (Q4_1: a byte
// per output holds K = 2p low and 2p + 1 high; Q8_0: a byte per output and K),
// dequantized in registers to the dense copy's exact float32 weights (a multiply, then an add, as
// the checkpoint's float copy was made) and multiply-added in K order. The K block travels as the
// repacked shape [N/64, K blocks, K block (/ 2 for Q4_1), 64] and the caller checks it against
// oneDNN (models/quantized.py: lanes_groups). Every output is a function of its own row, whatever
// the rows, tiles or threads.
#pragma once

#include "q4_nlanes.h"

#if defined(__AVX2__) && defined(__FMA__)
#define KVPOOL_LANES_F32 1

namespace kvpool_lanes_f32 {

constexpr int64_t kLanes = 8;  // outputs per vector (one ymm of float32 sums)
constexpr int64_t kSpan = 64;  // outputs per repacked block: a K value's (pair's) weights fill a cache line
constexpr int64_t kBlocks = kSpan / kLanes;

// Vector b (of kBlocks) of a span's outputs: Q4_1 [N/64, K pairs, 64] bytes, [N/64, G, 64] floats.
struct Q4 {
  const uint8_t* qs;
  const float* scale;
  const float* mins;
  int64_t groups, stride;  // stride: pairs per span, padding included
  // the 8 outputs' weights at K = 2p (even) and 2p + 1 (odd)
  void pair(int64_t span, int64_t b, int64_t p, __m256& even, __m256& odd) const {
    const uint8_t* q = qs + (span * stride + p) * kSpan + b * kLanes;
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const int64_t at = (span * groups + p / 16) * kSpan + b * kLanes;
    const __m256 d = _mm256_loadu_ps(scale + at), m = _mm256_loadu_ps(mins + at);
    even = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), d), m);
    odd = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d), m);
  }
};

// Q8_0 [N/64, K, 64] levels, [N/64, G, 64] scales.
struct Q8 {
  const int8_t* qs;
  const float* scale;
  int64_t groups, stride;  // stride: K values per span, padding included
  void pair(int64_t span, int64_t b, int64_t p, __m256& even, __m256& odd) const {
    const int8_t* q = qs + (span * stride + 2 * p) * kSpan + b * kLanes;
    const __m256 d = _mm256_loadu_ps(scale + (span * groups + p / 16) * kSpan + b * kLanes);
    even = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))), d);
    odd = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kSpan)))), d);
  }
};

// R rows x B vectors of 8 outputs: per output one chain per K block over its K values, in order;
// the first block's chain is stored, each later one added to the output.
template <class Fmt, int R, int B>
void tile(const Fmt& f, const float* x, int64_t k, int64_t kblock, float* y, int64_t n_out, int64_t span, int64_t b0) {
  __m256 acc[R][B];
  for (int64_t k0 = 0; k0 < k; k0 += kblock) {
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
    const int64_t p1 = std::min(k, k0 + kblock) / 2;
    for (int64_t p = k0 / 2; p < p1; ++p) {
      for (int b = 0; b < B; ++b) {
        __m256 even, odd;
        f.pair(span, b0 + b, p, even, odd);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * k + 2 * p), even, acc[r][b]);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * k + 2 * p + 1), odd, acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) {
        float* out = y + r * n_out + span * kSpan + (b0 + b) * kLanes;
        _mm256_storeu_ps(out, k0 == 0 ? acc[r][b] : _mm256_add_ps(_mm256_loadu_ps(out), acc[r][b]));
      }
  }
}

// R (<= 8) rows over one span, B vectors at a time so a tile keeps 8-12 chains.
template <class Fmt, int R>
void rows(const Fmt& f, const float* x, int64_t k, int64_t kblock, float* y, int64_t n_out, int64_t span) {
  constexpr int B = R == 1 ? 8 : R == 2 ? 4 : R <= 6 ? 2 : 1;
  for (int64_t b = 0; b < kBlocks; b += B) tile<Fmt, R, B>(f, x, k, kblock, y, n_out, span, b);
}

template <class Fmt>
at::Tensor linear(const Fmt& f, const at::Tensor& x, int64_t n_out, int64_t kblock) {
  using Fn = void (*)(const Fmt&, const float*, int64_t, int64_t, float*, int64_t, int64_t);
  static constexpr Fn fns[8] = {rows<Fmt, 1>, rows<Fmt, 2>, rows<Fmt, 3>, rows<Fmt, 4>,
                                rows<Fmt, 5>, rows<Fmt, 6>, rows<Fmt, 7>, rows<Fmt, 8>};
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  at::Tensor y = at::empty({m, n_out}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_out / kSpan, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)  // a span's weights stay in cache for every chunk of rows
      for (int64_t r0 = 0; r0 < m; r0 += 8) {
        const int64_t r = std::min<int64_t>(8, m - r0);
        fns[r - 1](f, xp + r0 * k, k, kblock, yp + r0 * n_out, n_out, s);
      }
  });
  return y;
}

// The K block of x's rows over the repacked [N/64, K blocks, K block (/ per), 64] groups.
inline int64_t k_block(const at::Tensor& x, const at::Tensor& qs, int64_t per, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 32 == 0, what, ": x must be 2-D float32, K a multiple of 32");
  const int64_t kblock = qs.size(2) * per, k = x.size(1);
  TORCH_CHECK(qs.dim() == 4 && qs.size(3) == kSpan && qs.is_contiguous() && (qs.size(1) - 1) * kblock < k &&
                  qs.size(1) * kblock >= k,
              what, ": the repacked groups' K blocks do not cover K = ", k);
  return kblock;
}

inline void check_scale(const at::Tensor& scale, const at::Tensor& qs, int64_t k, const char* what) {
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == qs.size(0) && scale.size(1) == k / 32 && scale.size(2) == kSpan &&
                  scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              what, ": groups from the float32 repack for K = ", k);
}

inline at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins) {
  const int64_t kblock = k_block(x, qs, 2, "q4_linear (float32 lanes)"), k = x.size(1);
  check_scale(scale, qs, k, "q4_linear (float32 lanes)");
  TORCH_CHECK(mins.sizes() == scale.sizes() && mins.is_contiguous() && mins.scalar_type() == at::kFloat,
              "q4_linear (float32 lanes): mins like scale");
  return linear(Q4{qs.data_ptr<uint8_t>(), scale.data_ptr<float>(), mins.data_ptr<float>(), k / 32,
                   qs.size(1) * qs.size(2)}, x, qs.size(0) * kSpan, kblock);
}

inline at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  const int64_t kblock = k_block(x, qs, 1, "q8_linear (float32 lanes)"), k = x.size(1);
  check_scale(scale, qs, k, "q8_linear (float32 lanes)");
  return linear(Q8{qs.data_ptr<int8_t>(), scale.data_ptr<float>(), k / 32, qs.size(1) * qs.size(2)}, x,
                qs.size(0) * kSpan, kblock);
}

}  // namespace kvpool_lanes_f32

#endif
