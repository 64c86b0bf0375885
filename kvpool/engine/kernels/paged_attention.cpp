// Paged attention on CPU: every query row reads its own sequence's K/V through the block table,
// so a step costs the sum of the rows' own contexts (no padding to the longest row, no gather of
// whole contexts). One work unit is (sequence, KV head, a tile of query tokens): the G query
// heads of a KV head and up to 16 rows (32 on AMX) share each K/V tile read (GQA without repeats). Keys are
// visited in tiles of 32 positions with an online softmax; long units are split across threads
// (flash-decoding) at fixed positions and their partial (max, sum, acc) merged with log-sum-exp
// weights in order, so a row's result is the same whatever shares its step.
//
// AMX path (bf16 queries over a bf16 cache, paged_attention_amx.h): both products on tiles, the
// same bits for a row in any unit, so prefill chunks run here too instead of SDPA; a chunk's V
// tiles are laid out for the tiles once per call, not once per unit. A unit's parts run on one
// thread one after another, or as separate tasks when there are few units.
//
// AVX512-BF16 path (bf16 queries over a bf16 cache, no AMX, GQA of 3+ query heads per KV head;
// paged_attention_dpbf16.h): both products on vdpbf16ps, each tile's K transposed once for the
// unit's rows, P rounded to bf16.
//
// AVX-512 path: K/V rows are read in place from fp32 caches and, with AVX512-BF16 and bf16
// queries, from bf16 caches (q.k by dpbf16); a row's 16 scores per half tile come out as one zmm from a
// transpose-and-add tree, and P.V keeps up to 4 rows' accumulators in registers per V row read.
// The next tile is prefetched (the caches are cold, a step's layers apart). Other caches go
// through `load_tile` to fp32 scratch: bf16 under fp32 queries, and the quantized caches of
// kvpool/engine/kv_quant.py: per token and KV head D int8 or fp8-e4m3 bytes then a float32
// scale, dequantized as float(q) * scale in fp32 (the torch path's expression). With AVX2 (no
// AVX-512) the same plan runs 8 lanes wide on fp32 queries (bf16 queries are widened first);
// with neither, or D not a multiple of 16 (AVX-512) or 8 (AVX2), scalar loops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "amx.h"  // defines KVPOOL_AMX where the build has the tile instructions
#include "vec_exp.h"

namespace {

using namespace kvpool_vec;  // exp16, exp8

constexpr int64_t kTile = 32;       // key positions per tile (one online-softmax step)
constexpr int64_t kRowsTarget = 16;  // query rows (tokens x group) a unit aims for
constexpr int64_t kSplit = 512;      // a context's parts end at multiples of this (flash-decoding)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kScaleBytes = 4;  // the float32 scale after a quantized row's D values
constexpr int64_t kDpMinGroup = 3;  // query heads per KV head from which bf16 takes run_item_dp

enum class KV : int { kF32, kBF16, kInt8, kFP8 };

struct Problem {
  const void* query;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int64_t* block_tables;
  const int64_t* query_start;
  const int64_t* seq_lens;
  int64_t q_stride_t, q_stride_h, bt_stride, block_size, kv_heads, group, head_dim, heads;
  float scale, softcap;
  int64_t window;  // 0: none
  bool q_bf16;
  KV kv;
  int64_t kv_width;  // elements per token and KV head in the cache (D, or D + 4 bytes quantized)
  const uint16_t* shared_values = nullptr;     // AMX path: a chunk's V tiles made once (share_values)
  const int64_t* shared_values_at = nullptr;  // where each (sequence, KV head)'s are, or kNotShared
};

struct Unit {
  int64_t seq, kvh, tok0, ntok, lo, hi, nsplit, first_item;
};

struct Item {
  int64_t unit, k0, k1;
};

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void to_float(const void* src, bool bf16, int64_t n, float* dst) {
  if (!bf16) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = bf16_to_float(s[i]);
}

void from_float(const float* src, bool bf16, int64_t n, void* dst) {
  if (!bf16) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  c10::BFloat16* d = static_cast<c10::BFloat16*>(dst);
  int64_t i = 0;
#ifdef __AVX512F__
  // c10::BFloat16's rounding, 16 at a time: (bits + 0x7FFF + lsb) >> 16, NaN -> 0x7FC0.
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; i < n; ++i) d[i] = c10::BFloat16(src[i]);  // round to nearest even
}

struct FP8Table {
  float v[256];
  FP8Table() {
    for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
const FP8Table kFP8;

// One quantized row: D bytes then the float32 scale -> float(q) * scale.
void dequant_row(const char* src, KV kv, int64_t d, float* dst) {
  float scale;
  std::memcpy(&scale, src + d, sizeof(float));
  int64_t i = 0;
  if (kv == KV::kInt8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(src);
#ifdef __AVX512F__
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= d; i += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s));
    }
#elif defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= d; i += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
    }
#endif
    for (; i < d; ++i) dst[i] = static_cast<float>(q[i]) * scale;
    return;
  }
  const uint8_t* q = reinterpret_cast<const uint8_t*>(src);
#ifdef __AVX512F__
  const __m512 s = _mm512_set1_ps(scale);
  for (; i + 16 <= d; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), kFP8.v, 4), s));
  }
#elif defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 8 <= d; i += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_i32gather_ps(kFP8.v, _mm256_cvtepu8_epi32(b), 4), s));
  }
#endif
  for (; i < d; ++i) dst[i] = kFP8.v[q[i]] * scale;
}

// Byte offsets in the caches of key positions t0 .. t0 + n - 1 of one sequence and KV head.
__attribute__((always_inline)) inline void tile_offsets(const Problem& p, const int64_t* table, int64_t kvh, int64_t t0, int64_t n, int64_t* off) {
  const int64_t w = p.kv_width, row = p.kv_heads * w;
  const int64_t elem = p.kv == KV::kF32 ? 4 : p.kv == KV::kBF16 ? 2 : 1;
  int64_t b = t0 / p.block_size, o = t0 % p.block_size;
  for (int64_t i = 0; i < n; ++i) {
    off[i] = ((table[b] * p.block_size + o) * row + kvh * w) * elem;
    if (++o == p.block_size) {
      o = 0;
      ++b;
    }
  }
}

