// AMX kernels that read the activations in place as A tiles and stream the weights past them
// as B tiles: dense bf16 strips packed at load (`linear_amx_packed`) and 4-bit / 8-bit groups
// repacked in the B tiles' order (`linear_amx_vnni`). Included by q4_linear.cpp inside its
// namespace under KVPOOL_AMX (it uses bf16, kGroup, kTileRows, load_tile_config, round_to_bf16).
#pragma once

// --- dense bf16 weights packed at load: the activations as the A tiles ----------------------
// The same products in the same order with the roles swapped: the activations are read in place
// as A tiles (16 rows x 32 K) and the weights, packed once into VNNI B tiles (pairs of K for 16
// outputs), stream past them; C tiles [rows][outputs] are stored row by row.

// One pass over two row blocks of the activations (A tiles 4, 5, read in place: 16 rows x 32
// K) and two strips (B tiles 6, 7): C tile 2 * b + s = row block b . strip s, over every group
// of K in order (the intrinsics take literal tile numbers). Four tile loads per four products.
// `after(g)` runs once group g's products are issued: vector work there overlaps them.
struct NoWork {
  void operator()(int64_t) const {}
};

template <int B, class After = NoWork>
void tile_pass(const bf16* x, int64_t k, const bf16* strips, int64_t strip_size, const After& after = {}) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (B > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const bf16* second_rows = x + kTileRows * k;
  const bf16* second_strip = strips + strip_size;
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const int64_t tile = g * kTileRows * kGroup;
    _tile_loadd(4, x + g * kGroup, k * sizeof(bf16));
    _tile_loadd(6, strips + tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, second_strip + tile, 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (B > 1) {
      _tile_loadd(5, second_rows + g * kGroup, k * sizeof(bf16));
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    after(g);
  }
}

// C tile [16 rows][16 outputs] -> y[row][n0 + output], rounded to bf16, rows and outputs that exist.
void store_rows(const float* c, bf16* y, int64_t n_out, int64_t rows, int64_t outputs) {
  const __mmask16 valid = static_cast<__mmask16>((1u << outputs) - 1);
  for (int64_t m = 0; m < rows; ++m)
    _mm256_mask_storeu_epi16(y + m * n_out, valid, round_to_bf16(_mm512_loadu_ps(c + m * kTileRows)));
}

// C tile t of a pass (row block b0 + t / 2, strip s0 + t % 2) -> y, rounded to bf16; outputs
// past n_out are not stored.
void store_pass(float (*c)[kTileRows * kTileRows], int64_t pass, int64_t b0, int64_t s0, bf16* y, int64_t n_out,
                int64_t rows) {
  for (int64_t t = 0; t < 2 * pass; ++t) {
    const int64_t m0 = (b0 + t / 2) * kTileRows, strip = s0 + t % 2;
    const int64_t outputs = std::max<int64_t>(0, std::min(kTileRows, n_out - strip * kTileRows));
    if (outputs == 0) continue;
    switch (t) {  // literal tile numbers
      case 0: _tile_stored(0, c[0], 64); break;
      case 1: _tile_stored(1, c[1], 64); break;
      case 2: _tile_stored(2, c[2], 64); break;
      default: _tile_stored(3, c[3], 64); break;
    }
    store_rows(c[t], y + m0 * n_out + strip * kTileRows, n_out, std::min(kTileRows, rows - m0), outputs);
  }
}

// Row blocks b0 and b0 + 1 (where it exists) of x against strips s0, s0 + 1 (`pair`, through
// C tiles 0-3: tile_pass) -> y. The pass over the last rows, fewer than its blocks hold, runs on
// tiles of those rows only, whole tiles again once it is stored: x is read in place, never past
// its rows, and a 129-row step pays for a 1-row block, not a 32-row pass.
template <class After = NoWork>
void pair_pass(float (*c)[kTileRows * kTileRows], const bf16* x, int64_t b0, int64_t rows, int64_t k,
               const bf16* pair, int64_t strip_size, int64_t s0, bf16* y, int64_t n_out, const After& after = {}) {
  const int64_t left = rows - b0 * kTileRows, pass = left > kTileRows ? 2 : 1;
  const bool partial = left < pass * kTileRows;
  if (partial) load_tile_config(std::min(left, kTileRows), pass == 2 ? left - kTileRows : kTileRows);
  const bf16* xb = x + b0 * kTileRows * k;
  if (pass == 2)
    tile_pass<2>(xb, k, pair, strip_size, after);
  else
    tile_pass<1>(xb, k, pair, strip_size, after);
  store_pass(c, pass, b0, s0, y, n_out, rows);
  if (partial) load_tile_config();
}

// Dense bf16 weights as linear.py's `TileLinear` packs them: [N/32 pairs of strips][K/32][16
// pairs of K][16 outputs][2], zero past N.
struct PackedStrips {
  const bf16* strips;
};
constexpr int64_t kChunkBlocks = 16;  // 256 activation rows (1 MB at K = 2048) per sweep over the strips

at::Tensor linear_amx_packed(const PackedStrips& f, const at::Tensor& x, int64_t n_out) {
  TORCH_CHECK(amx_unavailable_reason().empty(), "AMX kernel unavailable: ", amx_unavailable_reason());
  const int64_t rows = x.size(0), k = x.size(1), blocks = (rows + kTileRows - 1) / kTileRows;
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  const at::Tensor xc = x.contiguous();
  const bf16* xp = xc.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t strips = (n_out + kTileRows - 1) / kTileRows, strip_size = kTileRows * k;
  at::parallel_for(0, (strips + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    alignas(64) float c[4][kTileRows * kTileRows];
    // Rows go in chunks whose activations stay in L2 across the strips (all at once, each
    // activation tile would be read again for every strip pair).
    for (int64_t c0 = 0; c0 < blocks; c0 += kChunkBlocks) {
      for (int64_t pr = begin; pr < end; ++pr) {
        const int64_t s0 = 2 * pr;
        const bf16* pair = f.strips + s0 * strip_size;
        for (int64_t b0 = c0; b0 < std::min(blocks, c0 + kChunkBlocks); b0 += 2) {
          pair_pass(c, xp, b0, rows, k, pair, strip_size, s0, yp, n_out);
        }
      }
    }
    _tile_release();
  });
  return y;
}

// --- 4-bit groups in the B tiles' order (`q4_vnni_repack` in models/quantized.py) ------------
// Any row count, the same products in the same order as the dense copy above: each strip's
// groups are dequantized into the packed kernel's B tiles, and the activations pass as A tiles.
// vq [N/16][K/32][16 pairs of K][16 bytes]: byte b of pair p holds output b/2's weight 2p + b%2
// (low nibble) and output 8 + b/2's (high nibble); vs, vm [N/16][K/32][16 outputs] float32. A
// pair of K's tile row (16 outputs x 2) is then one 16-byte load, two conversions and d * q + m
// in float32 rounded to bf16 once, as the dense copy was made: no transposes. This reads 0.75
// bytes a weight where the dense copy reads 2, so a step whose bf16 copy is out of cache (a
// prefill after decode steps, which read the groups) or a decode step of 16-32 rows gains.

// A tile row's words 0-15 are outputs 0-7 (a pair of K each), 16-31 outputs 8-15: each
// output's scale (or min) on its two lanes.
inline void per_lane(const float* v, __m512& lo, __m512& hi) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512 x = _mm512_loadu_ps(v);
  lo = _mm512_permutexvar_ps(lo_idx, x);
  hi = _mm512_permutexvar_ps(_mm512_add_epi32(lo_idx, _mm512_set1_epi32(8)), x);
}

