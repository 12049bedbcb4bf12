// bf16 linear layers over tiles of weights: y = x w^T (+ b) for x [M, K] at any row count, over a
// copy of w packed once into AMX's tile layout. A decode step's product is one pass over the
// weights; in this layout each 32 outputs' weights are one ordered stream of 2 KiB steps (32 inputs
// each), and a tile row (16 outputs' weights for one pair of inputs) is 64 bytes: one AVX-512
// vector. Two engines read it:
// - AMX (Intel Xeon): the tile unit multiplies each step by 16 or 32 rows of x at once, the weights
//   asked for 8 KiB ahead, the last group's sums stored into y a few rows a step. That streamed
//   weights faster at 1 to 32 rows than the small-row kernel and oneDNN's packed product.
// - Pairs (AVX512-BF16 without AMX, e.g. AMD EPYC Zen 4/5): the CPU's bf16 pair product multiplies
//   each tile row by a pair of inputs broadcast from up to 12 rows of x, the group's 24 sums in
//   registers, the group's weights read again from cache for each 12 rows; the next group's
//   weights are asked for across this group's passes, so that memory's time overlaps the
//   arithmetic (oneDNN's product, at 32 rows, added one to the other: docs/results.md).
// The caller measures at which row counts either beats the alternatives. AMX code is compiled
// only where the compiler targets AMX-BF16, the pairs only where it targets AVX512-BF16
// (-march=native on such a CPU); `tile_linear_engine` says which one runs ("" where neither: the
// kernel refuses).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
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
  load_config(c);
}

// A unit's sums (one group's outputs for up to 32 rows, in the tiles' four 16 x 16 blocks) on
// their way into y, a few rows a step of the next unit's pass: converting them all at once after
// the tiles are stored stalled the stream (15% of a 32-row product), spread over the next pass
// they hide under its weights' reads.
struct Pending {
  float (*c)[16][16] = nullptr;
  const at::BFloat16* bias = nullptr;  // at the group's first output, or null
  at::BFloat16* y = nullptr;  // the unit's first row at its group's first output
  int64_t ys = 0, rows = 0, cols = 0, done = 0;  // y's row stride; rows stored so far
};

void store_group(const float* lo, const float* hi, const at::BFloat16* bias, int64_t cols,
                 at::BFloat16* y);

// Stores `p`'s rows up to `upto`.
void finish(Pending& p, int64_t upto) {
  for (; p.done < std::min(upto, p.rows); ++p.done) {
    const int64_t h = p.done / 16, r = p.done % 16;
    store_group(p.c[h * 2][r], p.c[h * 2 + 1][r], p.bias, p.cols, p.y + p.done * p.ys);
  }
}

// One group's outputs for the 16 or 32 rows at x (row stride `xs` bf16), `steps` steps, into
// `c`, finishing `p` (a buffer other than `c`) along the way: a share of its rows each step.
void group(const at::BFloat16* x, int64_t xs, bool two, const char* w, int64_t steps,
           bool ahead, float (*c)[16][16], Pending& p) {
  const int64_t per_step = (p.rows - p.done + steps - 1) / steps;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const char* ws = w + s * STEP_BYTES;
    if (ahead)
      for (int64_t b = 0; b < STEP_BYTES; b += 64) _mm_prefetch(ws + AHEAD + b, _MM_HINT_T0);
    finish(p, p.done + per_step);
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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PREFIXSERVE_PAIRS 1
#include <immintrin.h>

constexpr int64_t PAIR_ROWS = 12;  // rows of x per pass over a group's weights: 24 sums

// One group's 32 outputs (sums in float, `c` [R, 32]) for the R rows at x (row stride `xs` bf16,
// even), over `steps` steps of its weights at w. Asks for `per_step` lines of `next` (the next
// group's weights, or null) a step, from line `from`, up to its last.
template <int R>
void group_pairs(const at::BFloat16* x, int64_t xs, const char* w, int64_t steps, float* c,
                 const char* next, int64_t from, int64_t per_step) {
  const int64_t lines = steps * STEP_BYTES / 64;
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const char* ws = w + s * STEP_BYTES;
    const int64_t ask = next == nullptr ? 0 : std::min(lines, from + (s + 1) * per_step);
    for (int64_t l = from + s * per_step; l < ask; ++l) _mm_prefetch(next + l * 64, _MM_HINT_T1);
    const int32_t* pairs = reinterpret_cast<const int32_t*>(x + s * STEP);  // x's inputs in pairs
#pragma GCC unroll 4
    for (int p = 0; p < 16; ++p) {
      const __m512bh lo = (__m512bh)_mm512_loadu_si512(ws + p * 64);  // outputs 0-15
      const __m512bh hi = (__m512bh)_mm512_loadu_si512(ws + 1024 + p * 64);  // 16-31
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pairs[r * xs / 2 + p]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], lo, a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], hi, a);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * GROUP, acc[r][0]);
    _mm512_storeu_ps(c + r * GROUP + 16, acc[r][1]);
  }
}

// group_pairs<rows> for rows in 1..PAIR_ROWS.
template <int... Rs>
void group_rows(int rows, std::integer_sequence<int, Rs...>, const at::BFloat16* x, int64_t xs,
                const char* w, int64_t steps, float* c, const char* next, int64_t from,
                int64_t per_step) {
  ((rows == Rs + 1 ? group_pairs<Rs + 1>(x, xs, w, steps, c, next, from, per_step) : void()), ...);
}

