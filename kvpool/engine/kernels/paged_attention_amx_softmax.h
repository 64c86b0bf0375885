// The online-softmax step of the AMX attention (paged_attention_amx.h, which includes this inside
// paged_attention.cpp's namespace): a tile's 32 scores per row in, the row's P (bf16), its
// factor on the previous acc and its running max and sum out, all rows at once or row by row with
// the same bits.

// In place: r[i] becomes column i of the 16 x 16 matrix whose rows were r.
__attribute__((always_inline)) inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  __m512 out[16];
  for (int c = 0; c < 4; ++c) {
    const __m512 a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    const __m512 e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    out[c] = _mm512_shuffle_f32x4(a, e, 0x88);
    out[8 + c] = _mm512_shuffle_f32x4(a, e, 0xDD);
    out[4 + c] = _mm512_shuffle_f32x4(b, f, 0x88);
    out[12 + c] = _mm512_shuffle_f32x4(b, f, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = out[i];
}

// The online-softmax step of all rows at once over a tile's n scores at st (lanes = rows;
// `live` [32]: the rows that see each key; scores past n are 0): updates m and lsum (lane
// vectors) of row block b, writes its P into ax.pa[b] and each row's factor on its previous acc
// into alpha_out. The scaled scores go back into st; every loop is unrolled so the partial
// results stay in registers.
inline void amx_softmax(const Problem& p, float (*st)[16], int64_t n, const __mmask16* live, int64_t b,
                        float* alpha_out, AmxScratch& ax) {
  const __m512 m = _mm512_load_ps(ax.m[b]);
  const __m512 ninf = _mm512_set1_ps(kNegInf), scale = _mm512_set1_ps(p.scale);
  const int halves = n > 16 ? 2 : 1;
  __m512 top[4] = {ninf, ninf, ninf, ninf};
  for (int h = 0; h < halves; ++h) {
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      __m512 x = _mm512_mul_ps(_mm512_load_ps(st[16 * h + k]), scale);
      if (p.softcap > 0.f) {
        alignas(64) float c[16];
        _mm512_store_ps(c, x);
        for (int i = 0; i < 16; ++i) c[i] = p.softcap * std::tanh(c[i] / p.softcap);
        x = _mm512_load_ps(c);
      }
      _mm512_store_ps(st[16 * h + k], x);
      top[k % 4] = _mm512_mask_max_ps(top[k % 4], live[16 * h + k], top[k % 4], x);
    }
  }
  const __m512 m_new = _mm512_max_ps(m, _mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
  // acc's factor: 1 where the max stays (rows that saw nothing yet included), 0 where a row sees its first keys
  __m512 alpha = _mm512_mask_mov_ps(exp16(_mm512_sub_ps(m, m_new)), _mm512_cmp_ps_mask(m, ninf, _CMP_EQ_OQ),
                                    _mm512_setzero_ps());
  alpha = _mm512_mask_mov_ps(alpha, _mm512_cmp_ps_mask(m, m_new, _CMP_EQ_OQ), _mm512_set1_ps(1.f));
  // Weights below e^-80 are dropped: they change nothing and would make denormal products.
  const __m512 floor = _mm512_set1_ps(-80.0f);
  __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int h = 0; h < 2; ++h) {
    if (h == halves) {
      for (int r = 0; r < 16; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(ax.pa[b][r] + 16), _mm256_setzero_si256());
      break;
    }
    __m512 e[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      const __m512 diff = _mm512_sub_ps(_mm512_load_ps(st[16 * h + k]), m_new);
      e[k] = _mm512_maskz_mov_ps(live[16 * h + k] & _mm512_cmp_ps_mask(diff, floor, _CMP_GE_OQ), exp16(diff));
      part[k % 4] = _mm512_add_ps(part[k % 4], e[k]);
    }
    transpose16(e);  // e[r]: row r's weights for the half's 16 keys
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const __m256bh w = _mm512_cvtneps_pbh(e[r]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ax.pa[b][r] + 16 * h), reinterpret_cast<const __m256i&>(w));
    }
  }
  const __m512 total = _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3]));
  _mm512_store_ps(ax.lsum[b], _mm512_fmadd_ps(_mm512_load_ps(ax.lsum[b]), alpha, total));
  _mm512_store_ps(ax.m[b], m_new);
  _mm512_store_ps(alpha_out, alpha);
}