// One group of one strip of Q4_1 weights: a B tile (1 KB) at dst.
constexpr int64_t kVnniSweepBlocks = 32;  // 512 activation rows per sweep over the strip pairs

struct Q4Group {
  const uint8_t* q;
  const float* scale;
  const float* mins;
  static constexpr int64_t kBytes = 256;  // a group's weights in one strip
  Q4Group group(int64_t g) const { return {q + g * kBytes, scale + g * kTileRows, mins + g * kTileRows}; }
  void prefetch() const {
    for (int64_t b = 0; b < kBytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(q + b), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(scale), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(mins), _MM_HINT_T1);
  }
  void dequant(bf16* dst) const {
    const __m128i low4 = _mm_set1_epi8(15);
    __m512 dlo, dhi, mlo, mhi;
    per_lane(scale, dlo, dhi);
    per_lane(mins, mlo, mhi);
    for (int p = 0; p < kTileRows; ++p) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + p * 16));
      const __m512 qlo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4)));
      const __m512 qhi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
      const __m512 wlo = _mm512_add_ps(_mm512_mul_ps(qlo, dlo), mlo);  // multiply, then add: as group16
      const __m512 whi = _mm512_add_ps(_mm512_mul_ps(qhi, dhi), mhi);
      const __m512bh w = _mm512_cvtne2ps_pbh(whi, wlo);
      _mm512_storeu_si512(dst + p * 2 * kTileRows, reinterpret_cast<const __m512i&>(w));
    }
  }
};

