// y = x @ W^T for W stored as groups of 32 weights along K: GGUF's Q4_1 (w = d * q + m, q in
// 0..15) and Q8_0 (w = d * q, q in -127..127).
// float32: weights are dequantized in registers exactly as the checkpoint's float copy was
// made (a multiply, then an add: no fused multiply-add), so the result differs from a dense
// fp32 matmul by summation order only, while reading 8x fewer weight bytes per decode step.
// bfloat16: each dequantized float32 weight is then rounded to bfloat16 (to nearest even, as
// `Tensor.to(torch.bfloat16)` made the dense bf16 copy), so the kernel multiplies by the dense
// copy's weights bit for bit; products accumulate in float32 and the output is rounded to
// bfloat16 once, as oneDNN's bf16 GEMM does. AVX-512 (AVX512-BF16 dot products under bf16)
// where the CPU has it, AVX2 + FMA or scalar loops elsewhere; for mid-size bf16 batches, AMX tiles (q4_linear_amx,
// q8_linear_amx: the same weights, see below) where the CPU has them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "q4_lanes_f32.h"  // includes q4_nlanes.h
#include "amx.h"  // defines KVPOOL_AMX where the build has the tile instructions

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;  // activation rows one weight pass serves

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

void check_groups(const at::Tensor& x, const at::Tensor& scale, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x: 2-D CPU tensor");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n_out && scale.size(1) == k / kGroup,
              "scale: contiguous float32 [N, K/32]");
}

Q4Format q4_format(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous(), "qs: contiguous uint8 [N, K/2]");
  check_groups(x, scale, qs.size(0));
  TORCH_CHECK(qs.size(1) * 2 == x.size(1), "qs: [N, K/2]");
  TORCH_CHECK(mins.sizes() == scale.sizes() && mins.scalar_type() == at::kFloat && mins.is_contiguous(),
              "mins: contiguous float32 like scale");
  return {qs.data_ptr<uint8_t>(), scale.data_ptr<float>(), mins.data_ptr<float>(), x.size(1) / kGroup};
}

Q8Format q8_format(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.is_contiguous(), "qs: contiguous int8 [N, K]");
  check_groups(x, scale, qs.size(0));
  TORCH_CHECK(qs.size(1) == x.size(1), "qs: [N, K]");
  return {qs.data_ptr<int8_t>(), scale.data_ptr<float>(), x.size(1) / kGroup};
}



// float32 activations over a weight format (Q4_1 projections, the Q8_0 head), chunks of kMaxRows rows.
#if defined(__AVX512F__)
template <class Fmt, int R>
void rows_f32(const Fmt& f, const float* x, int64_t k, float* y, int64_t n_out, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m512 acc_lo[R], acc_hi[R];
    for (int r = 0; r < R; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < f.groups; ++g) {
      const auto [lo, hi] = f.group16(n, g);
      for (int r = 0; r < R; ++r) {
        acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * k + g * kGroup), acc_lo[r]);
        acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * k + g * kGroup + 16), acc_hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// Rows below 4 keep two accumulators each so the FMA chains overlap; up to 8 rows fit one each.
template <class Fmt, int R>
void rows_f32(const Fmt& f, const float* x, int64_t k, float* y, int64_t n_out, int64_t n_begin, int64_t n_end) {
  constexpr int A = R < 4 ? 2 : 1;
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t g = 0; g < f.groups; ++g)
      for (int h = 0; h < 4; ++h) {
        const __m256 w = f.group8(n, g, h);
        for (int r = 0; r < R; ++r)
          acc[r][h % A] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * k + g * kGroup + 8 * h), acc[r][h % A]);
      }
    for (int r = 0; r < R; ++r) {
      __m256 v = acc[r][0];
      if constexpr (A == 2) v = _mm256_add_ps(v, acc[r][1]);
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      y[r * n_out + n] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
  }
}
#else
template <class Fmt, int R>
void rows_f32(const Fmt& f, const float* x, int64_t k, float* y, int64_t n_out, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    float acc[R] = {};
    for (int64_t g = 0; g < f.groups; ++g)
      for (int j = 0; j < kGroup; ++j)
        for (int r = 0; r < R; ++r) acc[r] += f.weight(n, g, j) * x[r * k + g * kGroup + j];
    for (int r = 0; r < R; ++r) y[r * n_out + n] = acc[r];
  }
}
#endif