// K and V of key positions [k0, k0 + n) of one sequence and KV head, as fp32 rows [n][D].
void load_tile(const Problem& p, const int64_t* table, int64_t kvh, int64_t k0, int64_t n, float* kf, float* vf) {
  const int64_t d = p.head_dim;
  const bool quantized = p.kv == KV::kInt8 || p.kv == KV::kFP8;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  int64_t off[kTile];
  tile_offsets(p, table, kvh, k0, n, off);
  for (int64_t i = 0; i < n; ++i) {
    if (quantized) {
      dequant_row(kc + off[i], p.kv, d, kf + i * d);
      dequant_row(vc + off[i], p.kv, d, vf + i * d);
    } else {
      to_float(kc + off[i], p.kv == KV::kBF16, d, kf + i * d);
      to_float(vc + off[i], p.kv == KV::kBF16, d, vf + i * d);
    }
  }
}

// Per-thread buffers, kept between calls (no allocation in the parallel region once warm).
struct Scratch {
  std::vector<float> q, k, v, zero, w, alpha, lsum, scores, local;
  std::vector<uint16_t> qb, pb;  // pb: bf16 weights [row][kTile] (run_item_dp)
  std::vector<uint32_t> live;    // each row's live keys in a tile (live_keys)
  void fit(int64_t rows, int64_t d, int64_t part) {
    q.resize(rows * d);
    qb.resize(rows * d);
    pb.resize(rows * kTile);
    live.resize(rows);
    k.resize(kTile * d);
    v.resize(kTile * d);
    zero.assign(d, 0.f);
    w.resize(rows * kTile);
    alpha.resize(rows);
    lsum.resize(rows * 16);
    scores.resize(kTile);
    local.resize(part);
  }
};

Scratch& thread_scratch(int64_t rows, int64_t d, int64_t part) {
  thread_local Scratch s;
  s.fit(rows, d, part);
  return s;
}

// Query rows r = token * G + g of a unit, as fp32 (q) or as their bf16 bits (qb, bf16 queries only).
void load_queries(const Problem& p, const Unit& u, bool bits, Scratch& sc) {
  const int64_t d = p.head_dim, g = p.group, elem = p.q_bf16 ? 2 : 4;
  const int64_t qstart = p.query_start[u.seq];
  for (int64_t t = 0; t < u.ntok; ++t) {
    const char* src = static_cast<const char*>(p.query) +
                      ((qstart + u.tok0 + t) * p.q_stride_t + u.kvh * g * p.q_stride_h) * elem;
    for (int64_t j = 0; j < g; ++j) {
      const char* row = src + j * p.q_stride_h * elem;
      if (bits)
        std::memcpy(sc.qb.data() + (t * g + j) * d, row, d * 2);
      else
        to_float(row, p.q_bf16, d, sc.q.data() + (t * g + j) * d);
    }
  }
}

// An item's start: the unit's queries loaded (as bf16 bits or fp32), m = -inf, l = acc = 0 and
// `lanes` partial sums of l per row zeroed; returns the position of the unit's first token.
inline int64_t start_item(const Problem& p, const Unit& u, bool bits, int64_t lanes, Scratch& sc, float* m, float* l,
                          float* acc) {
  const int64_t rows = u.ntok * p.group;
  load_queries(p, u, bits, sc);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.f);
  std::fill(acc, acc + rows * p.head_dim, 0.f);
  std::fill(sc.lsum.begin(), sc.lsum.begin() + rows * lanes, 0.f);
  return p.seq_lens[u.seq] - (p.query_start[u.seq + 1] - p.query_start[u.seq]) + u.tok0;
}

// Keys of the tile at t0 (n of them) that query position pos sees: k <= pos, pos - k < window.
inline void live_range(const Problem& p, int64_t t0, int64_t n, int64_t pos, int64_t& first, int64_t& last) {
  first = p.window ? std::max<int64_t>(t0, pos - p.window + 1) : t0;
  last = std::min(t0 + n - 1, pos);  // inclusive
}

// Each row's live keys in the tile at t0 (n keys): bit i of live[r] = key t0 + i, rows r of the
// unit from query position pos0 (g rows a position); [ilo, ihi] spans every row's (ilo > ihi: none).
inline void live_keys(const Problem& p, int64_t t0, int64_t n, int64_t pos0, int64_t rows, uint32_t* live, int& ilo,
                      int& ihi) {
  ilo = kTile, ihi = -1;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t first, last;
    live_range(p, t0, n, pos0 + r / p.group, first, last);
    live[r] = 0;
    if (first <= last) {
      live[r] = static_cast<uint32_t>(((uint64_t{1} << (last - t0 + 1)) - 1) & ~((uint64_t{1} << (first - t0)) - 1));
      ilo = std::min<int>(ilo, first - t0);
      ihi = std::max<int>(ihi, last - t0);
    }
  }
}

inline float dot_scalar(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// Scalar path (no AVX-512, or D not a multiple of 16). One row's online-softmax step over a tile
// of n scores at key positions k0..: updates m, l and acc [D] with the keys it sees.
void softmax_step(const Problem& p, const float* scores_in, int64_t k0, int64_t n, int64_t pos, const float* vf,
                  float& m, float& l, float* acc) {
  const int64_t d = p.head_dim;
  int64_t first, last;
  live_range(p, k0, n, pos, first, last);
  if (first > last) return;
  float s[kTile], w[kTile];
  float tmax = kNegInf;
  for (int64_t i = 0; i < n; ++i) {
    float x = scores_in[i] * p.scale;
    if (p.softcap > 0.f) x = p.softcap * std::tanh(x / p.softcap);
    const int64_t k = k0 + i;
    s[i] = (k >= first && k <= last) ? x : kNegInf;
    tmax = std::max(tmax, s[i]);
  }
  const float m_new = std::max(m, tmax);
  const float alpha = m == kNegInf ? 0.f : std::exp(m - m_new);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    // Weights below e^-80 are dropped: they change nothing and would make denormal products.
    w[i] = (s[i] == kNegInf || s[i] - m_new < -80.f) ? 0.f : std::exp(s[i] - m_new);
    sum += w[i];
  }
  for (int64_t j = 0; j < d; ++j) acc[j] *= alpha;
  for (int64_t i = first - k0; i <= last - k0; ++i)
    for (int64_t j = 0; j < d; ++j) acc[j] += w[i] * vf[i * d + j];
  l = l * alpha + sum;
  m = m_new;
}

