// bf16 queries over a bf16 cache on AMX tiles: run_item_fast's contract (one unit's rows over
// keys [k0, k1) in tiles of 32, online softmax) with both products on the tiles. Included by
// paged_attention.cpp inside its namespace (it uses Problem, Unit, Scratch, softmax32, ...).
//
// Per tile: S^T [32 keys][rows] = K . Q^T with the K rows read in place as A tiles (no transpose
// of the cache) and the unit's queries as VNNI B tiles made once per item; S^T is transposed in
// registers, each row's softmax step is softmax32's, its 32 weights rounded to bf16 (the A tile
// P), and O [rows][D] = P . V with V made into VNNI B tiles (pairs of keys interleaved). A
// tile's products are exact in fp32 and summed in one fixed chain per output (D in order for a
// score, the tile's keys in order for O), and acc = alpha * acc + O per tile: each row's result
// is a function of its own query and keys, whatever rows share its unit (docs/determinism.md),
// so decode rows and prefill chunks, one row or sixteen, give the same bits.

constexpr int64_t kAmxMaxRows = kvpool_amx::kTileRows;  // a unit's rows must fit one A tile of P
constexpr int64_t kSoftmaxRowsMax = 6;
constexpr int64_t kAhead = 2;  // a decode row's keys are asked for this many tiles ahead  // up to this many rows, the softmax runs row by row (same bits)

// One item's tile buffers (64-byte rows), on the stack.
struct AmxScratch {
  alignas(64) uint32_t qt[8][16][16];   // Q^T per 32-value chunk of D: [pair of D][row] (D <= 256)
  alignas(64) uint16_t k[2][16 * 256];  // a half tile's 16 key rows when they are not 16 cache rows apart
  alignas(64) float st[2][32][16];      // S^T of this tile and the next: [key][row]
  alignas(64) uint16_t pa[16][32];      // P: [row][key] in bf16
  alignas(64) uint16_t vb[16][16][32];  // V per 16 values of D: [pair of keys][value][2] (D <= 256)
  alignas(64) float o[4][16][16];       // 4 column blocks of O: [row][value]
  alignas(64) float alpha[16];          // each row's factor on its previous acc
  alignas(64) float m[16], lsum[16];     // each row's running max and sum (lanes of lsum16)
};

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

// The unit's query rows as Q^T B tiles: qt[c][j][r] = the pair of bf16 values 2j, 2j+1 of chunk
// c (32 values) of row r; rows past `rows` zero.
void amx_queries(const Scratch& sc, int64_t rows, int64_t d, AmxScratch& ax) {
  std::memset(ax.qt, 0, sizeof(uint32_t) * 16 * 16 * (d / 32));
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(sc.qb.data() + r * d);
    for (int64_t c = 0; c < d / 32; ++c)
      for (int j = 0; j < 16; ++j) ax.qt[c][j][r] = q[16 * c + j];
  }
}

// V rows of one tile as B tiles: vb[b][j] = values 16b..16b+15 of keys 2j and 2j+1 interleaved.
void amx_values(const char* const* vrow, int64_t d, AmxScratch& ax) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int j = 0; j < 16; ++j)
    for (int64_t c = 0; c < d / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(vrow[2 * j] + 64 * c), y = _mm512_loadu_si512(vrow[2 * j + 1] + 64 * c);
      _mm512_store_si512(ax.vb[2 * c][j], _mm512_permutex2var_epi16(x, lo, y));
      _mm512_store_si512(ax.vb[2 * c + 1][j], _mm512_permutex2var_epi16(x, hi, y));
    }
}

// Where half h's 16 key rows start for tileloadd, and their stride: in place when they are 16
// cache rows apart, else copied to ax.k[h].
inline const char* key_rows(int h, const char* const* krow, int64_t d, int64_t& stride, AmxScratch& ax) {
  if (stride) return krow[16 * h];
  for (int i = 0; i < 16; ++i) std::memcpy(ax.k[h] + i * d, krow[16 * h + i], d * 2);
  stride = d * 2;
  return reinterpret_cast<const char*>(ax.k[h]);
}