// The row loops by row count, for the activations' type T: rows_table<Fmt, T>(...)[r - 1] takes r rows.
template <class Fmt, class T>
using RowsFn = void (*)(const Fmt&, const T*, int64_t, T*, int64_t, int64_t, int64_t);

template <class Fmt, class T, int R>
constexpr RowsFn<Fmt, T> rows_fn() {
  if constexpr (std::is_same_v<T, float>)
    return rows_f32<Fmt, R>;
  else
    return rows_bf16<Fmt, R>;
}

template <class Fmt, class T, int... R>
constexpr auto rows_table(std::integer_sequence<int, R...>) {
  return std::array<RowsFn<Fmt, T>, sizeof...(R)>{rows_fn<Fmt, T, R + 1>()...};
}

// Output blocks of 16 rows of W: a block's weights are read from memory once and stay in cache
// while every chunk of kMaxRowsBf16 activation rows passes over them.
template <class Fmt>
at::Tensor linear_bf16(const Fmt& f, const at::Tensor& x, int64_t n_out) {
  static constexpr auto fns = rows_table<Fmt, bf16>(std::make_integer_sequence<int, kMaxRowsBf16>{});
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

// Chunks of kMaxRows activation rows, each one pass over the weights split across threads.
template <class Fmt>
at::Tensor linear_f32(const Fmt& f, const at::Tensor& x, int64_t n_out) {
  static constexpr auto fns = rows_table<Fmt, float>(std::make_integer_sequence<int, kMaxRows>{});
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1);
  at::Tensor y = at::empty({rows, n_out}, xc.options());
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t r = std::min(kMaxRows, rows - r0);
    at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
      fns[r - 1](f, xc.data_ptr<float>() + r0 * k, k, y.data_ptr<float>() + r0 * n_out, n_out, begin, end);
    });
  }
  return y;
}

// The lanes layouts (q4_nlanes.h, q4_lanes_f32.h): rows in oneDNN's own summation order, by the
// activations' dtype, where this build has the kernel.
at::Tensor lanes_q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins) {
#ifdef KVPOOL_LANES_F32
  if (x.scalar_type() == at::kFloat) return kvpool_lanes_f32::q4_linear(x, qs, scale, mins);
#endif
#ifdef KVPOOL_NLANES
  if (x.scalar_type() == at::kBFloat16) return kvpool_nlanes::q4_linear(x, qs, scale, mins);
#endif
  TORCH_CHECK(false, "q4_linear: no lanes kernel for ", x.scalar_type(), " rows in this build");
}

at::Tensor lanes_q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
#ifdef KVPOOL_LANES_F32
  if (x.scalar_type() == at::kFloat) return kvpool_lanes_f32::q8_linear(x, qs, scale);
#endif
#ifdef KVPOOL_NLANES
  if (x.scalar_type() == at::kBFloat16) return kvpool_nlanes::q8_linear(x, qs, scale);
#endif
  TORCH_CHECK(false, "q8_linear: no lanes kernel for ", x.scalar_type(), " rows in this build");
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins) {
  if (qs.dim() == 4) return lanes_q4_linear(x, qs, scale, mins);  // groups from q4_repack
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "q4_linear: x must be float32 or bfloat16");
  if (x.scalar_type() == at::kFloat) return linear_f32(q4_format(x, qs, scale, mins), x, qs.size(0));
  return linear_bf16(q4_format(x, qs, scale, mins), x, qs.size(0));
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  if (qs.dim() == 4) return lanes_q8_linear(x, qs, scale);  // groups from q8_repack
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "q8_linear: x must be float32 or bfloat16");
  if (x.scalar_type() == at::kFloat) return linear_f32(q8_format(x, qs, scale), x, qs.size(0));
  return linear_bf16(q8_format(x, qs, scale), x, qs.size(0));
}


// --- bfloat16 activations on AMX tiles -------------------------------------------------------
// Mid-size batches (a decode step of ~4-32 rows): the vdpbf16ps loops above pay a dot product
// per 32 weights per row, so they are compute-bound there, while the dense AMX GEMM streams
// 2.7x more weight bytes. Here each block of 16 output rows of W is dequantized once (the same
// bf16 weights, bit for bit) into a scratch strip, the activations pass over it, and tile C
// accumulates W_block . x^T in float32 in K order, rounded to bf16 once. Dense bf16 weights
// (batch-invariant bf16 on AMX, any row count) take the same products in the same order from
// a copy packed at load. Each output's chain is the same whatever the rows (docs/determinism.md).