// amx_softmax's arithmetic one row at a time, for units of a few rows (decode): the same
// elementwise steps on the row's 32 scores (gathered from S^T), its sum in the same order (key k
// into part k % 4, keys ascending), so the bits are amx_softmax's.
inline void amx_softmax_rows(const Problem& p, float (*st)[16], int64_t n, const __mmask16* live, int64_t rows,
                             float* alpha_out, AmxScratch& ax) {
  const __m512 ninf = _mm512_set1_ps(kNegInf), scale = _mm512_set1_ps(p.scale), floor = _mm512_set1_ps(-80.0f);
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t keys = 0;
    for (int64_t k = 0; k < n; ++k) keys |= ((live[k] >> r) & 1u) << k;
    const __mmask16 live0 = static_cast<__mmask16>(keys), live1 = static_cast<__mmask16>(keys >> 16);
    const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int32_t>(r)));
    __m512 x[2] = {_mm512_mul_ps(_mm512_i32gather_ps(at, &st[0][0], 4), scale),
                   n > 16 ? _mm512_mul_ps(_mm512_i32gather_ps(at, &st[16][0], 4), scale) : _mm512_setzero_ps()};
    if (p.softcap > 0.f)
      for (auto& v : x) {
        alignas(64) float c[16];
        _mm512_store_ps(c, v);
        for (int i = 0; i < 16; ++i) c[i] = p.softcap * std::tanh(c[i] / p.softcap);
        v = _mm512_load_ps(c);
      }
    const float m = ax.m[0][r];
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(ninf, live0, x[0]), _mm512_mask_mov_ps(ninf, live1, x[1])));
    const float m_new = std::max(m, top);
    const float alpha = m == m_new ? 1.f : m == kNegInf ? 0.f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m - m_new)));
    const __m512 mb = _mm512_set1_ps(m_new);
    __m512 e[2];
    for (int h = 0; h < 2; ++h) {
      const __mmask16 lv = h ? live1 : live0;
      const __m512 diff = _mm512_sub_ps(x[h], mb);
      e[h] = lv ? _mm512_maskz_mov_ps(lv & _mm512_cmp_ps_mask(diff, floor, _CMP_GE_OQ), exp16(diff)) : _mm512_setzero_ps();
      const __m256bh w = _mm512_cvtneps_pbh(e[h]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ax.pa[0][r] + 16 * h), reinterpret_cast<const __m256i&>(w));
    }
    __m128 part = _mm512_castps512_ps128(e[0]);  // keys 0-3, then each next 4 in order
    part = _mm_add_ps(part, _mm512_extractf32x4_ps(e[0], 1));
    part = _mm_add_ps(part, _mm512_extractf32x4_ps(e[0], 2));
    part = _mm_add_ps(part, _mm512_extractf32x4_ps(e[0], 3));
    for (int i = 0; i < 4; ++i) part = _mm_add_ps(part, i == 0 ? _mm512_castps512_ps128(e[1]) : i == 1 ? _mm512_extractf32x4_ps(e[1], 1) : i == 2 ? _mm512_extractf32x4_ps(e[1], 2) : _mm512_extractf32x4_ps(e[1], 3));
    alignas(16) float q[4];
    _mm_store_ps(q, part);
    const float total = (q[0] + q[1]) + (q[2] + q[3]);
    ax.lsum[0][r] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(ax.lsum[0][r]), _mm_set_ss(alpha), _mm_set_ss(total)));
    ax.m[0][r] = m_new;
    alpha_out[r] = alpha;
  }
}
