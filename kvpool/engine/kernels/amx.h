// AMX set-up shared by the kernels: whether the tile instructions may run in this process (the
// CPU has them and Linux granted the tile state), and the one tile layout they all use.
#pragma once

#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVPOOL_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace kvpool_amx {

constexpr int64_t kTileRows = 16;

struct TileConfig {  // the palette-1 layout LDTILECFG reads
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline std::string setup() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
    return "this CPU lacks AMX-TILE/AMX-BF16 (the kernel was built on another machine)";
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // asm/prctl.h, the AMX tile state
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0)
    return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: ") + std::strerror(errno);
  return "";
}

// Empty when the tiles may be used; asked once per process, before any tile instruction.
inline const std::string& unavailable_reason() {
  static const std::string reason = setup();
  return reason;
}

// All 8 tiles 64 bytes wide, 16 rows; each thread loads it before its first tile instruction.
// A pass over fewer rows may give tiles 0, 1, 4 (the first row block's C and A tiles in the
// linear kernels) and 2, 3, 5 (the second's) fewer: their loads then read only those rows.
inline void load_tile_config(int first_rows = kTileRows, int second_rows = kTileRows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kTileRows, cfg.colsb[t] = 64;
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(first_rows);
  for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(second_rows);
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not see LDTILECFG read cfg: keep the stores
  _tile_loadconfig(&cfg);
}

}  // namespace kvpool_amx
#endif