// S^T [32 keys][rows] = K . Q^T on tiles 0 (keys 0-15) and 1 (16-31), both chains in flight
// together; `store_scores` writes them out. The tile macros take literal tile numbers.
void issue_scores(const char* const* krow, int64_t n, int64_t d, int64_t stride, AmxScratch& ax) {
  int64_t s0 = stride, s1 = stride;
  const char* k0 = key_rows(0, krow, d, s0, ax);
  const char* k1 = n > 16 ? key_rows(1, krow, d, s1, ax) : nullptr;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < d / 32; ++c) {
    _tile_loadd(4, ax.qt[c], 64);
    _tile_loadd(2, k0 + 64 * c, s0);
    _tile_dpbf16ps(0, 2, 4);
    if (k1) {
      _tile_loadd(3, k1 + 64 * c, s1);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
}

// Both halves, so S^T past n is 0 (tile 1 was zeroed).
inline void store_scores(float (*st)[16]) {
  _tile_stored(0, st[0], 64);
  _tile_stored(1, st[16], 64);
}

// O = P . V for up to 4 column blocks from b0: P in tile 5, V in 2, 3, 4 (then 2 again), O in
// 0, 1, 6, 7, all four chains in flight together.
void amx_pv(int64_t b0, int64_t nb, AmxScratch& ax) {
  _tile_loadd(5, ax.pa, 64);
  _tile_zero(0);
  _tile_loadd(2, ax.vb[b0], 64);
  _tile_dpbf16ps(0, 5, 2);
  if (nb > 1) {
    _tile_zero(1);
    _tile_loadd(3, ax.vb[b0 + 1], 64);
    _tile_dpbf16ps(1, 5, 3);
  }
  if (nb > 2) {
    _tile_zero(6);
    _tile_loadd(4, ax.vb[b0 + 2], 64);
    _tile_dpbf16ps(6, 5, 4);
  }
  if (nb > 3) {
    _tile_zero(7);
    _tile_loadd(2, ax.vb[b0 + 3], 64);
    _tile_dpbf16ps(7, 5, 2);
  }
  _tile_stored(0, ax.o[0], 64);
  if (nb > 1) _tile_stored(1, ax.o[1], 64);
  if (nb > 2) _tile_stored(6, ax.o[2], 64);
  if (nb > 3) _tile_stored(7, ax.o[3], 64);
}

// The online-softmax step of all rows at once over a tile's n scores at st (lanes = rows;
// `live` [32]: the rows that see each key; scores past n are 0): updates m and lsum (lane
// vectors), writes P into ax.pa and each row's factor on its previous acc into ax.alpha. The
// scaled scores go back into st; every loop is unrolled so the partial results stay in registers.
inline void amx_softmax(const Problem& p, float (*st)[16], int64_t n, const __mmask16* live, AmxScratch& ax) {
  const __m512 m = _mm512_load_ps(ax.m);
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
      for (int r = 0; r < 16; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(ax.pa[r] + 16), _mm256_setzero_si256());
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
      _mm256_store_si256(reinterpret_cast<__m256i*>(ax.pa[r] + 16 * h), reinterpret_cast<const __m256i&>(w));
    }
  }
  const __m512 total = _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3]));
  _mm512_store_ps(ax.lsum, _mm512_fmadd_ps(_mm512_load_ps(ax.lsum), alpha, total));
  _mm512_store_ps(ax.m, m_new);
  _mm512_store_ps(ax.alpha, alpha);
}

