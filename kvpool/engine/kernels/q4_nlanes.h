// bf16 rows over 4-bit / 8-bit groups in oneDNN's own summation order, so that a projection gives
// the same bits whether a step's row count sends it here or to the dense oneDNN GEMM (the
// batch-invariant path, docs/determinism.md). oneDNN's AVX512-BF16 GEMM keeps the outputs in
// the lanes and accumulates each output in float32 chains over blocks of K (its K block, chosen
// by shape: all of K, or 512 for some), two K values per vdpbf16ps, pairs in order, each chain
// from zero, the chains summed in order, rounded to bf16 once. Here likewise: the groups are
// repacked once into blocks of 16 outputs x (pairs of K), dequantized in registers to the dense
// copy's bf16 weights (a multiply, then an add, rounded to nearest even) and fed to the same
// instruction in the same order; the K block travels as the repacked shape [N/16, K blocks,
// K block / 2, lanes] and the caller checks it against oneDNN (models/quantized.py). Every output
// is a function of its own row, whatever the rows, tiles or threads. The repacking is shared with
// the float32 lanes kernels (q4_lanes_f32.h), which take 8 outputs a block.
#pragma once

namespace kvpool_nlanes {

// The repacked layouts, shared with the float32 lanes kernels (q4_lanes_f32.h): blocks of
// `lanes` outputs, K in blocks of `kblock` (the last padded with zeros).
inline int64_t blocks_of(int64_t k, int64_t kblock, const char* what) {
  TORCH_CHECK(kblock > 0 && kblock % 2 == 0, what, ": the K block must be even and positive");
  return (k + kblock - 1) / kblock;
}

// Q4_1 [N, K/2] nibbles (GGUF order: byte j of a group = q[j] | q[j + 16] << 4), [N, K/32] scale
// and mins -> [N/lanes, K blocks, K block / 2, lanes] bytes (q[n][2p] | q[n][2p + 1] << 4) and
// [N/lanes, K/32, lanes] floats.
inline std::vector<at::Tensor> q4_repack(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins,
                                         int64_t kblock, int64_t lanes) {
  const int64_t n = qs.size(0), k = qs.size(1) * 2, groups = k / 32;
  TORCH_CHECK(lanes > 0 && n % lanes == 0 && k % 32 == 0, "q4_repack: N must be a multiple of ", lanes, " and K of 32");
  const int64_t kb = blocks_of(k, kblock, "q4_repack"), stride = kb * kblock / 2;
  at::Tensor out = at::zeros({n / lanes, kb, kblock / 2, lanes}, qs.options());
  const uint8_t* src = qs.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const auto level = [&](int64_t row, int64_t kk) {
    const uint8_t byte = src[row * (k / 2) + (kk / 32) * 16 + (kk % 16)];
    return (kk % 32) < 16 ? byte & 15 : byte >> 4;
  };
  for (int64_t row = 0; row < n; ++row)
    for (int64_t p = 0; p < k / 2; ++p)
      dst[((row / lanes) * stride + p) * lanes + row % lanes] =
          static_cast<uint8_t>(level(row, 2 * p) | (level(row, 2 * p + 1) << 4));
  const auto per_lane = [&](const at::Tensor& t) {  // [N, G] -> [N/lanes, G, lanes]
    return t.view({n / lanes, lanes, groups}).transpose(1, 2).contiguous();
  };
  return {out, per_lane(scale), per_lane(mins)};
}

// Q8_0 [N, K] levels, [N, K/32] scale -> [N/lanes, K blocks, K block / per, per * lanes] (runs of
// `per` K values of each output: pairs for vdpbf16ps, single values for float32) and
// [N/lanes, K/32, lanes].
inline std::vector<at::Tensor> q8_repack(const at::Tensor& qs, const at::Tensor& scale, int64_t kblock, int64_t lanes,
                                         int64_t per) {
  const int64_t n = qs.size(0), k = qs.size(1), groups = k / 32;
  TORCH_CHECK(lanes > 0 && n % lanes == 0 && k % 32 == 0, "q8_repack: N must be a multiple of ", lanes, " and K of 32");
  const int64_t kb = blocks_of(k, kblock, "q8_repack");
  at::Tensor runs = qs.view({n / lanes, lanes, k / per, per}).permute({0, 2, 1, 3}).reshape({n / lanes, k / per, per * lanes});
  at::Tensor out = at::zeros({n / lanes, kb * kblock / per, per * lanes}, qs.options());
  out.narrow(1, 0, k / per).copy_(runs);
  out = out.view({n / lanes, kb, kblock / per, per * lanes});
  return {out, scale.view({n / lanes, lanes, groups}).transpose(1, 2).contiguous()};
}

}  // namespace kvpool_nlanes

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVPOOL_NLANES 1

namespace kvpool_nlanes {

constexpr int64_t kLanes = 16;  // outputs per block (one zmm of float32 sums)

// The 16 outputs' bf16 weights of pair p as 32-bit lanes (even K low, odd K high), from float32
// values even[n] = w[n][2p], odd[n] = w[n][2p + 1].
inline __m512i pack_pairs(__m512 even, __m512 odd) {
  const __m512bh both = _mm512_cvtne2ps_pbh(odd, even);  // words 0-15: even, 16-31: odd; nearest even
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, reinterpret_cast<const __m512i&>(both));
}