// Rows r = token * G + g of a unit over keys [k0, k1): m, l [R] and unnormalized acc [R][D].
void run_item_scalar(const Problem& p, const Unit& u, int64_t k0, int64_t k1, Scratch& sc, float* m, float* l,
                     float* acc) {
  const int64_t d = p.head_dim, g = p.group, rows = u.ntok * g;
  const int64_t pos0 = start_item(p, u, false, 0, sc, m, l, acc);  // position of the unit's first token
  const int64_t* table = p.block_tables + u.seq * p.bt_stride;
  for (int64_t t0 = k0; t0 < k1; t0 += kTile) {
    const int64_t n = std::min(kTile, k1 - t0);
    load_tile(p, table, u.kvh, t0, n, sc.k.data(), sc.v.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = sc.q.data() + r * d;
      for (int64_t i = 0; i < n; ++i) sc.scores[i] = dot_scalar(qr, sc.k.data() + i * d, d);
      softmax_step(p, sc.scores.data(), t0, n, pos0 + r / g, sc.v.data(), m[r], l[r], acc + r * d);
    }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// The caches are mostly cold (a step's 30 layers apart): rows are asked for one tile ahead.
inline void prefetch_rows(const Problem& p, const int64_t* off, int64_t n) {
  const int64_t row_bytes = p.kv_width * (p.kv == KV::kF32 ? 4 : p.kv == KV::kBF16 ? 2 : 1);
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(kc + off[i] + b, _MM_HINT_T0);
      _mm_prefetch(vc + off[i] + b, _MM_HINT_T0);
    }
}

// The first tile of an item, asked for while the item before it runs.
void prefetch_item(const Problem& p, const Unit& u, int64_t k0, int64_t k1) {
  int64_t off[kTile];
  const int64_t n = std::min(kTile, k1 - k0);
  tile_offsets(p, p.block_tables + u.seq * p.bt_stride, u.kvh, k0, n, off);
  prefetch_rows(p, off, n);
}
#endif

// The next tile's key offsets (after the tile at t0, in an item ending at k1) in `next`, and its K
// rows then V rows in `ahead` (`zero` past its keys), to be asked for while this tile runs;
// false when this tile is the item's last.
inline bool next_tile(const Problem& p, const int64_t* table, int64_t kvh, int64_t t0, int64_t k1, const char* zero,
                      int64_t* next, const char** ahead) {
  if (t0 + kTile >= k1) return false;
  const int64_t nn = std::min(kTile, k1 - t0 - kTile);
  tile_offsets(p, table, kvh, t0 + kTile, nn, next);
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  for (int64_t i = 0; i < kTile; ++i) {
    ahead[i] = i < nn ? kc + next[i] : zero;
    ahead[kTile + i] = i < nn ? vc + next[i] : zero;
  }
  return true;
}

#ifdef __AVX512F__
// Lane i of the result = the sum of a[i]'s 16 lanes: a transpose-and-add tree (30 shuffles,
// 15 adds for 16 sums) instead of 16 horizontal reductions.
__attribute__((always_inline)) inline __m512 sum16(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: keys 2i, 2i+1, 2i, 2i+1
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: keys 4i .. 4i+3
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

// The AVX-512 path reads K/V rows in place: the fp32 cache, the bf16 cache (BF16: bf16 queries,
// dot products by dpbf16, exact products summed in fp32), or a tile dequantized to fp32 scratch.
// NC: D in chunks of 16 fp32 / 32 bf16 values, fixed so the query stays in registers (0: any D).
template <bool BF16, int NC>
__attribute__((always_inline)) inline __m512 scores16(const Scratch& sc, int64_t r, const char* const* krow, int64_t d) {
  __m512 a[16];
#ifdef __AVX512BF16__
  if constexpr (BF16) {
    const int64_t nc = NC ? NC : d / 32;
    const uint16_t* q = sc.qb.data() + r * d;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t c = 0; c < nc; ++c)
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(q + 32 * c), (__m512bh)_mm512_loadu_si512(krow[i] + 64 * c));
      a[i] = s;
    }
    return sum16(a);
  }
#endif
  const int64_t nc = NC ? NC : d / 16;
  const float* q = sc.q.data() + r * d;
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const float* k = reinterpret_cast<const float*>(krow[i]);
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int64_t c = 1; c < nc; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(k + 16 * c), s);
    a[i] = s;
  }
  return sum16(a);
}