// amx_softmax's arithmetic one row at a time, for units of a few rows (decode): the same
// elementwise steps on the row's 32 scores (gathered from S^T), its sum in the same order (key k
// into part k % 4, keys ascending), so the bits are amx_softmax's.
inline void amx_softmax_rows(const Problem& p, float (*st)[16], int64_t n, const __mmask16* live, int64_t rows,
                             AmxScratch& ax) {
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
    const float m = ax.m[r];
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
      _mm256_store_si256(reinterpret_cast<__m256i*>(ax.pa[r] + 16 * h), reinterpret_cast<const __m256i&>(w));
    }
    __m128 part = _mm512_castps512_ps128(e[0]);  // keys 0-3, then each next 4 in order
    part = _mm_add_ps(part, _mm512_extractf32x4_ps(e[0], 1));
    part = _mm_add_ps(part, _mm512_extractf32x4_ps(e[0], 2));
    part = _mm_add_ps(part, _mm512_extractf32x4_ps(e[0], 3));
    for (int i = 0; i < 4; ++i) part = _mm_add_ps(part, i == 0 ? _mm512_castps512_ps128(e[1]) : i == 1 ? _mm512_extractf32x4_ps(e[1], 1) : i == 2 ? _mm512_extractf32x4_ps(e[1], 2) : _mm512_extractf32x4_ps(e[1], 3));
    alignas(16) float q[4];
    _mm_store_ps(q, part);
    const float total = (q[0] + q[1]) + (q[2] + q[3]);
    ax.lsum[r] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(ax.lsum[r]), _mm_set_ss(alpha), _mm_set_ss(total)));
    ax.m[r] = m_new;
    ax.alpha[r] = alpha;
  }
}