#ifdef KVPOOL_AMX
using kvpool_amx::kTileRows;
using kvpool_amx::load_tile_config;
const std::string& amx_unavailable_reason() { return kvpool_amx::unavailable_reason(); }

// float32 -> bf16, to nearest even as c10::BFloat16(float) rounds (NaN -> 0x7fc0)
inline __m256i round_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// Two output rows' Q4_1 group (groups i0, i1) as bf16 words: a group's 16 possible weights
// d * q + m (multiply, then add, as in group16) are rounded to bf16 once, both rows' tables in
// one vector, and the nibbles pick them (vpermw).
struct Q4Dequant {
  const Q4Format& f;
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                         0x0004000400040004, 0, 0, 0, 0);  // words 16-31: high nibbles
  const __m512i low4 = _mm512_set1_epi16(15), second = _mm512_set1_epi16(16);

  __m512i nibbles(int64_t i) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f.qs + i * 16));
    return _mm512_srlv_epi16(_mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bytes)), shift);
  }
  std::pair<__m512i, __m512i> two_rows(int64_t i0, int64_t i1) const {
    const __m512 t0 = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(f.scale[i0])), _mm512_set1_ps(f.mins[i0]));
    const __m512 t1 = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(f.scale[i1])), _mm512_set1_ps(f.mins[i1]));
    const __m512bh tables = _mm512_cvtne2ps_pbh(t1, t0);  // words 0-15: row i0's, 16-31: row i1's
    const __m512i table = reinterpret_cast<const __m512i&>(tables);
    const __m512i pick1 = _mm512_ternarylogic_epi32(nibbles(i1), low4, second, 0xEA);  // (q & 15) | 16
    return {_mm512_permutexvar_epi16(_mm512_and_si512(nibbles(i0), low4), table), _mm512_permutexvar_epi16(pick1, table)};
  }
};

// --- 4-bit / 8-bit groups (decode-sized batches): W as the A tiles -------------------------
// The strip holds 16 outputs' bf16 rows as A tiles (no transpose to make it: a decode step makes
// every strip of the model and uses it for a few rows), the activations are packed into VNNI B
// tiles, and the C tile [outputs][rows] is written out by column.
constexpr int64_t kPassBlocks = 4;  // C tiles 0-3: 64 activation rows per pass over a strip

// Activations [M, K] -> B tiles [K/32][ceil(M/16)][16 pairs of K][16 rows], zero past M.
at::Tensor pack_activations(const at::Tensor& x) {
  const int64_t rows = x.size(0), pairs = x.size(1) / 2, blocks = (rows + kTileRows - 1) / kTileRows;
  at::Tensor packed = at::zeros({pairs / kTileRows, blocks, kTileRows, kTileRows}, x.options().dtype(at::kInt));
  const auto* src = reinterpret_cast<const uint32_t*>(x.data_ptr<bf16>());
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  for (int64_t m = 0; m < rows; ++m) {
    uint32_t* out = dst + (m / kTileRows) * kTileRows * kTileRows + m % kTileRows;
    for (int64_t p = 0; p < pairs; ++p)
      out[(p / kTileRows) * blocks * kTileRows * kTileRows + (p % kTileRows) * kTileRows] = src[m * pairs + p];
  }
  return packed;
}

// Output rows n0.. n0 + 15 of W as the strip's bf16 rows (row stride k), rows past `outputs`
// zero; row by row, so each row's groups are read as one stream.
void make_row_strip(const Q4Format& f, int64_t n0, int64_t outputs, bf16* strip, int64_t k) {
  const Q4Dequant dq{f};
  for (int64_t r = 0; r < kTileRows; r += 2) {
    bf16* dst = strip + r * k;
    if (r >= outputs) {
      std::memset(dst, 0, 2 * k * sizeof(bf16));
      continue;
    }
    const bool pair = r + 1 < outputs;
    const int64_t row0 = (n0 + r) * f.groups, row1 = (n0 + r + pair) * f.groups;  // no pair: row r twice
    for (int64_t g = 0; g < f.groups; ++g) {
      const auto [w0, w1] = dq.two_rows(row0 + g, row1 + g);
      _mm512_storeu_si512(dst + g * kGroup, w0);
      _mm512_storeu_si512(dst + k + g * kGroup, w1);
    }
    if (!pair) std::memset(dst + k, 0, k * sizeof(bf16));
  }
}