// One row's online-softmax step over a tile's 32 scores s0, s1 (lanes outside live0, live1
// ignored): updates m and the 16 partial sums of l at lsum, writes the 32 weights w and returns
// alpha, the factor on the row's previous acc.
__attribute__((always_inline)) inline float softmax32(const Problem& p, __m512 s0, __m512 s1, __mmask16 live0,
                                                      __mmask16 live1, float& m, float* lsum, float* w) {
  if (!(live0 | live1)) {
    _mm512_storeu_ps(w, _mm512_setzero_ps());
    _mm512_storeu_ps(w + 16, _mm512_setzero_ps());
    return 1.f;
  }
  const __m512 scale = _mm512_set1_ps(p.scale);
  s0 = _mm512_mul_ps(s0, scale);
  s1 = _mm512_mul_ps(s1, scale);
  if (p.softcap > 0.f) {
    alignas(64) float x[32];
    _mm512_store_ps(x, s0);
    _mm512_store_ps(x + 16, s1);
    for (int i = 0; i < 32; ++i) x[i] = p.softcap * std::tanh(x[i] / p.softcap);
    s0 = _mm512_load_ps(x);
    s1 = _mm512_load_ps(x + 16);
  }
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  const __m512 top = _mm512_max_ps(_mm512_mask_mov_ps(ninf, live0, s0), _mm512_mask_mov_ps(ninf, live1, s1));
  const float m_new = std::max(m, _mm512_reduce_max_ps(top));
  const float alpha = m == kNegInf ? 0.f : m == m_new ? 1.f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m - m_new)));
  // Weights below e^-80 are dropped: they change nothing and would make denormal products.
  const __m512 mb = _mm512_set1_ps(m_new), floor = _mm512_set1_ps(-80.0f);
  __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
  if (live0) {
    const __m512 diff = _mm512_sub_ps(s0, mb);
    e0 = _mm512_maskz_mov_ps(live0 & _mm512_cmp_ps_mask(diff, floor, _CMP_GE_OQ), exp16(diff));
  }
  if (live1) {
    const __m512 diff = _mm512_sub_ps(s1, mb);
    e1 = _mm512_maskz_mov_ps(live1 & _mm512_cmp_ps_mask(diff, floor, _CMP_GE_OQ), exp16(diff));
  }
  _mm512_storeu_ps(w, e0);
  _mm512_storeu_ps(w + 16, e1);
  _mm512_storeu_ps(lsum, _mm512_fmadd_ps(_mm512_loadu_ps(lsum), _mm512_set1_ps(alpha), _mm512_add_ps(e0, e1)));
  m = m_new;
  return alpha;
}

// 16 fp32 values of a V row: chunk c of an fp32 row, or (BF16) the even (half 0) or odd (half 1)
// positions of a 32-value chunk, so a bf16 row's acc is stored [chunk][even 16][odd 16].
template <bool BF16>
inline __m512 v_lanes(const char* row, int64_t c, int half) {
  if constexpr (BF16) {
    const __m512i x = _mm512_loadu_si512(row + 64 * c);
    return _mm512_castsi512_ps(half ? _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                    : _mm512_slli_epi32(x, 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * c);
  }
}

// acc[r] = alpha[r] * acc[r] + sum_i w[r][i] v_i for R rows at acc (stride D), keys ilo..ihi,
// the R rows' accumulators in registers while each V row is read once.
// `ahead` (or null): the next tile's K rows then V rows, asked for one key per step so the
// requests spread over the loop instead of stalling in a burst.
template <bool BF16, int NC, int R>
inline void pv_rows(const float* w, const float* alpha, const char* const* vrow, int ilo, int ihi, int64_t d,
                    float* acc, const char* const* ahead, int64_t ahead_bytes) {
  constexpr int V = BF16 ? 2 * NC : NC;  // zmm per row
  __m512 o[R][V];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < V; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + 16 * c), a);
  }
  for (int i = ilo; i <= ihi; ++i) {
    if (ahead)
      for (int64_t b = 0; b < ahead_bytes; b += 64) {
        _mm_prefetch(ahead[i] + b, _MM_HINT_T0);
        _mm_prefetch(ahead[kTile + i] + b, _MM_HINT_T0);
      }
    __m512 x[V];
    for (int c = 0; c < V; ++c) x[c] = BF16 ? v_lanes<true>(vrow[i], c / 2, c % 2) : v_lanes<false>(vrow[i], c, 0);
    for (int r = 0; r < R; ++r) {
      const __m512 wb = _mm512_set1_ps(w[r * kTile + i]);
      for (int c = 0; c < V; ++c) o[r][c] = _mm512_fmadd_ps(wb, x[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + r * d + 16 * c, o[r][c]);
}

// Any D: one row at a time, acc through memory.
template <bool BF16>
void pv_any(const float* w, const float* alpha, const char* const* vrow, int ilo, int ihi, int64_t d, int64_t rows,
            float* acc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d / 16; ++c) {
      __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + 16 * c), _mm512_set1_ps(alpha[r]));
      for (int i = ilo; i <= ihi; ++i)
        o = _mm512_fmadd_ps(_mm512_set1_ps(w[r * kTile + i]),
                            BF16 ? v_lanes<true>(vrow[i], c / 2, c % 2) : v_lanes<false>(vrow[i], c, 0), o);
      _mm512_storeu_ps(acc + r * d + 16 * c, o);
    }
}

template <bool BF16, int NC, int R>
void pv_group(int64_t n, const float* w, const float* alpha, const char* const* vrow, int ilo, int ihi, int64_t d,
              float* acc, const char* const* ahead, int64_t ahead_bytes) {
  if (n == R)
    pv_rows<BF16, NC, R>(w, alpha, vrow, ilo, ihi, d, acc, ahead, ahead_bytes);
  else if constexpr (R > 1)
    pv_group<BF16, NC, R - 1>(n, w, alpha, vrow, ilo, ihi, d, acc, ahead, ahead_bytes);
}

template <bool BF16, int NC>
void pv(const Scratch& sc, const char* const* vrow, int ilo, int ihi, int64_t d, int64_t rows, float* acc,
        const char* const* ahead, int64_t ahead_bytes) {
  if constexpr (NC == 0) {
    if (ahead)
      for (int i = 0; i < kTile; ++i)
        for (int64_t b = 0; b < ahead_bytes; b += 64) {
          _mm_prefetch(ahead[i] + b, _MM_HINT_T0);
          _mm_prefetch(ahead[kTile + i] + b, _MM_HINT_T0);
        }
    pv_any<BF16>(sc.w.data(), sc.alpha.data(), vrow, ilo, ihi, d, rows, acc);
  } else {
    constexpr int V = BF16 ? 2 * NC : NC;
    constexpr int R = V <= 4 ? 4 : V <= 8 ? 2 : 1;  // rows whose accumulators fit in registers
    for (int64_t r = 0; r < rows; r += R)
      pv_group<BF16, NC, R>(std::min<int64_t>(R, rows - r), sc.w.data() + r * kTile, sc.alpha.data() + r, vrow, ilo,
                            ihi, d, acc + r * d, r == 0 ? ahead : nullptr, ahead_bytes);
  }
}