struct Q4Lanes {
  const uint8_t* qs;  // [N/16, K/2, 16]
  const float* scale;
  const float* mins;  // [N/16, G, 16]
  int64_t pairs, groups, stride, kblock_pairs;  // stride: pairs per block of outputs, padding included
  __m512i weights(int64_t block, int64_t p) const {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (block * stride + p) * kLanes)));
    const int64_t at = (block * groups + p / 16) * kLanes;
    const __m512 d = _mm512_loadu_ps(scale + at), m = _mm512_loadu_ps(mins + at);
    const __m512 even = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), d), m);
    const __m512 odd = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d), m);
    return pack_pairs(even, odd);
  }
};

struct Q8Lanes {
  const int8_t* qs;  // [N/16, K/2, 32]
  const float* scale;  // [N/16, G, 16]
  int64_t pairs, groups, stride, kblock_pairs;
  __m512i weights(int64_t block, int64_t p) const {
    const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (block * stride + p) * 2 * kLanes)));
    const __m512 d = _mm512_loadu_ps(scale + (block * groups + p / 16) * kLanes);
    // 32-bit lane n holds (q[n][2p], q[n][2p + 1]) as two int16: sign-extend each half
    const __m512 even = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(q, 16), 16)), d);
    const __m512 odd = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(q, 16)), d);
    return pack_pairs(even, odd);
  }
};

// R rows x B blocks of 16 outputs from block0: per output one chain per K block over its pairs,
// in order, each from zero, added in order to its running total (kept in `total`, R x B x 16
// floats: the registers hold the chains), rounded to bf16 once.
template <class Fmt, int R, int B>
void tile(const Fmt& f, const int32_t* xp, int64_t k, c10::BFloat16* y, int64_t n_out, int64_t block0, float* total) {
  __m512 acc[R][B];
  for (int64_t p0 = 0; p0 < f.pairs; p0 += f.kblock_pairs) {
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
    const int64_t p1 = std::min(f.pairs, p0 + f.kblock_pairs);
    for (int64_t p = p0; p < p1; ++p) {
      __m512i w[B];
      for (int b = 0; b < B; ++b) w[b] = f.weights(block0 + b, p);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(xp[r * (k / 2) + p]);
        for (int b = 0; b < B; ++b)
          acc[r][b] = _mm512_dpbf16_ps(acc[r][b], reinterpret_cast<const __m512bh&>(w[b]), reinterpret_cast<const __m512bh&>(xv));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) {
        float* t = total + (r * B + b) * kLanes;
        const __m512 before = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(t);
        _mm512_storeu_ps(t, _mm512_add_ps(before, acc[r][b]));
      }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_loadu_ps(total + (r * B + b) * kLanes));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n_out + (block0 + b) * kLanes), reinterpret_cast<const __m256i&>(out));
    }
}

// Rows in chunks of up to 8; per chunk, 4 / 2 / 1 blocks per tile so every tile has >= 8 chains.
template <class Fmt, int R>
void rows(const Fmt& f, const c10::BFloat16* x, int64_t k, c10::BFloat16* y, int64_t n_out, int64_t b0, int64_t b1) {
  constexpr int B = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  alignas(64) float total[R * B * kLanes];
  const auto* xp = reinterpret_cast<const int32_t*>(x);
  int64_t b = b0;
  for (; b + B <= b1; b += B) tile<Fmt, R, B>(f, xp, k, y, n_out, b, total);
  for (; b < b1; ++b) tile<Fmt, R, 1>(f, xp, k, y, n_out, b, total);
}

// Many rows: the weights of a panel of up to kPanelBlocks blocks are dequantized once into a
// buffer (the same `weights` values, so the same bf16 pairs) and every row chunk reads them from
// there, where `rows` dequantizes them again for every 8 rows. The same `tile`, so the same
// chains in the same order and the same bits, 6 x 4 chains a tile here against 8 there.
constexpr int kPanelBlocks = 4, kPanelRows = 6;

struct Panel {  // a panel's dequantized pairs: w[block - block0][p], 16 lanes of (even, odd) bf16
  const __m512i* w;
  int64_t block0, pairs, kblock_pairs;
  __m512i weights(int64_t block, int64_t p) const { return _mm512_load_si512(w + (block - block0) * pairs + p); }
};

template <int B>
void panel_rows(const Panel& f, const int32_t* xp, int64_t m, int64_t k, c10::BFloat16* y, int64_t n_out) {
  using Fn = void (*)(const Panel&, const int32_t*, int64_t, c10::BFloat16*, int64_t, int64_t, float*);
  static constexpr Fn fns[kPanelRows] = {tile<Panel, 1, B>, tile<Panel, 2, B>, tile<Panel, 3, B>,
                                         tile<Panel, 4, B>, tile<Panel, 5, B>, tile<Panel, 6, B>};
  alignas(64) float total[kPanelRows * B * kLanes];
  for (int64_t r0 = 0; r0 < m; r0 += kPanelRows) {
    const int64_t r = std::min<int64_t>(kPanelRows, m - r0);
    fns[r - 1](f, xp + r0 * (k / 2), k, y + r0 * n_out, n_out, f.block0, total);
  }
}