void make_row_strip(const Q8Format& f, int64_t n0, int64_t outputs, bf16* strip, int64_t k) {
  for (int64_t r = 0; r < kTileRows; ++r) {
    bf16* dst = strip + r * k;
    if (r >= outputs) {
      std::memset(dst, 0, k * sizeof(bf16));
      continue;
    }
    for (int64_t g = 0; g < f.groups; ++g) {
      const auto [lo, hi] = f.group16(n0 + r, g);
      const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);  // to nearest even, as in rows_bf16
      _mm512_storeu_si512(dst + g * kGroup, reinterpret_cast<const __m512i&>(w));
    }
  }
}

// One pass over a strip: C tiles 0..B-1 = strip . (B tiles of the pass), over every group of
// K (A tile 4, B tiles 5 6 7, 5 again for a fourth row block; the intrinsics take literal
// tile numbers).
template <int B>
void row_tile_pass(const bf16* strip, int64_t k, const int32_t* xg, int64_t group_stride) {
  _tile_zero(0);
  if constexpr (B > 1) _tile_zero(1);
  if constexpr (B > 2) _tile_zero(2);
  if constexpr (B > 3) _tile_zero(3);
  constexpr int64_t tile = kTileRows * kTileRows;
  for (int64_t g = 0; g < k / kGroup; ++g, xg += group_stride) {
    _tile_loadd(4, strip + g * kGroup, k * sizeof(bf16));
    _tile_loadd(5, xg, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (B > 1) { _tile_loadd(6, xg + tile, 64); _tile_dpbf16ps(1, 4, 6); }
    if constexpr (B > 2) { _tile_loadd(7, xg + 2 * tile, 64); _tile_dpbf16ps(2, 4, 7); }
    if constexpr (B > 3) { _tile_loadd(5, xg + 3 * tile, 64); _tile_dpbf16ps(3, 4, 5); }
  }
}

// C tile [16 outputs][16 rows] -> y[row][n0 + output] for the rows and outputs that exist.
void store_transposed(const float* c, bf16* y, int64_t n_out, int64_t rows, int64_t outputs) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kTileRows));
  const __mmask16 valid = static_cast<__mmask16>((1u << outputs) - 1);
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, column, c + m, 4);
    _mm256_mask_storeu_epi16(y + m * n_out, valid, round_to_bf16(v));
  }
}

template <class Fmt>
at::Tensor linear_amx(const Fmt& f, const at::Tensor& x, int64_t n_out) {
  TORCH_CHECK(amx_unavailable_reason().empty(), "AMX kernel unavailable: ", amx_unavailable_reason());
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), blocks = (rows + kTileRows - 1) / kTileRows;
  at::Tensor y = at::empty({rows, n_out}, xc.options());
  if (rows == 0 || n_out == 0) return y;
  const at::Tensor packed = pack_activations(xc);
  const int32_t* xp = packed.data_ptr<int32_t>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t group_stride = blocks * kTileRows * kTileRows;
  const auto outputs_of = [&](int64_t nb) { return std::min(kTileRows, n_out - nb * kTileRows); };
  at::parallel_for(0, (n_out + kTileRows - 1) / kTileRows, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    thread_local std::vector<bf16> strips;  // two strips: one in the tile unit while the next is made
    strips.resize(2 * kTileRows * k);
    alignas(64) float c[kPassBlocks][kTileRows * kTileRows];
    make_row_strip(f, begin * kTileRows, outputs_of(begin), strips.data(), k);
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kTileRows, outputs = outputs_of(nb);
      const bf16* strip = strips.data() + ((nb - begin) & 1) * kTileRows * k;
      bf16* next = strips.data() + ((nb - begin + 1) & 1) * kTileRows * k;
      for (int64_t b0 = 0; b0 < blocks; b0 += kPassBlocks) {
        const int64_t pass = std::min(kPassBlocks, blocks - b0);
        const int32_t* xg = xp + b0 * kTileRows * kTileRows;
        switch (pass) {
          case 1: row_tile_pass<1>(strip, k, xg, group_stride); break;
          case 2: row_tile_pass<2>(strip, k, xg, group_stride); break;
          case 3: row_tile_pass<3>(strip, k, xg, group_stride); break;
          default: row_tile_pass<4>(strip, k, xg, group_stride); break;
        }
        if (b0 == 0 && nb + 1 < end) make_row_strip(f, n0 + kTileRows, outputs_of(nb + 1), next, k);
        _tile_stored(0, c[0], 64);
        if (pass > 1) _tile_stored(1, c[1], 64);
        if (pass > 2) _tile_stored(2, c[2], 64);
        if (pass > 3) _tile_stored(3, c[3], 64);
        for (int64_t b = 0; b < pass; ++b) {
          const int64_t m0 = (b0 + b) * kTileRows;
          store_transposed(c[b], yp + m0 * n_out + n0, n_out, std::min(kTileRows, rows - m0), outputs);
        }
      }
    }
    _tile_release();
  });
  return y;
}

