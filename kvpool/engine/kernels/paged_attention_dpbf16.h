// bf16 queries over a bf16 cache with AVX512-BF16 and no AMX: run_item_fast's contract (one
// unit's rows over keys [k0, k1) in tiles of 32, online softmax) with both products on
// `vdpbf16ps`, so no product needs a horizontal sum. Included by paged_attention.cpp inside its
// namespace (it uses Problem, Unit, Scratch, softmax32, ...).
//
// Per tile: the K rows are transposed once into pairs of D values by key (kt: [D/2][32 keys]),
// so a row's 32 scores are D/2 dot-product steps on its query's pairs, each lane one key (the
// unit's rows share the transpose: a prefill chunk's 16 rows pay a sixteenth of it). Each row's
// softmax step is softmax32's; its 32 weights are rounded to bf16 (as the AMX path does) and
// O [row][D] += P . V on V rows interleaved by pairs of keys, lanes = 16 values of D. Every
// output is one fixed chain (D's pairs in order for a score, the tile's key pairs in order for
// O, acc = alpha * acc first): a row's bits depend on its own query and keys only, whatever rows
// share its unit, so decode rows and prefill chunks give the same bits (docs/determinism.md).

// Lane c of out[c] = lane c of in[0..15] as a column: a 16 x 16 transpose of 32-bit values.
__attribute__((always_inline)) inline void transpose16x16(const __m512i* in, __m512i* out) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + k], 128-bit lane L: rows 4i..4i+3 of column 4L + k
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i x0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44), x1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xEE);
    out[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    out[4 + k] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    out[8 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// kt[j][16h + i] = the pair of values 2j, 2j+1 of key row krow[16h + i], for the halves in `halves`.
template <int NC>
inline void dp_keys(const char* const* krow, unsigned halves, uint32_t (*kt)[kTile]) {
  for (int h = 0; h < 2; ++h) {
    if (!(halves >> h & 1)) continue;
    for (int c = 0; c < NC; ++c) {  // 16 pairs (32 values of D) at a time
      __m512i in[16], out[16];
      for (int i = 0; i < 16; ++i) in[i] = _mm512_loadu_si512(krow[16 * h + i] + 64 * c);
      transpose16x16(in, out);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(kt[16 * c + j] + 16 * h, out[j]);
    }
  }
}

// vv[jp][b] = values 16b..16b+15 of keys 2jp (low half of each lane) and 2jp+1, for pairs plo..phi.
template <int NC>
inline void dp_values(const char* const* vrow, int plo, int phi, __m512i (*vv)[2 * NC]) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int jp = plo; jp <= phi; ++jp)
    for (int c = 0; c < NC; ++c) {
      const __m512i x = _mm512_loadu_si512(vrow[2 * jp] + 64 * c), y = _mm512_loadu_si512(vrow[2 * jp + 1] + 64 * c);
      vv[jp][2 * c] = _mm512_permutex2var_epi16(x, lo, y);
      vv[jp][2 * c + 1] = _mm512_permutex2var_epi16(x, hi, y);
    }
}

// Scores of R rows (queries q, D/2 pairs each) over the tile's 32 keys: s[2r + h] = keys
// 16h..16h+15. A half no row sees was not transposed (dp_keys): its lanes are masked out after.
template <int NC, int R>
__attribute__((always_inline)) inline void dp_scores(const uint32_t* q, int64_t d, const uint32_t (*kt)[kTile],
                                                     __m512* s) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int j = 0; j < 16 * NC; ++j) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt[j]), k1 = (__m512bh)_mm512_load_si512(kt[j] + 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * d / 2 + j]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qj, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qj, k1);
    }
  }
  for (int r = 0; r < R; ++r) s[2 * r] = acc[r][0], s[2 * r + 1] = acc[r][1];
}

// acc [R rows][D] = alpha * acc + P . V over key pairs plo..phi (P: the rows' bf16 weights,
// [row][32]). `ahead` (or null): the next tile's K rows then V rows, asked for a pair of keys per
// step so the requests spread over the loop instead of stalling in a burst.
template <int NC, int R>
inline void dp_pv(const uint32_t* pb, const float* alpha, const __m512i (*vv)[2 * NC], int plo, int phi, int64_t d,
                  float* acc, const char* const* ahead, int64_t ahead_bytes) {
  constexpr int VB = 2 * NC;  // zmm of O per row
  __m512 o[R][VB];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int b = 0; b < VB; ++b) o[r][b] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + 16 * b), a);
  }
  for (int jp = plo; jp <= phi; ++jp) {
    if (ahead)
      for (int64_t x = 0; x < ahead_bytes; x += 64)
        for (int i = 2 * jp; i < 2 * jp + 2; ++i) {
          _mm_prefetch(ahead[i] + x, _MM_HINT_T0);
          _mm_prefetch(ahead[kTile + i] + x, _MM_HINT_T0);
        }
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r * kTile / 2 + jp]));
      for (int b = 0; b < VB; ++b) o[r][b] = _mm512_dpbf16_ps(o[r][b], w, (__m512bh)vv[jp][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < VB; ++b) _mm512_storeu_ps(acc + r * d + 16 * b, o[r][b]);
}