// A bf16 row's acc from [chunk][even 16][odd 16] back to D values in order.
void unpermute_rows(float* acc, int64_t rows, int64_t d) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; c += 32) {
      float* x = acc + r * d + c;
      const __m512 even = _mm512_loadu_ps(x), odd = _mm512_loadu_ps(x + 16);
      _mm512_storeu_ps(x, _mm512_permutex2var_ps(even, lo, odd));
      _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
}

// run_item_scalar's contract on AVX-512: each tile's 16 scores of a row are one zmm, all rows of
// the unit go over one read of the tile, no horizontal sums but one max and one sum per row.
template <bool BF16, int NC>
void run_item_fast(const Problem& p, const Unit& u, int64_t k0, int64_t k1, Scratch& sc, float* m, float* l,
                   float* acc) {
  const int64_t d = p.head_dim, g = p.group, rows = u.ntok * g;
  const int64_t pos0 = start_item(p, u, BF16, 16, sc, m, l, acc);
  const int64_t* table = p.block_tables + u.seq * p.bt_stride;
  const bool in_place = BF16 || p.kv == KV::kF32;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  const char* zero = reinterpret_cast<const char*>(sc.zero.data());
  int64_t off[kTile];
  const char* krow[kTile];
  const char* vrow[kTile];
  const int64_t row_bytes = p.kv_width * (p.kv == KV::kF32 ? 4 : p.kv == KV::kBF16 ? 2 : 1);
  int64_t next[kTile];
  const char* ahead[2 * kTile];
  tile_offsets(p, table, u.kvh, k0, std::min(kTile, k1 - k0), next);
  for (int64_t t0 = k0; t0 < k1; t0 += kTile) {
    const int64_t n = std::min(kTile, k1 - t0);
    std::memcpy(off, next, sizeof(off));
    const bool more = next_tile(p, table, u.kvh, t0, k1, zero, next, ahead);  // asked for while this one runs
    if (in_place) {
      for (int64_t i = 0; i < n; ++i) krow[i] = kc + off[i], vrow[i] = vc + off[i];
    } else {
      load_tile(p, table, u.kvh, t0, n, sc.k.data(), sc.v.data());
      for (int64_t i = 0; i < n; ++i)
        krow[i] = reinterpret_cast<const char*>(sc.k.data() + i * d),
        vrow[i] = reinterpret_cast<const char*>(sc.v.data() + i * d);
    }
    for (int64_t i = n; i < kTile; ++i) krow[i] = vrow[i] = zero;  // score 0, weight 0
    int ilo, ihi;
    live_keys(p, t0, n, pos0, rows, sc.live.data(), ilo, ihi);
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t live = sc.live[r];
      const __mmask16 live0 = static_cast<__mmask16>(live), live1 = static_cast<__mmask16>(live >> 16);
      const __m512 s0 = live0 ? scores16<BF16, NC>(sc, r, krow, d) : _mm512_setzero_ps();
      const __m512 s1 = live1 ? scores16<BF16, NC>(sc, r, krow + 16, d) : _mm512_setzero_ps();
      sc.alpha[r] = softmax32(p, s0, s1, live0, live1, m[r], sc.lsum.data() + r * 16, sc.w.data() + r * kTile);
    }
    if (ilo <= ihi)
      pv<BF16, NC>(sc, vrow, ilo, ihi, d, rows, acc, more ? ahead : nullptr, row_bytes);
  }
  for (int64_t r = 0; r < rows; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(sc.lsum.data() + r * 16));
  if constexpr (BF16) unpermute_rows(acc, rows, d);
}

#ifdef __AVX512BF16__
#include "paged_attention_dpbf16.h"  // run_item_dp: both products on vdpbf16ps (no AMX)
#endif
#endif

#ifdef KVPOOL_AMX
#include "paged_attention_amx.h"  // run_item_amx: bf16 queries over a bf16 cache on AMX tiles
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 path (8 lanes, 16 registers): the AVX-512 path's plan on fp32 queries. fp32 K/V rows are
// read in place, other caches through `load_tile`; a row's 8 scores per key group come from a
// horizontal-add tree, and P.V keeps up to 3 rows x 32 dims of accumulators in registers.

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Lane i = the sum of a[i]'s 8 lanes (6 horizontal adds, 2 lane swaps, 1 add for 8 sums).
__attribute__((always_inline)) inline __m256 sum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The scores of query row r against 8 keys (fp32 rows at krow), D = 8 * nc.
__attribute__((always_inline)) inline __m256 scores8(const float* q, const char* const* krow, int64_t nc) {
  __m256 a[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const float* k = reinterpret_cast<const float*>(krow[i]);
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    for (int64_t c = 1; c < nc; ++c) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), s);
    a[i] = s;
  }
  return sum8(a);
}

// All-ones lanes where bit i of the low 8 bits is set.
inline __m256 lane_mask(uint32_t bits) {
  const __m256i b = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), b), b));
}