// The same for Q8_0 weights: a tile row's 32 int8 levels in the words' order, times the scale
// (exact in float32: an fp16 scale times a 7-bit level), rounded to bf16 once as the dense copy was.
struct Q8Group {
  const int8_t* q;
  const float* scale;
  static constexpr int64_t kBytes = 512;
  Q8Group group(int64_t g) const { return {q + g * kBytes, scale + g * kTileRows}; }
  void prefetch() const {
    for (int64_t b = 0; b < kBytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(q + b), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(scale), _MM_HINT_T1);
  }
  void dequant(bf16* dst) const {
    __m512 dlo, dhi;
    per_lane(scale, dlo, dhi);
    for (int p = 0; p < kTileRows; ++p) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 32));
      const __m512 qlo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
      const __m512 qhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_mul_ps(qhi, dhi), _mm512_mul_ps(qlo, dlo));
      _mm512_storeu_si512(dst + p * 2 * kTileRows, reinterpret_cast<const __m512i&>(w));
    }
  }
};

// Up to two row blocks in one pass (C0 = x1.a, C1 = x1.b, C2 = x2.a, C3 = x2.b, as tile_pass):
// each group of both strips is dequantized one group ahead into a ring of four in L1, and the
// same group of the next pair (next_a, next_b; null for a thread's last) is fetched into L2.
// Without that fetch the reads waited on the dequantization: 16.0 vs 12.6 ms for the bundled
// model's 120 projections at 1 row, one thread.
template <int B, class Strip>
void stream_pair(const bf16* x, int64_t k, Strip a, Strip b, bf16* ring, const Strip* next_a, const Strip* next_b) {
  const int64_t groups = k / kGroup, lda = k * sizeof(bf16);
  const auto make = [&](int64_t g) {
    bf16* slot = ring + (g & 3) * 2 * kTileRows * kGroup;
    a.group(g).dequant(slot);
    b.group(g).dequant(slot + kTileRows * kGroup);
    if (next_a != nullptr) {
      next_a->group(g).prefetch();
      next_b->group(g).prefetch();
    }
  };
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (B > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  make(0);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 1 < groups) make(g + 1);
    const bf16* slot = ring + (g & 3) * 2 * kTileRows * kGroup;
    _tile_loadd(4, x + g * kGroup, lda);
    _tile_loadd(6, slot, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, slot + kTileRows * kGroup, 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (B > 1) {
      _tile_loadd(5, x + kTileRows * k + g * kGroup, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// strip_at(s): strip s's first group (a Q4Group or Q8Group).
template <class StripAt>
at::Tensor linear_amx_vnni(const at::Tensor& x, const StripAt& strip_at, int64_t n_out) {
  TORCH_CHECK(amx_unavailable_reason().empty(), "AMX kernel unavailable: ", amx_unavailable_reason());
  const int64_t rows = x.size(0), k = x.size(1), blocks = (rows + kTileRows - 1) / kTileRows, groups = k / kGroup;
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  const at::Tensor xc = x.contiguous();  // A tiles of the rows there are, read in place
  const bf16* xp = xc.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t strips = n_out / kTileRows, strip_size = kTileRows * k;
  const auto make_strip = [&](int64_t s, bf16* dst) {
    for (int64_t g = 0; g < groups; ++g) strip_at(s).group(g).dequant(dst + g * kTileRows * kGroup);
  };
  // an odd last strip pairs with itself; its second copy is past n_out, not stored
  const auto second = [&](int64_t s0) { return std::min(s0 + 1, strips - 1); };
  at::parallel_for(0, (strips + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[4][kTileRows * kTileRows];
    if (blocks <= 2) {  // one pass over each pair: stream its groups through L1
      load_tile_config(std::min(rows, kTileRows), blocks == 2 ? rows - kTileRows : kTileRows);
      alignas(64) bf16 ring[4 * 2 * kTileRows * kGroup];
      for (int64_t pr = begin; pr < end; ++pr) {
        const int64_t s0 = 2 * pr;
        const auto na = strip_at(std::min(s0 + 2, strips - 1)), nb = strip_at(second(s0 + 2));
        const bool more = pr + 1 < end;
        if (blocks == 2)
          stream_pair<2>(xp, k, strip_at(s0), strip_at(second(s0)), ring, more ? &na : nullptr, more ? &nb : nullptr);
        else
          stream_pair<1>(xp, k, strip_at(s0), strip_at(second(s0)), ring, more ? &na : nullptr, more ? &nb : nullptr);
        store_pass(c, blocks, 0, s0, yp, n_out, rows);
      }
      _tile_release();
      return;
    }
    // Several passes: the pair is dequantized whole, the next one a little after each group's
    // products of this one's passes, so the vector work runs beside the tiles'.
    load_tile_config();
    thread_local std::vector<bf16> pairs;  // grown, never shrunk: a resize back up would zero it again
    if (pairs.size() < static_cast<size_t>(4 * strip_size)) pairs.resize(4 * strip_size);
    const auto make_group = [&](int64_t pr, int64_t unit, bf16* dst) {  // unit: strip (of 2) x group
      const int64_t half = unit / groups, g = unit % groups;
      strip_at(half ? second(2 * pr) : 2 * pr).group(g).dequant(dst + half * strip_size + g * kTileRows * kGroup);
    };
    // Rows go in sweeps of up to kVnniSweepBlocks row blocks, each over all the thread's pairs
    // (its activations stay in L2): job j is pair begin + j % pairs of sweep j / pairs.
    const int64_t npairs = end - begin, sweeps = (blocks + kVnniSweepBlocks - 1) / kVnniSweepBlocks;
    for (int64_t u = 0; u < 2 * groups; ++u) make_group(begin, u, pairs.data());
    for (int64_t j = 0; j < sweeps * npairs; ++j) {
      const int64_t pr = begin + j % npairs, c0 = j / npairs * kVnniSweepBlocks;
      const int64_t c1 = std::min(blocks, c0 + kVnniSweepBlocks);
      const bf16* pair = pairs.data() + (j & 1) * 2 * strip_size;
      bf16* next = pairs.data() + ((j + 1) & 1) * 2 * strip_size;
      const int64_t units = j + 1 < sweeps * npairs ? 2 * groups : 0, steps = (c1 - c0 + 1) / 2 * groups;
      int64_t step = 0, made = 0;
      const auto make_next = [&](int64_t) {  // the next job's units spread evenly over the steps
        for (const int64_t due = ++step * units / steps; made < due; ++made)
          make_group(begin + (j + 1) % npairs, made, next);
      };
      for (int64_t b0 = c0; b0 < c1; b0 += 2)
        pair_pass(c, xp, b0, rows, k, pair, strip_size, 2 * pr, yp, n_out, make_next);
    }
    _tile_release();
  });
  return y;
}