#include "amx_linear_tiles.h"  // the activations as A tiles: dense strips, repacked groups
#else
struct PackedStrips {
  const bf16* strips;
};
const std::string& amx_unavailable_reason() {
  static const std::string reason = "the kernel was built without AMX-TILE/AMX-BF16 (-march=native on this CPU)";
  return reason;
}

struct Q4Group {
  const uint8_t* q;
  const float* scale;
  const float* mins;
  static constexpr int64_t kBytes = 256;
};
struct Q8Group {
  const int8_t* q;
  const float* scale;
  static constexpr int64_t kBytes = 512;
};

template <class StripAt>
at::Tensor linear_amx_vnni(const at::Tensor&, const StripAt&, int64_t) {
  TORCH_CHECK(false, "AMX kernel unavailable: ", amx_unavailable_reason());
}

template <class Fmt>
at::Tensor linear_amx(const Fmt&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "AMX kernel unavailable: ", amx_unavailable_reason());
}
at::Tensor linear_amx_packed(const PackedStrips&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "AMX kernel unavailable: ", amx_unavailable_reason());
}
#endif

std::string amx_unavailable() { return amx_unavailable_reason(); }

// The lanes layouts: bf16 rows (16 outputs a block, pairs of K) or float32 rows (64 outputs, single
// K values), K blocks of `kblock`.
bool lanes_available(bool float32) {
#ifdef KVPOOL_LANES_F32
  if (float32) return true;
#endif
#ifdef KVPOOL_NLANES
  if (!float32) return true;
#endif
  return false;
}
void check_lanes(bool float32, const char* what) {
  TORCH_CHECK(lanes_available(float32), what, ": the kernel was built without the ",
              float32 ? "AVX2 + FMA" : "AVX512-BF16", " lanes kernels");
}
std::vector<at::Tensor> q4_repack(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins, int64_t kblock,
                                  bool float32) {
  check_lanes(float32, "q4_repack");
  return kvpool_nlanes::q4_repack(qs.contiguous(), scale.contiguous(), mins.contiguous(), kblock, float32 ? 64 : 16);
}
std::vector<at::Tensor> q8_repack(const at::Tensor& qs, const at::Tensor& scale, int64_t kblock, bool float32) {
  check_lanes(float32, "q8_repack");
  return kvpool_nlanes::q8_repack(qs.contiguous(), scale.contiguous(), kblock, float32 ? 64 : 16, float32 ? 1 : 2);
}

at::Tensor q4_linear_amx(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "q4_linear_amx: x must be bfloat16");
  const Q4Format f = q4_format(x, qs, scale, mins);
  return linear_amx(f, x, qs.size(0));
}

// y = x . W^T for dense bf16 W packed as strips (linear.py: TileLinear.pack), n_out outputs.
at::Tensor bf16_linear_amx(const at::Tensor& x, const at::Tensor& strips, int64_t n_out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && strips.scalar_type() == at::kBFloat16,
              "bf16_linear_amx: x and the strips must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && strips.dim() == 5 && strips.is_contiguous() && strips.size(1) * 32 == x.size(1) &&
                  strips.size(0) * 16 >= n_out && strips.size(0) % 2 == 0,
              "bf16_linear_amx: strips must be [N/16 (even), K/32, 16, 16, 2] for x [M, K]");
  return linear_amx_packed(PackedStrips{reinterpret_cast<const bf16*>(strips.data_ptr<at::BFloat16>())}, x, n_out);
}

