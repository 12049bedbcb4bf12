// What prefixserve's AMX kernels share: whether this build has AMX-BF16 tiles (the compiler
// targets them: -march=native on such a CPU), Linux's permission to use them, and the tile
// configuration's layout. Included by one translation unit each, like vec.h.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PREFIXSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// Linux lends a process the tile registers' state only when asked (arch_prctl, XTILEDATA).
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// ldtilecfg's operand: per tile, its rows and bytes per row (palette 1).
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a configuration. The barrier keeps its fields' stores before ldtilecfg: GCC (-O3) has
// dropped some of them, which ldtilecfg then refused (a fault) for tiles left half set.
inline void load_config(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

}  // namespace
#endif