// (What follows serves both engines: AVX512-BF16 is there wherever AMX is.)
// x's rows as the engines read them: in place where they hold `rows` rows of `width` inputs at an
// even stride, else from this thread's zero-padded copy. Sets `xs` to the row stride.
const at::BFloat16* readable(const at::Tensor& x, int64_t rows, int64_t width, int64_t& xs) {
  const int64_t M = x.size(0), K = x.size(1);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  xs = x.stride(0);
  if (rows == M && width == K && xs % 2 == 0) return xp;
  static thread_local std::vector<at::BFloat16> padded;
  padded.assign(rows * width, at::BFloat16(0.f));
  for (int64_t m = 0; m < M; ++m) std::copy(xp + m * xs, xp + m * xs + K, &padded[m * width]);
  xs = width;
  return padded.data();
}

// One row's `cols` (<= 32) outputs from their float sums (outputs 0-15 at `lo`, 16-31 at `hi`),
// plus the bias (or null) at them, each rounded once to bf16.
void store_group(const float* lo, const float* hi, const at::BFloat16* bias, int64_t cols,
                 at::BFloat16* y) {
  if (bias == nullptr && cols == GROUP) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(lo)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(hi)));
    return;
  }
  for (int64_t j = 0; j < cols; ++j)
    y[j] = at::BFloat16((j < 16 ? lo[j] : hi[j - 16]) + (bias ? float(bias[j]) : 0.f));
}

#if defined(PREFIXSERVE_AMX)
void amx_product(const at::Tensor& x, const char* wp, const at::BFloat16* bp, at::Tensor& y,
                 int64_t steps, int64_t groups) {
  // Tiles read 16 rows of 32 inputs at a time: other shapes are read from a zero-padded copy.
  const int64_t M = x.size(0), N = y.size(1), rows = (M + 15) / 16 * 16;
  int64_t xs;
  const at::BFloat16* xp = readable(x, rows, steps * STEP, xs);
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, groups, GRAIN, [&](int64_t begin, int64_t end) {
    configure();
    alignas(64) float c[2][4][16][16];  // this unit's sums and the last one's, being stored
    Pending p;
    for (int64_t g = begin, unit = 0; g < end; ++g) {
      const int64_t n0 = g * GROUP;
      for (int64_t m0 = 0; m0 < rows; m0 += 32, ++unit) {  // the group's weights stay in cache
        float (*sums)[16][16] = c[unit % 2];
        group(xp + m0 * xs, xs, m0 + 16 < rows, wp + g * steps * STEP_BYTES, steps, m0 == 0,
              sums, p);
        p = {sums, bp ? bp + n0 : nullptr, yp + m0 * N + n0, N, std::min<int64_t>(32, M - m0),
             std::min(GROUP, N - n0), 0};
      }
    }
    finish(p, p.rows);
    _tile_release();
  });
}
#endif

void pairs_product(const at::Tensor& x, const char* wp, const at::BFloat16* bp, at::Tensor& y,
                   int64_t steps, int64_t groups) {
  const int64_t M = x.size(0), N = y.size(1);
  int64_t xs;
  const at::BFloat16* xp = readable(x, M, steps * STEP, xs);
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // the next group's lines, spread over this group's passes (one per PAIR_ROWS rows)
  const int64_t passes = (M + PAIR_ROWS - 1) / PAIR_ROWS, lines = steps * STEP_BYTES / 64;
  const int64_t per_step = (lines + passes * steps - 1) / (passes * steps);
  at::parallel_for(0, groups, GRAIN, [&](int64_t begin, int64_t end) {
    alignas(64) float c[PAIR_ROWS * GROUP];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * GROUP, cols = std::min(GROUP, N - n0);
      const char* next = g + 1 < end ? wp + (g + 1) * steps * STEP_BYTES : nullptr;
      for (int64_t m0 = 0, pass = 0; m0 < M; m0 += PAIR_ROWS, ++pass) {
        const int rows = int(std::min(PAIR_ROWS, M - m0));
        group_rows(rows, std::make_integer_sequence<int, PAIR_ROWS>{}, xp + m0 * xs, xs,
                   wp + g * steps * STEP_BYTES, steps, c, next, pass * steps * per_step,
                   per_step);
        for (int64_t m = m0; m < m0 + rows; ++m)
          store_group(c + (m - m0) * GROUP, c + (m - m0) * GROUP + 16, bp ? bp + n0 : nullptr,
                      cols, yp + m * N + n0);
      }
    }
  });
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

std::string tile_linear_engine() {
#if defined(PREFIXSERVE_PAIRS)
  return amx_tiles() ? "amx" : "pairs";
#else
  return amx_tiles() ? "amx" : "";
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
  TORCH_CHECK(!tile_linear_engine().empty(),
              "tile_linear: this build or CPU has neither AMX-BF16 tiles nor AVX512-BF16 pairs");
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
  const char* wp = reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>());
  const at::BFloat16* bp = bias ? bias->data_ptr<at::BFloat16>() : nullptr;
#if defined(PREFIXSERVE_AMX)
  if (amx_tiles()) {
    amx_product(x, wp, bp, y, steps, groups);
    return y;
  }
#endif
#if defined(PREFIXSERVE_PAIRS)
  pairs_product(x, wp, bp, y, steps, groups);
#endif
  return y;
}