// The repacked groups' shapes for x [M, K] (quantized.py: q4_vnni_repack, q8_vnni_repack): vq
// [N/16, K/32, 16, row_bytes] of `levels`, each per-output tensor [N/16, K/32, 16] float32.
// Returns K/32.
int64_t check_vnni(const char* op, const at::Tensor& x, const at::Tensor& vq, at::ScalarType levels,
                   int64_t row_bytes, std::initializer_list<const at::Tensor*> per_output) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % kGroup == 0, op,
              ": x must be bfloat16 [M, K], K a multiple of 32");
  const int64_t groups = x.size(1) / kGroup;
  TORCH_CHECK(vq.scalar_type() == levels && vq.is_contiguous() && vq.dim() == 4 && vq.size(1) == groups &&
                  vq.size(2) == 16 && vq.size(3) == row_bytes,
              op, ": vq must be contiguous ", levels, " [N/16, K/32, 16, ", row_bytes, "]");
  for (const at::Tensor* t : per_output)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == vq.size(0) &&
                    t->size(1) == groups && t->size(2) == 16,
                op, ": scales (and mins) must be contiguous float32 [N/16, K/32, 16]");
  return groups;
}

// y = x . W^T for Q4_1 groups repacked in the B tiles' order: vq uint8 (two levels a byte),
// vs and vm the scales and mins.
at::Tensor q4_vnni_linear_amx(const at::Tensor& x, const at::Tensor& vq, const at::Tensor& vs, const at::Tensor& vm) {
  const int64_t groups = check_vnni("q4_vnni_linear_amx", x, vq, at::kByte, 16, {&vs, &vm});
  const uint8_t* q = vq.data_ptr<uint8_t>();
  const float *scale = vs.data_ptr<float>(), *mins = vm.data_ptr<float>();
  return linear_amx_vnni(x, [&](int64_t s) {
    const int64_t at = s * groups;
    return Q4Group{q + at * Q4Group::kBytes, scale + at * 16, mins + at * 16};
  }, vq.size(0) * 16);
}

// The same for Q8_0 groups: vq int8, vs the scales.
at::Tensor q8_vnni_linear_amx(const at::Tensor& x, const at::Tensor& vq, const at::Tensor& vs) {
  const int64_t groups = check_vnni("q8_vnni_linear_amx", x, vq, at::kChar, 32, {&vs});
  const int8_t* q = vq.data_ptr<int8_t>();
  const float* scale = vs.data_ptr<float>();
  return linear_amx_vnni(x, [&](int64_t s) {
    const int64_t at = s * groups;
    return Q8Group{q + at * Q8Group::kBytes, scale + at * 16};
  }, vq.size(0) * 16);
}

at::Tensor q8_linear_amx(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "q8_linear_amx: x must be bfloat16");
  const Q8Format f = q8_format(x, qs, scale);
  return linear_amx(f, x, qs.size(0));
}

}  // namespace

TORCH_LIBRARY(kvpool, m) {
  m.def("q4_linear(Tensor x, Tensor qs, Tensor scale, Tensor mins) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qs, Tensor scale) -> Tensor");
  m.def("q4_linear_amx(Tensor x, Tensor qs, Tensor scale, Tensor mins) -> Tensor");
  m.def("q8_linear_amx(Tensor x, Tensor qs, Tensor scale) -> Tensor");
  m.def("bf16_linear_amx(Tensor x, Tensor strips, int n_out) -> Tensor");
  m.def("q4_vnni_linear_amx(Tensor x, Tensor vq, Tensor vs, Tensor vm) -> Tensor");
  m.def("q8_vnni_linear_amx(Tensor x, Tensor vq, Tensor vs) -> Tensor");
  m.def("amx_unavailable() -> str", amx_unavailable);
  m.def("lanes_available(bool float32=False) -> bool", lanes_available);
  m.def("q4_repack(Tensor qs, Tensor scale, Tensor mins, int kblock, bool float32=False) -> Tensor[]");
  m.def("q8_repack(Tensor qs, Tensor scale, int kblock, bool float32=False) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(kvpool, CPU, m) {
  m.impl("q4_linear", q4_linear);
  m.impl("q8_linear", q8_linear);
  m.impl("q4_linear_amx", q4_linear_amx);
  m.impl("q8_linear_amx", q8_linear_amx);
  m.impl("bf16_linear_amx", bf16_linear_amx);
  m.impl("q4_vnni_linear_amx", q4_vnni_linear_amx);
  m.impl("q8_vnni_linear_amx", q8_vnni_linear_amx);
  m.impl("q4_repack", q4_repack);
  m.impl("q8_repack", q8_repack);
}
