// bf16 queries over a bf16 cache on AMX tiles: run_item_fast's contract (one unit's rows over
// keys [k0, k1) in tiles of 32, online softmax) with both products on the tiles. Included by
// paged_attention.cpp inside its namespace (it uses Problem, Unit, Scratch, softmax32, ...).
//
// Per tile: S^T [32 keys][rows] = K . Q^T with the K rows read in place as A tiles (no transpose
// of the cache) and the unit's queries as VNNI B tiles made once per item; S^T is transposed in
// registers, each row's softmax step is softmax32's, its 32 weights rounded to bf16 (the A tile
// P), and O [rows][D] = P . V with V made into VNNI B tiles (pairs of keys interleaved: once
// per call for a chunk's whole tiles, `share_values`). A unit of up to 32 rows is two row blocks
// that share each K and V tile load (a prefill chunk's units); decode rows take one. A
// tile's products are exact in fp32 and summed in one fixed chain per output (D in order for a
// score, the tile's keys in order for O), and acc = alpha * acc + O per tile: each row's result
// is a function of its own query and keys, whatever rows share its unit (docs/determinism.md),
// so decode rows and prefill chunks, one row or thirty-two, give the same bits.

constexpr int64_t kBlockRows = kvpool_amx::kTileRows;  // rows of one A tile of P
constexpr int64_t kAmxMaxRows = 2 * kBlockRows;         // a unit's rows: two row blocks share each K and V tile
constexpr int64_t kSoftmaxRowsMax = 6;  // up to this many rows, the softmax runs row by row (same bits)
constexpr int64_t kAhead = 2;  // a decode row's keys are asked for this many tiles ahead

constexpr int64_t kNotShared = std::numeric_limits<int64_t>::min();  // no shared V for the unit
using ValueTiles = uint16_t[16][32];  // a tile's V per 16 values of D: [pair of keys][value][2]

// One item's tile buffers (64-byte rows), on the stack; [b]: row block b (rows 16b..16b+15).
struct AmxScratch {
  alignas(64) uint32_t qt[2][8][16][16];  // Q^T per 32-value chunk of D: [pair of D][row] (D <= 256)
  alignas(64) uint16_t k[2][16 * 256];    // a half tile's 16 key rows when they are not 16 cache rows apart
  alignas(64) float st[2][2][32][16];     // S^T of this tile and the next: [key][row]
  alignas(64) uint16_t pa[2][16][32];     // P: [row][key] in bf16
  alignas(64) ValueTiles vb[16];          // the tile's V (D <= 256) when it is not in p.shared_values
  alignas(64) float o[2][4][16][16];      // up to 4 column blocks of O: [row][value]
  alignas(64) float alpha[2][16];         // each row's factor on its previous acc
  alignas(64) float m[2][16], lsum[2][16];  // each row's running max and sum (lanes of lsum16)
};

#include "paged_attention_amx_softmax.h"  // transpose16, amx_softmax, amx_softmax_rows

// The unit's query rows as Q^T B tiles: qt[b][c][j][r] = the pair of bf16 values 2j, 2j+1 of
// chunk c (32 values) of row 16b + r; rows past `rows` zero.
void amx_queries(const Scratch& sc, int64_t rows, int64_t d, AmxScratch& ax) {
  for (int64_t b = 0; b < (rows + kBlockRows - 1) / kBlockRows; ++b)
    std::memset(ax.qt[b], 0, sizeof(uint32_t) * 16 * 16 * (d / 32));
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(sc.qb.data() + r * d);
    for (int64_t c = 0; c < d / 32; ++c)
      for (int j = 0; j < 16; ++j) ax.qt[r / kBlockRows][c][j][r % kBlockRows] = q[16 * c + j];
  }
}