void run_item_amx(const Problem& p, const Unit& u, int64_t k0, int64_t k1, Scratch& sc, float* m, float* l,
                  float* acc) {
  const int64_t d = p.head_dim, g = p.group, rows = u.ntok * g;
  const int64_t qlen = p.query_start[u.seq + 1] - p.query_start[u.seq];
  const int64_t pos0 = p.seq_lens[u.seq] - qlen + u.tok0;
  AmxScratch ax;  // the tile configuration was loaded for the thread's items (paged_attention_out)
  load_queries(p, u, true, sc);
  amx_queries(sc, rows, d, ax);
  std::fill(acc, acc + rows * d, 0.f);
  alignas(64) int32_t pos_lanes[16];
  for (int r = 0; r < 16; ++r) pos_lanes[r] = static_cast<int32_t>(pos0 + r / g);
  const __m512i pos = _mm512_load_si512(pos_lanes);
  const __mmask16 row_lanes = static_cast<__mmask16>((1u << rows) - 1);
  _mm512_store_ps(ax.m, _mm512_set1_ps(kNegInf));
  _mm512_store_ps(ax.lsum, _mm512_setzero_ps());
  const bool by_rows = rows <= kSoftmaxRowsMax;
  const int64_t* table = p.block_tables + u.seq * p.bt_stride;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  const char* zero = reinterpret_cast<const char*>(sc.zero.data());
  // 16 keys from a multiple of 16 share a block, so their rows are one stride apart
  const int64_t row_bytes = p.kv_width * 2, key_stride = p.block_size % 16 == 0 ? p.kv_heads * row_bytes : 0;
  // A decode row's keys are cold (a step's layers apart): asked for a tile ahead. A prefill
  // chunk's were just written, and each unit of the chunk reads them again.
  const bool ask_ahead = u.ntok == 1;
  // Tiles run as a pipeline: the next tile's scores are on the tiles while this one's softmax
  // runs on the vector units.
  struct Tile {
    int64_t t0, n;
    const char* krow[kTile];
    const char* vrow[kTile];
    __mmask16 live[kTile];
  } tiles[2];
  int64_t off[kTile];
  const int64_t pos_last = pos0 + u.ntok - 1;
  // Keys [t0 + 8 q, t0 + 8 q + 8) of the tile at t0, K and V rows asked for: a tile in four
  // parts spread over the work of the one before it (a burst would wait on full fill buffers).
  const auto ask_for = [&](int64_t t0, int q) {
    const int64_t a = t0 + 8 * q, n = std::min<int64_t>(8, k1 - a);
    if (!ask_ahead || n <= 0) return;
    tile_offsets(p, table, u.kvh, a, n, off);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(kc + off[i] + b, _MM_HINT_T1), _mm_prefetch(vc + off[i] + b, _MM_HINT_T1);
  };
  for (int64_t a = 1; a < kAhead; ++a)
    for (int q = 0; q < 4; ++q) ask_for(k0 + a * kTile, q);
  // The next tile from t0 that some row sees (k1 if none): its keys, rows and live masks.
  const auto prepare = [&](int64_t t0, Tile& t) -> int64_t {
    for (; t0 < k1; t0 += kTile) {
      t.t0 = t0;
      t.n = std::min(kTile, k1 - t0);
      if (t0 + t.n - 1 <= pos0 && (!p.window || pos_last - t0 < p.window)) {  // every row sees every key
        for (int64_t i = 0; i < kTile; ++i) t.live[i] = i < t.n ? row_lanes : 0;
        break;
      }
      __mmask16 any = 0;
      for (int64_t i = 0; i < kTile; ++i) {
        t.live[i] = 0;
        if (i < t.n) {
          const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t0 + i));
          t.live[i] = _mm512_mask_cmpge_epi32_mask(row_lanes, pos, key);
          if (p.window)
            t.live[i] = _mm512_mask_cmplt_epi32_mask(t.live[i], _mm512_sub_epi32(pos, key),
                                                     _mm512_set1_epi32(static_cast<int32_t>(p.window)));
        }
        any |= t.live[i];
      }
      if (any) break;
    }
    if (t0 >= k1) return k1;
    if (key_stride) {  // two halves of 16 rows one stride apart
      for (int64_t h = 0; h < 2 && t0 + 16 * h < k1; ++h) {
        const int64_t key = t0 + 16 * h;
        const int64_t at = ((table[key / p.block_size] * p.block_size + key % p.block_size) * p.kv_heads + u.kvh) * row_bytes;
        for (int64_t i = 0; i < 16; ++i) t.krow[16 * h + i] = kc + at + i * key_stride, t.vrow[16 * h + i] = vc + at + i * key_stride;
      }
      // keys past n of a half that starts before k1 are in its (allocated) block: read, then masked
      for (int64_t i = (t.n + 15) / 16 * 16; i < kTile; ++i) t.krow[i] = zero;
    } else {
      tile_offsets(p, table, u.kvh, t0, t.n, off);
      for (int64_t i = 0; i < t.n; ++i) t.krow[i] = kc + off[i], t.vrow[i] = vc + off[i];
      for (int64_t i = t.n; i < kTile; ++i) t.krow[i] = zero;
    }
    for (int64_t i = t.n; i < kTile; ++i) t.vrow[i] = zero;  // weight 0 times V 0, whatever the slot holds
    return t0;
  };
  int64_t cur = prepare(k0, tiles[0]);
  if (cur < k1) {
    issue_scores(tiles[0].krow, tiles[0].n, d, key_stride, ax);
    store_scores(ax.st[0]);
  }
  for (int64_t i = 0; cur < k1; i ^= 1) {
    const Tile& t = tiles[i];
    const int64_t next = prepare(cur + kTile, tiles[i ^ 1]), ahead = cur + kAhead * kTile;
    ask_for(ahead, 0);
    if (next < k1) issue_scores(tiles[i ^ 1].krow, tiles[i ^ 1].n, d, key_stride, ax);
    ask_for(ahead, 1);
    if (by_rows)
      amx_softmax_rows(p, ax.st[i], t.n, t.live, rows, ax);
    else
      amx_softmax(p, ax.st[i], t.n, t.live, ax);
    ask_for(ahead, 2);
    if (next < k1) store_scores(ax.st[i ^ 1]);
    amx_values(t.vrow, d, ax);
    ask_for(ahead, 3);
    for (int64_t b0 = 0; b0 < d / 16; b0 += 4) {
      const int64_t nb = std::min<int64_t>(4, d / 16 - b0);
      amx_pv(b0, nb, ax);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 a = _mm512_set1_ps(ax.alpha[r]);
        for (int64_t b = 0; b < nb; ++b) {
          float* x = acc + r * d + 16 * (b0 + b);
          _mm512_storeu_ps(x, _mm512_fmadd_ps(_mm512_loadu_ps(x), a, _mm512_load_ps(ax.o[b][r])));
        }
      }
    }
    cur = next;
  }
  for (int64_t r = 0; r < rows; ++r) m[r] = ax.m[r], l[r] = ax.lsum[r];
}