// dp_pv over all rows, R at a time, then the rest in one group of fewer.
template <int NC, int R>
inline void dp_pv_rows(int64_t rows, const uint32_t* pb, const float* alpha, const __m512i (*vv)[2 * NC], int plo,
                       int phi, int64_t d, float* acc, const char* const* ahead, int64_t ahead_bytes) {
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    dp_pv<NC, R>(pb + r * kTile / 2, alpha + r, vv, plo, phi, d, acc + r * d, r == 0 ? ahead : nullptr, ahead_bytes);
  if constexpr (R > 1)
    if (r < rows)
      dp_pv_rows<NC, R - 1>(rows - r, pb + r * kTile / 2, alpha + r, vv, plo, phi, d, acc + r * d,
                            r == 0 ? ahead : nullptr, ahead_bytes);
}

// dp_scores of `rows` rows (at most 4), R at a time.
template <int NC, int R = 4>
__attribute__((always_inline)) inline void dp_scores_upto(int64_t rows, const uint32_t* q, int64_t d,
                                                          const uint32_t (*kt)[kTile], __m512* s) {
  if (rows == R)
    dp_scores<NC, R>(q, d, kt, s);
  else if constexpr (R > 1)
    dp_scores_upto<NC, R - 1>(rows, q, d, kt, s);
}

template <int NC>
void run_item_dp(const Problem& p, const Unit& u, int64_t k0, int64_t k1, Scratch& sc, float* m, float* l,
                 float* acc) {
  constexpr int kQkRows = 4;                          // rows whose scores share each kt load
  constexpr int kPvRows = NC == 2 ? 4 : NC == 4 ? 2 : 1;  // rows whose O fits in registers
  const int64_t d = p.head_dim, g = p.group, rows = u.ntok * g;
  const int64_t pos0 = start_item(p, u, true, 16, sc, m, l, acc);
  const int64_t* table = p.block_tables + u.seq * p.bt_stride;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  const char* zero = reinterpret_cast<const char*>(sc.zero.data());
  const uint32_t* q = reinterpret_cast<const uint32_t*>(sc.qb.data());
  uint32_t* pb = reinterpret_cast<uint32_t*>(sc.pb.data());
  alignas(64) uint32_t kt[16 * NC][kTile];
  alignas(64) __m512i vv[kTile / 2][2 * NC];
  const int64_t row_bytes = 2 * d;
  int64_t off[kTile], next[kTile];
  const char* krow[kTile];
  const char* vrow[kTile];
  const char* ahead[2 * kTile];
  uint32_t* live = sc.live.data();
  tile_offsets(p, table, u.kvh, k0, std::min(kTile, k1 - k0), next);
  for (int64_t t0 = k0; t0 < k1; t0 += kTile) {
    const int64_t n = std::min(kTile, k1 - t0);
    std::memcpy(off, next, sizeof(off));
    const bool more = next_tile(p, table, u.kvh, t0, k1, zero, next, ahead);  // asked for while this one runs
    for (int64_t i = 0; i < kTile; ++i) krow[i] = i < n ? kc + off[i] : zero, vrow[i] = i < n ? vc + off[i] : zero;
    int ilo, ihi;
    live_keys(p, t0, n, pos0, rows, live, ilo, ihi);
    if (ilo > ihi) continue;  // no row sees a key of this tile
    dp_keys<NC>(krow, (ilo < 16 ? 1u : 0u) | (ihi >= 16 ? 2u : 0u), kt);
    for (int64_t r = 0; r < rows; r += kQkRows) {
      __m512 s[2 * kQkRows];
      const int64_t nr = std::min<int64_t>(kQkRows, rows - r);
      dp_scores_upto<NC, kQkRows>(nr, q + r * d / 2, d, kt, s);
      for (int64_t i = 0; i < nr; ++i) {
        const uint32_t lv = live[r + i];
        float* w = sc.w.data() + (r + i) * kTile;
        sc.alpha[r + i] = softmax32(p, s[2 * i], s[2 * i + 1], static_cast<__mmask16>(lv),
                                    static_cast<__mmask16>(lv >> 16), m[r + i], sc.lsum.data() + (r + i) * 16, w);
        _mm512_storeu_si512(pb + (r + i) * kTile / 2,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + 16), _mm512_loadu_ps(w)));
      }
    }
    dp_values<NC>(vrow, ilo / 2, ihi / 2, vv);
    dp_pv_rows<NC, kPvRows>(rows, pb, sc.alpha.data(), vv, ilo / 2, ihi / 2, d, acc, more ? ahead : nullptr,
                            row_bytes);
  }
  for (int64_t r = 0; r < rows; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(sc.lsum.data() + r * 16));
}
