// bf16 linear layers on AMX tiles: y = x w^T (+ b) for x [M, K] at any row count, over a copy of
// w packed once into the tiles' layout. A decode step's product is one pass over the weights; in
// this layout each 32 outputs' weights are one ordered stream of 2 KiB steps (32 inputs each),
// read ahead of their use, and the tile unit multiplies them by 16 or 32 rows of x at once. On an
// Intel Xeon with AMX that streamed weights faster at 1 to 32 rows than the small-row kernel and
// oneDNN's packed product (docs/results.md); the caller measures at which row counts.
// Compiled only where the compiler targets AMX-BF16 (-march=native on such a CPU); elsewhere
// `amx_tiles` is false and the kernel refuses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx.h"

namespace {

constexpr int64_t GROUP = 32;  // outputs per group: two B tiles of 16 columns
constexpr int64_t STEP = 32;  // inputs per step: a tile row holds 16 pairs of bf16
constexpr int64_t STEP_BYTES = GROUP * STEP * 2;
constexpr int64_t AHEAD = 8192;  // bytes of weights asked for ahead (4 steps): measured
constexpr int64_t GRAIN = 8;  // groups per parallel task

#if defined(PREFIXSERVE_AMX)
// Tiles 0-3: C (two row blocks x two column blocks, float), 4-5: A (x), 6-7: B (weights); each
// 16 rows of 64 bytes.
void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// One group's outputs for the 16 or 32 rows at x (row stride `xs` bf16), `steps` steps.
void group(const at::BFloat16* x, int64_t xs, bool two, const char* w, int64_t steps,
           bool ahead, float (*c)[16][16]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const char* ws = w + s * STEP_BYTES;
    if (ahead)
      for (int64_t b = 0; b < STEP_BYTES; b += 64) _mm_prefetch(ws + AHEAD + b, _MM_HINT_T0);
    _tile_loadd(6, ws, 64);
    _tile_loadd(7, ws + STEP_BYTES / 2, 64);
    _tile_loadd(4, x + s * STEP, xs * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x + 16 * xs + s * STEP, xs * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (two) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}
#endif

}  // namespace

bool amx_tiles() {
#if defined(PREFIXSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// w [N, K] bf16 -> [ceil(N / 32), ceil(K / 32), 2, 16, 16, 2]: per group of 32 outputs and step of
// 32 inputs, two B tiles (16 outputs each), whose row p holds each output's inputs 2p and 2p + 1
// side by side. Past N and K: zeros.
at::Tensor tile_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "tile_pack: the weight must be [N, K] bfloat16");
  const auto src = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t groups = (N + GROUP - 1) / GROUP, steps = (K + STEP - 1) / STEP;
  auto out = at::zeros({groups, steps, 2, 16, 16, 2}, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t n = g * GROUP; n < std::min(N, (g + 1) * GROUP); ++n) {
        const int64_t t = (n % GROUP) / 16, col = n % 16;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t at = (((g * steps + k / STEP) * 2 + t) * 16 + (k % STEP) / 2) * 16 + col;
          d[at * 2 + k % 2] = s[n * K + k];
        }
      }
  });
  return out;
}

// x [M, K] bf16 (rows of any stride, each contiguous), packed from w [N, K] by tile_pack, bias
// [N] bf16 or none -> [M, N] bf16, accumulated in float.
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_tiles(), "tile_linear: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1 &&
                  x.stride(1) == 1,
              "tile_linear: x must be [M, K] bfloat16 with M >= 1 and each row contiguous");
  TORCH_CHECK(packed.dim() == 6 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == 2 && packed.size(3) == 16 &&
                  packed.size(4) == 16 && packed.size(5) == 2,
              "tile_linear: packed must come from tile_pack");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0), steps = packed.size(1);
  TORCH_CHECK(K > (steps - 1) * STEP && K <= steps * STEP && N > (groups - 1) * GROUP &&
                  N <= groups * GROUP,
              "tile_linear: x [", M, ", ", K, "] and N = ", N, " do not match the packed weight");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                "tile_linear: bias must be [N] bfloat16, contiguous");
  }
  auto y = at::empty({M, N}, x.options());
#if defined(PREFIXSERVE_AMX)
  // Tiles read 16 rows of 32 inputs at a time: other shapes are read from a zero-padded copy.
  const int64_t rows = (M + 15) / 16 * 16, width = steps * STEP;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  int64_t xs = x.stride(0);
  static thread_local std::vector<at::BFloat16> padded;
  if (rows != M || width != K) {
    padded.assign(rows * width, at::BFloat16(0.f));
    for (int64_t m = 0; m < M; ++m) std::copy(xp + m * xs, xp + m * xs + K, &padded[m * width]);
    xp = padded.data();
    xs = width;
  }
  const char* wp = reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>());
  const at::BFloat16* bp = bias ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, groups, GRAIN, [&](int64_t begin, int64_t end) {
    configure();
    alignas(64) float c[4][16][16];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * GROUP, cols = std::min(GROUP, N - n0);
      for (int64_t m0 = 0; m0 < rows; m0 += 32) {  // the group's weights stay in cache
        const bool two = m0 + 16 < rows;
        group(xp + m0 * xs, xs, two, wp + g * steps * STEP_BYTES, steps, m0 == 0, c);
        for (int64_t m = m0; m < std::min(M, m0 + 32); ++m) {
          const int64_t h = (m - m0) / 16, r = (m - m0) % 16;
          float out[GROUP];
          std::memcpy(out, c[h * 2][r], 64);
          std::memcpy(out + 16, c[h * 2 + 1][r], 64);
          at::BFloat16* yr = yp + m * N + n0;
          if (bp == nullptr && cols == GROUP) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(out)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(out + 16)));
          } else {
            for (int64_t j = 0; j < cols; ++j)
              yr[j] = at::BFloat16(out[j] + (bp ? float(bp[n0 + j]) : 0.f));
          }
        }
      }
    }
    _tile_release();
  });
#endif
  return y;
}