// softmax32 on 4 x 8 scores: updates m and the 8 partial sums of l at lsum, writes the 32
// weights w, returns alpha.
__attribute__((always_inline)) inline float softmax32_avx2(const Problem& p, __m256* s, uint32_t live, float& m,
                                                           float* lsum, float* w) {
  if (!live) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(w + 8 * j, _mm256_setzero_ps());
    return 1.f;
  }
  const __m256 scale = _mm256_set1_ps(p.scale), ninf = _mm256_set1_ps(kNegInf);
  for (int j = 0; j < 4; ++j) s[j] = _mm256_mul_ps(s[j], scale);
  if (p.softcap > 0.f) {
    alignas(32) float x[32];
    for (int j = 0; j < 4; ++j) _mm256_store_ps(x + 8 * j, s[j]);
    for (int i = 0; i < 32; ++i) x[i] = p.softcap * std::tanh(x[i] / p.softcap);
    for (int j = 0; j < 4; ++j) s[j] = _mm256_load_ps(x + 8 * j);
  }
  __m256 mask[4];
  __m256 top = ninf;
  for (int j = 0; j < 4; ++j) {
    mask[j] = lane_mask(live >> (8 * j));
    top = _mm256_max_ps(top, _mm256_blendv_ps(ninf, s[j], mask[j]));
  }
  const float m_new = std::max(m, hmax8(top));
  const float alpha = m == kNegInf ? 0.f : m == m_new ? 1.f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m - m_new)));
  // Weights below e^-80 are dropped: they change nothing and would make denormal products.
  const __m256 mb = _mm256_set1_ps(m_new), floor = _mm256_set1_ps(-80.0f);
  __m256 total = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    __m256 e = _mm256_setzero_ps();
    if ((live >> (8 * j)) & 0xFF) {
      const __m256 diff = _mm256_sub_ps(s[j], mb);
      e = _mm256_and_ps(exp8(diff), _mm256_and_ps(mask[j], _mm256_cmp_ps(diff, floor, _CMP_GE_OQ)));
    }
    _mm256_storeu_ps(w + 8 * j, e);
    total = _mm256_add_ps(total, e);
  }
  _mm256_storeu_ps(lsum, _mm256_fmadd_ps(_mm256_loadu_ps(lsum), _mm256_set1_ps(alpha), total));
  m = m_new;
  return alpha;
}

// acc[r] = alpha[r] * acc[r] + sum_i w[r][i] v_i for R rows, keys ilo..ihi, in passes of
// 8 * CH dims whose R x CH accumulators stay in registers (the tile's V rows are in L1).
template <int CH, int R>
inline void pv_rows8(const float* w, const float* alpha, const char* const* vrow, int ilo, int ihi, int64_t d,
                     float* acc) {
  for (int64_t c0 = 0; c0 < d; c0 += 8 * CH) {
    __m256 o[R][CH];
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(alpha[r]);
      for (int c = 0; c < CH; ++c) o[r][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * d + c0 + 8 * c), a);
    }
    for (int i = ilo; i <= ihi; ++i) {
      const float* v = reinterpret_cast<const float*>(vrow[i]) + c0;
      __m256 wb[R];
      for (int r = 0; r < R; ++r) wb[r] = _mm256_broadcast_ss(w + r * kTile + i);
      for (int c = 0; c < CH; ++c) {
        const __m256 x = _mm256_loadu_ps(v + 8 * c);
        for (int r = 0; r < R; ++r) o[r][c] = _mm256_fmadd_ps(wb[r], x, o[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CH; ++c) _mm256_storeu_ps(acc + r * d + c0 + 8 * c, o[r][c]);
  }
}

template <int CH>
void pv8(const Scratch& sc, const char* const* vrow, int ilo, int ihi, int64_t d, int64_t rows, float* acc) {
  for (int64_t r = 0; r < rows; r += 3) {
    const float* w = sc.w.data() + r * kTile;
    const float* alpha = sc.alpha.data() + r;
    switch (std::min<int64_t>(3, rows - r)) {
      case 3: pv_rows8<CH, 3>(w, alpha, vrow, ilo, ihi, d, acc + r * d); break;
      case 2: pv_rows8<CH, 2>(w, alpha, vrow, ilo, ihi, d, acc + r * d); break;
      default: pv_rows8<CH, 1>(w, alpha, vrow, ilo, ihi, d, acc + r * d); break;
    }
  }
}

// run_item_scalar's contract on AVX2; CH: 4 when D is a multiple of 32, else 1 (D % 8 == 0).
template <int CH>
void run_item_avx2(const Problem& p, const Unit& u, int64_t k0, int64_t k1, Scratch& sc, float* m, float* l,
                   float* acc) {
  const int64_t d = p.head_dim, g = p.group, rows = u.ntok * g;
  const int64_t pos0 = start_item(p, u, false, 8, sc, m, l, acc);
  const int64_t* table = p.block_tables + u.seq * p.bt_stride;
  const bool in_place = p.kv == KV::kF32;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  const char* zero = reinterpret_cast<const char*>(sc.zero.data());
  int64_t off[kTile], next[kTile];
  const char* krow[kTile];
  const char* vrow[kTile];
  tile_offsets(p, table, u.kvh, k0, std::min(kTile, k1 - k0), next);
  for (int64_t t0 = k0; t0 < k1; t0 += kTile) {
    const int64_t n = std::min(kTile, k1 - t0);
    std::memcpy(off, next, sizeof(off));
    if (t0 + kTile < k1) {  // ask for the next tile while this one runs
      const int64_t nn = std::min(kTile, k1 - t0 - kTile);
      tile_offsets(p, table, u.kvh, t0 + kTile, nn, next);
      prefetch_rows(p, next, nn);
    }
    if (in_place) {
      for (int64_t i = 0; i < n; ++i) krow[i] = kc + off[i], vrow[i] = vc + off[i];
    } else {
      load_tile(p, table, u.kvh, t0, n, sc.k.data(), sc.v.data());
      for (int64_t i = 0; i < n; ++i)
        krow[i] = reinterpret_cast<const char*>(sc.k.data() + i * d),
        vrow[i] = reinterpret_cast<const char*>(sc.v.data() + i * d);
    }
    for (int64_t i = n; i < kTile; ++i) krow[i] = vrow[i] = zero;  // score 0, weight 0
    int ilo, ihi;
    live_keys(p, t0, n, pos0, rows, sc.live.data(), ilo, ihi);
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t live = sc.live[r];
      const float* q = sc.q.data() + r * d;
      __m256 s[4];
      for (int j = 0; j < 4; ++j)
        s[j] = (live >> (8 * j)) & 0xFF ? scores8(q, krow + 8 * j, d / 8) : _mm256_setzero_ps();
      sc.alpha[r] = softmax32_avx2(p, s, live, m[r], sc.lsum.data() + r * 8, sc.w.data() + r * kTile);
    }
    if (ilo <= ihi) pv8<CH>(sc, vrow, ilo, ihi, d, rows, acc);
  }
  for (int64_t r = 0; r < rows; ++r) l[r] = hsum8(_mm256_loadu_ps(sc.lsum.data() + r * 8));
}
#endif