// V rows of one tile as B tiles: vb[b][j] = values 16b..16b+15 of keys 2j and 2j+1 interleaved.
void amx_values(const char* const* vrow, int64_t d, ValueTiles* vb) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int j = 0; j < 16; ++j)
    for (int64_t c = 0; c < d / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(vrow[2 * j] + 64 * c), y = _mm512_loadu_si512(vrow[2 * j + 1] + 64 * c);
      _mm512_storeu_si512(vb[2 * c][j], _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(vb[2 * c + 1][j], _mm512_permutex2var_epi16(x, hi, y));
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

// S^T [32 keys][rows] = K . Q^T: row block 0 on tiles 0 (keys 0-15) and 1 (16-31), block 1 on
// 6 and 7, every chain in flight together and each K tile loaded once for both blocks;
// `store_scores` writes them out. The tile macros take literal tile numbers.
void issue_scores(const char* const* krow, int64_t n, int64_t d, int64_t stride, int64_t blocks, AmxScratch& ax) {
  int64_t s0 = stride, s1 = stride;
  const char* k0 = key_rows(0, krow, d, s0, ax);
  const char* k1 = n > 16 ? key_rows(1, krow, d, s1, ax) : nullptr;
  const bool two = blocks > 1;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t c = 0; c < d / 32; ++c) {
    _tile_loadd(4, ax.qt[0][c], 64);
    if (two) _tile_loadd(5, ax.qt[1][c], 64);
    _tile_loadd(2, k0 + 64 * c, s0);
    _tile_dpbf16ps(0, 2, 4);
    if (two) _tile_dpbf16ps(6, 2, 5);
    if (k1) {
      _tile_loadd(3, k1 + 64 * c, s1);
      _tile_dpbf16ps(1, 3, 4);
      if (two) _tile_dpbf16ps(7, 3, 5);
    }
  }
}

// Both halves, so S^T past n is 0 (tiles 1 and 7 were zeroed).
inline void store_scores(float (*st)[32][16], int64_t blocks) {
  _tile_stored(0, st[0][0], 64);
  _tile_stored(1, st[0][16], 64);
  if (blocks > 1) {
    _tile_stored(6, st[1][0], 64);
    _tile_stored(7, st[1][16], 64);
  }
}

// O = P . V for up to 4 column blocks from b0: P in tile 5, V in 2, 3, 4 (then 2 again), O in
// 0, 1, 6, 7, all four chains in flight together.
void amx_pv(int64_t b0, int64_t nb, const ValueTiles* vb, AmxScratch& ax) {
  _tile_loadd(5, ax.pa[0], 64);
  _tile_zero(0);
  _tile_loadd(2, vb[b0], 64);
  _tile_dpbf16ps(0, 5, 2);
  if (nb > 1) {
    _tile_zero(1);
    _tile_loadd(3, vb[b0 + 1], 64);
    _tile_dpbf16ps(1, 5, 3);
  }
  if (nb > 2) {
    _tile_zero(6);
    _tile_loadd(4, vb[b0 + 2], 64);
    _tile_dpbf16ps(6, 5, 4);
  }
  if (nb > 3) {
    _tile_zero(7);
    _tile_loadd(2, vb[b0 + 3], 64);
    _tile_dpbf16ps(7, 5, 2);
  }
  _tile_stored(0, ax.o[0][0], 64);
  if (nb > 1) _tile_stored(1, ax.o[0][1], 64);
  if (nb > 2) _tile_stored(6, ax.o[0][2], 64);
  if (nb > 3) _tile_stored(7, ax.o[0][3], 64);
}

// amx_pv for both row blocks, up to 2 column blocks from b0: P in tiles 5 and 4 (loaded by the
// first pass, b0 = 0), V in 2 and 3 (each loaded once for both blocks), O in 0, 1 (block 0) and
// 6, 7 (block 1).
void amx_pv2(int64_t b0, int64_t nb, const ValueTiles* vb, AmxScratch& ax) {
  if (b0 == 0) {
    _tile_loadd(5, ax.pa[0], 64);
    _tile_loadd(4, ax.pa[1], 64);
  }
  _tile_zero(0);
  _tile_zero(6);
  _tile_loadd(2, vb[b0], 64);
  _tile_dpbf16ps(0, 5, 2);
  _tile_dpbf16ps(6, 4, 2);
  if (nb > 1) {
    _tile_zero(1);
    _tile_zero(7);
    _tile_loadd(3, vb[b0 + 1], 64);
    _tile_dpbf16ps(1, 5, 3);
    _tile_dpbf16ps(7, 4, 3);
  }
  _tile_stored(0, ax.o[0][0], 64);
  _tile_stored(6, ax.o[1][0], 64);
  if (nb > 1) {
    _tile_stored(1, ax.o[0][1], 64);
    _tile_stored(7, ax.o[1][1], 64);
  }
}

// `blocks`: the unit's row blocks (1 or 2), fixed at compile time so a decode row's loops stay lean
template <int64_t blocks>
void run_item_amx_blocks(const Problem& p, const Unit& u, int64_t k0, int64_t k1, Scratch& sc, float* m, float* l,
                         float* acc) {
  const int64_t d = p.head_dim, g = p.group, rows = u.ntok * g;
  const int64_t qlen = p.query_start[u.seq + 1] - p.query_start[u.seq];
  const int64_t pos0 = p.seq_lens[u.seq] - qlen + u.tok0;
  AmxScratch ax;  // the tile configuration was loaded for the thread's items (paged_attention_out)
  load_queries(p, u, true, sc);
  amx_queries(sc, rows, d, ax);
  std::fill(acc, acc + rows * d, 0.f);
  alignas(64) int32_t pos_lanes[blocks][16];  // each row's position (row r is token r / g)
  for (int64_t r = 0, t = 0, j = 0; r < blocks * 16; ++r, t += ++j == g, j %= g)
    pos_lanes[r / 16][r % 16] = static_cast<int32_t>(pos0 + t);
  __m512i pos[blocks];
  for (int64_t b = 0; b < blocks; ++b) pos[b] = _mm512_load_si512(pos_lanes[b]);
  const __mmask16 row_lanes[2] = {static_cast<__mmask16>((1u << std::min<int64_t>(rows, 16)) - 1),
                                  static_cast<__mmask16>((1u << std::max<int64_t>(rows - 16, 0)) - 1)};
  for (int64_t b = 0; b < blocks; ++b) {
    _mm512_store_ps(ax.m[b], _mm512_set1_ps(kNegInf));
    _mm512_store_ps(ax.lsum[b], _mm512_setzero_ps());
  }
  const bool by_rows = rows <= kSoftmaxRowsMax;
  const int64_t* table = p.block_tables + u.seq * p.bt_stride;
  const char* kc = static_cast<const char*>(p.k_cache);
  const char* vc = static_cast<const char*>(p.v_cache);
  const char* zero = reinterpret_cast<const char*>(sc.zero.data());
  const int64_t shared_at = p.shared_values ? p.shared_values_at[u.seq * p.kv_heads + u.kvh] : kNotShared;
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
    __mmask16 live[2][kTile];  // by block: the rows that see each key
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
        for (int64_t b = 0; b < blocks; ++b)
          for (int64_t i = 0; i < kTile; ++i) t.live[b][i] = i < t.n ? row_lanes[b] : 0;
        break;
      }
      __mmask16 any = 0;
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t i = 0; i < kTile; ++i) {
          t.live[b][i] = 0;
          if (i < t.n) {
            const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t0 + i));
            t.live[b][i] = _mm512_mask_cmpge_epi32_mask(row_lanes[b], pos[b], key);
            if (p.window)
              t.live[b][i] = _mm512_mask_cmplt_epi32_mask(t.live[b][i], _mm512_sub_epi32(pos[b], key),
                                                          _mm512_set1_epi32(static_cast<int32_t>(p.window)));
          }
          any |= t.live[b][i];
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
    issue_scores(tiles[0].krow, tiles[0].n, d, key_stride, blocks, ax);
    store_scores(ax.st[0], blocks);
  }
  for (int64_t i = 0; cur < k1; i ^= 1) {
    const Tile& t = tiles[i];
    const int64_t next = prepare(cur + kTile, tiles[i ^ 1]), ahead = cur + kAhead * kTile;
    ask_for(ahead, 0);
    if (next < k1) issue_scores(tiles[i ^ 1].krow, tiles[i ^ 1].n, d, key_stride, blocks, ax);
    ask_for(ahead, 1);
    if (by_rows)
      amx_softmax_rows(p, ax.st[i][0], t.n, t.live[0], rows, ax.alpha[0], ax);
    else
      for (int64_t b = 0; b < blocks; ++b) amx_softmax(p, ax.st[i][b], t.n, t.live[b], b, ax.alpha[b], ax);
    ask_for(ahead, 2);
    if (next < k1) store_scores(ax.st[i ^ 1], blocks);
    // a whole tile's V as B tiles: made once for the chunk (shared_values), else made here
    const ValueTiles* vb = ax.vb;
    if (shared_at != kNotShared && t.n == kTile)
      vb = reinterpret_cast<const ValueTiles*>(p.shared_values + shared_at + t.t0 * d);
    else
      amx_values(t.vrow, d, ax.vb);
    ask_for(ahead, 3);
    const int64_t step = blocks > 1 ? 2 : 4;  // column blocks per pass
    for (int64_t b0 = 0; b0 < d / 16; b0 += step) {
      const int64_t nb = std::min<int64_t>(step, d / 16 - b0);
      if (blocks > 1)
        amx_pv2(b0, nb, vb, ax);
      else
        amx_pv(b0, nb, vb, ax);
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int64_t r = 0; r < std::min(kBlockRows, rows - kBlockRows * blk); ++r) {
          const __m512 a = _mm512_set1_ps(ax.alpha[blk][r]);
          float* x = acc + (kBlockRows * blk + r) * d + 16 * b0;
          const auto update = [&](int64_t b) {
            _mm512_storeu_ps(x + 16 * b, _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * b), a, _mm512_load_ps(ax.o[blk][b][r])));
          };
          if (nb == 2) {
            update(0);
            update(1);
          } else {
            for (int64_t b = 0; b < nb; ++b) update(b);
          }
        }
    }
    cur = next;
  }
  for (int64_t r = 0; r < rows; ++r) m[r] = ax.m[r / 16][r % 16], l[r] = ax.lsum[r / 16][r % 16];
}