template <class Fmt>
void panels(const Fmt& f, const c10::BFloat16* x, int64_t m, int64_t k, c10::BFloat16* y, int64_t n_out, int64_t b0,
            int64_t b1) {
  using Fn = void (*)(const Panel&, const int32_t*, int64_t, int64_t, c10::BFloat16*, int64_t);
  static constexpr Fn fns[kPanelBlocks] = {panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>};
  // torch's CPU allocator aligns to 64 bytes, as the aligned loads and stores need
  const at::Tensor storage = at::empty({kPanelBlocks * f.pairs * 64}, at::kByte);
  auto* buf = reinterpret_cast<__m512i*>(storage.data_ptr<uint8_t>());
  const auto* xp = reinterpret_cast<const int32_t*>(x);
  for (int64_t b = b0; b < b1; b += kPanelBlocks) {
    const int64_t nb = std::min<int64_t>(kPanelBlocks, b1 - b);
    for (int64_t i = 0; i < nb; ++i)
      for (int64_t p = 0; p < f.pairs; ++p) _mm512_store_si512(buf + i * f.pairs + p, f.weights(b + i, p));
    fns[nb - 1](Panel{buf, b, f.pairs, f.kblock_pairs}, xp, m, k, y, n_out);
  }
}

template <class Fmt>
at::Tensor linear(const Fmt& f, const at::Tensor& x, int64_t n_out) {
  using Fn = void (*)(const Fmt&, const c10::BFloat16*, int64_t, c10::BFloat16*, int64_t, int64_t, int64_t);
  static constexpr Fn fns[8] = {rows<Fmt, 1>, rows<Fmt, 2>, rows<Fmt, 3>, rows<Fmt, 4>,
                                rows<Fmt, 5>, rows<Fmt, 6>, rows<Fmt, 7>, rows<Fmt, 8>};
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  at::Tensor y = at::empty({m, n_out}, xc.options());
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (m > 8) {  // each thread an equal share of the blocks, walked in panels
    at::parallel_for(0, n_out / kLanes, 1, [&](int64_t begin, int64_t end) { panels(f, xp, m, k, yp, n_out, begin, end); });
    return y;
  }
  at::parallel_for(0, n_out / kLanes, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
      const int64_t r = std::min<int64_t>(8, m - r0);
      fns[r - 1](f, xp + r0 * k, k, yp + r0 * n_out, n_out, begin, end);
    }
  });
  return y;
}

// K / 2 of x, checked against the repacked [N/16, K blocks, K block / 2, lanes] shape.
inline int64_t k_pairs(const at::Tensor& x, const at::Tensor& qs) {
  TORCH_CHECK(qs.dim() == 4 && x.size(1) % 32 == 0 && (qs.size(1) - 1) * qs.size(2) < x.size(1) / 2 &&
                  qs.size(1) * qs.size(2) >= x.size(1) / 2,
              "lanes kernel: the repacked groups' K blocks do not cover K = ", x.size(1));
  return x.size(1) / 2;
}

inline at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& mins) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "q4_linear (lanes): x must be 2-D bfloat16");
  const int64_t blocks = qs.size(0), pairs = k_pairs(x, qs), k = x.size(1);
  TORCH_CHECK(qs.size(3) == kLanes && scale.sizes() == mins.sizes() &&
                  scale.dim() == 3 && scale.size(0) == blocks && scale.size(1) == k / 32 && qs.is_contiguous() &&
                  scale.is_contiguous() && mins.is_contiguous() && scale.scalar_type() == at::kFloat &&
                  mins.scalar_type() == at::kFloat,
              "q4_linear (lanes): groups from q4_repack for K = ", k);
  return linear(Q4Lanes{qs.data_ptr<uint8_t>(), scale.data_ptr<float>(), mins.data_ptr<float>(), pairs, k / 32,
                        qs.size(1) * qs.size(2), qs.size(2)}, x, blocks * kLanes);
}

inline at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "q8_linear (lanes): x must be 2-D bfloat16");
  const int64_t blocks = qs.size(0), pairs = k_pairs(x, qs), k = x.size(1);
  TORCH_CHECK(qs.size(3) == 2 * kLanes && scale.dim() == 3 &&
                  scale.size(0) == blocks && scale.size(1) == k / 32 && qs.is_contiguous() && scale.is_contiguous() &&
                  scale.scalar_type() == at::kFloat,
              "q8_linear (lanes): groups from q8_repack for K = ", k);
  return linear(Q8Lanes{qs.data_ptr<int8_t>(), scale.data_ptr<float>(), pairs, k / 32, qs.size(1) * qs.size(2),
                        qs.size(2)}, x, blocks * kLanes);
}

}  // namespace kvpool_nlanes

#endif