using ItemFn = void (*)(const Problem&, const Unit&, int64_t, int64_t, Scratch&, float*, float*, float*);

// The fastest path this build has for the problem's types and D.
ItemFn pick_item_fn(const Problem& p) {
#ifdef __AVX512F__
#ifdef KVPOOL_AMX
  if (p.q_bf16 && p.kv == KV::kBF16 && p.head_dim % 32 == 0 && p.head_dim <= 256 && p.group <= kBlockRows &&
      kvpool_amx::unavailable_reason().empty())
    return run_item_amx;
#endif
#ifdef __AVX512BF16__
  // vdpbf16ps products pay a K transpose per tile and unit: from kDpMinGroup query heads per KV
  // head a decode unit has the rows to pay it (measured: MHA decode 20% slower than the FMA
  // path, 3 heads at parity). The choice is the model's, so every row of it takes one path.
  if (p.q_bf16 && p.kv == KV::kBF16 && p.head_dim % 32 == 0 && p.head_dim <= 256 && p.group >= kDpMinGroup) {
    switch (p.head_dim / 32) {
      case 2: return run_item_dp<2>;
      case 4: return run_item_dp<4>;
      case 8: return run_item_dp<8>;
    }
  }
  if (p.q_bf16 && p.kv == KV::kBF16 && p.head_dim % 32 == 0) {
    switch (p.head_dim / 32) {
      case 2: return run_item_fast<true, 2>;
      case 4: return run_item_fast<true, 4>;
      case 8: return run_item_fast<true, 8>;
      default: return run_item_fast<true, 0>;
    }
  }
#endif
  if (p.head_dim % 16 == 0) {
    switch (p.head_dim / 16) {
      case 4: return run_item_fast<false, 4>;
      case 8: return run_item_fast<false, 8>;
      default: return run_item_fast<false, 0>;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (p.head_dim % 32 == 0) return run_item_avx2<4>;
  if (p.head_dim % 8 == 0) return run_item_avx2<1>;
#endif
  return run_item_scalar;
}

void write_rows(const Problem& p, const Unit& u, const float* rows_out) {
  const int64_t d = p.head_dim, g = p.group, elem = p.q_bf16 ? 2 : 4;
  const int64_t qstart = p.query_start[u.seq];
  for (int64_t t = 0; t < u.ntok; ++t) {
    char* dst = static_cast<char*>(p.out) + ((qstart + u.tok0 + t) * p.heads + u.kvh * g) * d * elem;
    from_float(rows_out + t * g * d, p.q_bf16, g * d, dst);
  }
}

// Units of up to rows_target rows; each unit's keys in items that end at fixed positions (the
// multiples of kSplit), tiles from a multiple of kTile: a row's sums follow its own positions
// only, never the batch or the thread count (docs/determinism.md).
void plan(const Problem& p, const int64_t* seqs, int64_t num_seqs, int64_t rows_target, std::vector<Unit>& units,
          std::vector<Item>& items) {
  const int64_t tokens_per_unit = std::max<int64_t>(1, rows_target / p.group);
  // A chunk's units one KV head at a time (they share that head's keys in L2); a decode row's
  // heads side by side (their keys share cache lines and pages: [block, slot, head, D]).
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t s = seqs[i], qlen = p.query_start[s + 1] - p.query_start[s], slen = p.seq_lens[s];
    for (int64_t h = 0; h < p.kv_heads; ++h)
      for (int64_t tok0 = 0; tok0 < qlen; tok0 += tokens_per_unit) {
        const int64_t ntok = std::min(tokens_per_unit, qlen - tok0);
        const int64_t first = slen - qlen + tok0, last = first + ntok - 1;
        const int64_t lo = p.window ? std::max<int64_t>(0, first - p.window + 1) / kTile * kTile : 0;
        units.push_back({s, h, tok0, ntok, lo, last + 1, 1, 0});
      }
  }
  for (auto& u : units) {
    u.first_item = static_cast<int64_t>(items.size());
    for (int64_t k = u.lo; k < u.hi;) {
      const int64_t end = std::min(u.hi, (k / kSplit + 1) * kSplit);
      items.push_back({static_cast<int64_t>(&u - units.data()), k, end});
      k = end;
    }
    u.nsplit = static_cast<int64_t>(items.size()) - u.first_item;
  }
}

// A unit's parts (m [max_rows], l [max_rows], acc [rows][D] each, keys in order) as one result
// per row: the parts' acc and l weighted by exp(m - the largest m), summed in order.
void merge_parts(const Problem& p, const Unit& u, const float* const* parts, int64_t max_rows, float* merged) {
  const int64_t d = p.head_dim, rows = u.ntok * p.group;
  for (int64_t r = 0; r < rows; ++r) {
    float big = kNegInf;
    for (int64_t s = 0; s < u.nsplit; ++s) big = std::max(big, parts[s][r]);
    float denom = 0.f;
    float* o = merged + r * d;
    std::fill(o, o + d, 0.f);
    for (int64_t s = 0; s < u.nsplit; ++s) {
      const float* buf = parts[s];
      if (buf[r] == kNegInf) continue;
      const float w = std::exp(buf[r] - big);
      denom += w * buf[max_rows + r];
      const float* acc = buf + 2 * max_rows + r * d;
      for (int64_t j = 0; j < d; ++j) o[j] += w * acc[j];
    }
    for (int64_t j = 0; j < d; ++j) o[j] /= denom;
  }
}

void paged_attention_out(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& query_start,
                         const at::Tensor& seq_lens, const at::Tensor& seqs, double scale, int64_t window,
                         double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [T, H, D] with contiguous rows");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out: contiguous, shaped and typed like query");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache, v_cache: contiguous [blocks, block_size, Hkv, D] of one dtype");
  const auto qt = query.scalar_type(), kt = k_cache.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "query: float32 or bfloat16");
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16 || kt == at::kChar || kt == at::kByte,
              "KV cache: float32, bfloat16, int8 or uint8 (fp8 e4m3 bits) with scales");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && query_start.is_contiguous() &&
                  seq_lens.is_contiguous() && seqs.is_contiguous() && query_start.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && seqs.scalar_type() == at::kLong,
              "block tables, query starts, sequence lengths, sequence ids: contiguous int64");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), d = query.size(2);
  const KV kv = kt == at::kFloat ? KV::kF32 : kt == at::kBFloat16 ? KV::kBF16 : kt == at::kChar ? KV::kInt8 : KV::kFP8;
  const int64_t width = (kv == KV::kInt8 || kv == KV::kFP8) ? d + kScaleBytes : d;
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == width,
              "query heads must be a multiple of KV heads; KV rows must hold D values (+ 4 scale bytes if quantized)");
  Problem p{query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr<int64_t>(), query_start.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
            query.stride(0), query.stride(1), block_tables.size(1), k_cache.size(1), kv_heads, heads / kv_heads, d,
            heads, static_cast<float>(scale), static_cast<float>(softcap), window, qt == at::kBFloat16, kv, width};
  const ItemFn run_item = pick_item_fn(p);