void run_item_amx(const Problem& p, const Unit& u, int64_t k0, int64_t k1, Scratch& sc, float* m, float* l,
                  float* acc) {
  if (u.ntok * p.group > kBlockRows)
    run_item_amx_blocks<2>(p, u, k0, k1, sc, m, l, acc);
  else
    run_item_amx_blocks<1>(p, u, k0, k1, sc, m, l, acc);
}

// The units of a chunk read the same V tiles: each whole tile of a (sequence, KV head) with
// more than one unit is made into B tiles once, here, instead of once per unit (7 times for a
// 64-token chunk at 3 query heads per KV head). A unit's partial last tile is still made by the unit (keys past its end read
// as zeros), so the bits are those of the unshared path.
void share_values(Problem& p, const std::vector<Unit>& units, int64_t num_seqs, std::vector<uint16_t>& buf,
                  std::vector<int64_t>& at) {
  const auto same_keys = [](const Unit& a, const Unit& b) { return a.seq == b.seq && a.kvh == b.kvh; };
  if (std::adjacent_find(units.begin(), units.end(), same_keys) == units.end()) return;  // decode rows only
  const int64_t d = p.head_dim;
  at.assign(num_seqs * p.kv_heads, kNotShared);
  std::vector<int64_t> count(num_seqs * p.kv_heads, 0), lo(num_seqs * p.kv_heads, 0);
  for (const Unit& u : units) {
    const int64_t i = u.seq * p.kv_heads + u.kvh;
    lo[i] = count[i]++ ? std::min(lo[i], u.lo) : u.lo;
  }
  struct Task {
    int64_t seq, kvh, t0, dst;
  };
  std::vector<Task> tasks;
  int64_t size = 0;
  for (int64_t i = 0; i < num_seqs * p.kv_heads; ++i) {
    const int64_t seq = i / p.kv_heads, end = p.seq_lens[seq] / kTile * kTile;
    if (count[i] < 2 || lo[i] >= end) continue;
    at[i] = size - lo[i] * d;  // key k's tile at at + k * D
    for (int64_t t0 = lo[i]; t0 < end; t0 += kTile) tasks.push_back({seq, i % p.kv_heads, t0, size + (t0 - lo[i]) * d});
    size += (end - lo[i]) * d;
  }
  if (tasks.empty()) return;
  buf.resize(size);
  const char* vc = static_cast<const char*>(p.v_cache);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 8, [&](int64_t begin, int64_t end) {
    int64_t off[kTile];
    const char* vrow[kTile];
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      tile_offsets(p, p.block_tables + t.seq * p.bt_stride, t.kvh, t.t0, kTile, off);
      for (int64_t k = 0; k < kTile; ++k) vrow[k] = vc + off[k];
      amx_values(vrow, d, reinterpret_cast<ValueTiles*>(buf.data() + t.dst));
    }
  });
  p.shared_values = buf.data();
  p.shared_values_at = at.data();
}