#ifdef KVPOOL_AMX
  const bool tiles = run_item == run_item_amx;
  const int64_t rows_target = tiles ? kAmxMaxRows : kRowsTarget;
#else
  const int64_t rows_target = kRowsTarget;
#endif
  std::vector<Unit> units;
  std::vector<Item> items;
  plan(p, seqs.data_ptr<int64_t>(), seqs.numel(), rows_target, units, items);
  const int64_t max_rows = std::max<int64_t>(rows_target, p.group) + p.group;
  const int64_t part = max_rows * (d + 2);  // m, l, acc of one item
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // A unit's parts run on one thread, one after another, unless there are too few units to keep
  // the threads busy (a decode step of a few long rows): then each part is a task of its own and
  // the parts are merged after. The same parts and the same merge: the same bits either way.
  const bool spread = static_cast<int64_t>(units.size()) < 4 * threads;
  std::vector<float> partials;
  std::vector<int64_t> slot(items.size(), -1);
  int64_t num_slots = 0;
  if (spread)
    for (size_t i = 0; i < items.size(); ++i)
      if (units[items[i].unit].nsplit > 1) slot[i] = num_slots++;
  partials.resize(num_slots * part);

#ifdef KVPOOL_AMX
  thread_local std::vector<uint16_t> shared_buf;  // kept between calls: no page faults once warm
  std::vector<int64_t> shared_at;
  if (tiles) share_values(p, units, seq_lens.numel(), shared_buf, shared_at);
#endif
  // Tasks are taken in small batches as threads come free: a long chunk's later units cost more
  // than its first, so a static split would leave one thread waiting.
  const int64_t num_tasks = static_cast<int64_t>(spread ? items.size() : units.size());
  const int64_t batch = std::max<int64_t>(1, num_tasks / (threads * 16));
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, std::min(threads, std::max<int64_t>(1, num_tasks)), 1, [&](int64_t, int64_t) {
#ifdef KVPOOL_AMX
    if (tiles) kvpool_amx::load_tile_config();  // once per thread and call: it costs ~ a tile's work
#endif
    Scratch& sc = thread_scratch(max_rows, d, part);
    thread_local std::vector<float> parts;
    std::vector<const float*> part_of;
    for (int64_t begin; (begin = taken.fetch_add(batch)) < num_tasks;) {
      const int64_t end = std::min(num_tasks, begin + batch);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t first = spread ? task : units[task].first_item;
        const Unit& u = units[items[first].unit];
        const int64_t rows = u.ntok * p.group;
        if (spread && slot[first] >= 0) {  // one part of a unit spread over the threads
          float* buf = partials.data() + slot[first] * part;
          run_item(p, u, items[first].k0, items[first].k1, sc, buf, buf + max_rows, buf + 2 * max_rows);
          continue;
        }
        if (u.nsplit == 1) {
          float *m = sc.local.data(), *l = m + max_rows, *acc = m + 2 * max_rows;
          run_item(p, u, u.lo, u.hi, sc, m, l, acc);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < d; ++j) acc[r * d + j] /= l[r];
          write_rows(p, u, acc);
          continue;
        }
        parts.resize(u.nsplit * part);
        part_of.resize(u.nsplit);
        for (int64_t s = 0; s < u.nsplit; ++s) {
          float* buf = parts.data() + s * part;
          run_item(p, u, items[first + s].k0, items[first + s].k1, sc, buf, buf + max_rows, buf + 2 * max_rows);
          part_of[s] = buf;
        }
        merge_parts(p, u, part_of.data(), max_rows, sc.local.data());
        write_rows(p, u, sc.local.data());
      }
    }
#ifdef KVPOOL_AMX
    if (tiles) _tile_release();
#endif
  });

  if (num_slots == 0) return;
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    float* merged = thread_scratch(max_rows, d, part).local.data();
    std::vector<const float*> part_of;
    for (int64_t ui = begin; ui < end; ++ui) {
      const Unit& u = units[ui];
      if (u.nsplit == 1) continue;
      part_of.resize(u.nsplit);
      for (int64_t s = 0; s < u.nsplit; ++s) part_of[s] = partials.data() + slot[u.first_item + s] * part;
      merge_parts(p, u, part_of.data(), max_rows, merged);
      write_rows(p, u, merged);
    }
  });
}

}  // namespace

TORCH_LIBRARY(kvpool_attn, m) {
  m.def("paged_attention_out(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start, Tensor seq_lens, Tensor seqs, float scale, int window, float softcap) -> ()");
}
TORCH_LIBRARY_IMPL(kvpool_attn, CPU, m) { m.impl("paged_attention_out", paged_attention_out); }
