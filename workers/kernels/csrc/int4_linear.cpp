// Linear layers over int4 weights at a decode step's few rows, with float activations:
// y = x w^T for x [M, K] (float32 or bfloat16) and w = q s + c, q in 0..15, one scale s and one
// offset c per group of 32 inputs. torch's int4 kernel takes bf16 activations, which a CPU
// without AVX512-BF16 or AMX emulates: there it read SmolLM2's layers at 3.4 GB/s at one row
// (docs/results.md). Here each output reads its row of packed weights once, in order: a group's
// 16 bytes widen to 32 floats in registers, every row of x multiplies them, and the group's
// scale and offset apply once per row: s (q . x) + c (sum of x over the group), the sums of x
// taken once per call. With AVX512-BF16, bf16 rows skip the widening: a group's 32 levels become
// bf16 through a 16-entry table (0..15 are exact in bf16) and meet x's values in the CPU's pair
// dot-product instruction, which multiplies them exactly and sums in float.
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t TILE = 4;  // rows per pass over the weights (more spill the sums: measured)
constexpr int64_t GRAIN = 256;  // output columns per parallel task
static_assert(GROUP % L == 0, "a group fills whole vectors");

// A group's q values as float vectors. Byte i of its 16 holds q[i] in its low nibble and
// q[16 + i] in its high one, so each half widens from one 16-byte register.
inline void unpack(const uint8_t* p, Vec* q) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
#if defined(CPU_CAPABILITY_AVX512)
  q[0] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)));
  q[1] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)));
#else
  q[0] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
  q[1] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
  q[2] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
  q[3] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
#endif
#else
  alignas(64) float f[GROUP];
  for (int64_t i = 0; i < GROUP / 2; ++i) {
    f[i] = static_cast<float>(p[i] & 15);
    f[GROUP / 2 + i] = static_cast<float>(p[i] >> 4);
  }
  for (int64_t c = 0; c < GROUP / L; ++c) q[c] = Vec::loadu(f + c * L);
#endif
}

// Output column n for M rows of x (float); `sc` holds (s, c) per group, `xsum` [M, G] the rows'
// sums.
template <typename T, int64_t M>
inline void column(const float* x, const float* xsum, const uint8_t* packed, const float* sc,
                   T* y, int64_t n, int64_t N, int64_t K) {
  const int64_t G = K / GROUP;
  const uint8_t* pn = packed + n * (K / 2);
  const float* sn = sc + n * G * 2;
  Vec acc[M];
  float offset[M];
  for (int64_t m = 0; m < M; ++m) {
    acc[m] = Vec(0.f);
    offset[m] = 0.f;
  }
  for (int64_t g = 0; g < G; ++g) {
    Vec qv[GROUP / L];
    unpack(pn + g * (GROUP / 2), qv);
    const Vec s(sn[2 * g]);
    const float off = sn[2 * g + 1];
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K + g * GROUP;
      Vec t = qv[0] * Vec::loadu(xm);
      for (int64_t c = 1; c < GROUP / L; ++c) t = at::vec::fmadd(qv[c], Vec::loadu(xm + c * L), t);
      acc[m] = at::vec::fmadd(t, s, acc[m]);
      offset[m] += off * xsum[m * G + g];
    }
  }
  for (int64_t m = 0; m < M; ++m) y[m * N + n] = static_cast<T>(sum(acc[m]) + offset[m]);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool BF16_PAIRS = true;

// A group's levels as 32 bf16 in order: byte i's low nibble is level i, its high one 16 + i.
inline __m512bh levels_bf16(const uint8_t* p, __m512i table) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), bytes, 1);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i level = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi16(15));
  return (__m512bh)_mm512_permutexvar_epi16(level, table);
}

// As `column`, for bf16 rows of x read as they are.
template <int64_t M>
inline void column_bf16(const at::BFloat16* x, const float* xsum, const uint8_t* packed,
                        const float* sc, at::BFloat16* y, int64_t n, int64_t N, int64_t K,
                        __m512i table) {
  const int64_t G = K / GROUP;
  const uint8_t* pn = packed + n * (K / 2);
  const float* sn = sc + n * G * 2;
  // Two groups at a time, their products summed apart from the running sums: one chain of
  // dependent adds per group would bound the column's time.
  __m512 acc[M];
  float offset[M];
  for (int64_t m = 0; m < M; ++m) {
    acc[m] = _mm512_setzero_ps();
    offset[m] = 0.f;
  }
  auto group = [&](int64_t g, int64_t m, __m512bh q) {
    const __m512bh xm = (__m512bh)_mm512_loadu_si512(x + m * K + g * GROUP);
    return _mm512_mul_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xm), _mm512_set1_ps(sn[2 * g]));
  };
  int64_t g = 0;
  for (; g + 1 < G; g += 2) {
    const __m512bh q0 = levels_bf16(pn + g * (GROUP / 2), table);
    const __m512bh q1 = levels_bf16(pn + (g + 1) * (GROUP / 2), table);
    for (int64_t m = 0; m < M; ++m) {
      acc[m] = _mm512_add_ps(acc[m], _mm512_add_ps(group(g, m, q0), group(g + 1, m, q1)));
      offset[m] += sn[2 * g + 1] * xsum[m * G + g] + sn[2 * g + 3] * xsum[m * G + g + 1];
    }
  }
  if (g < G) {
    const __m512bh q = levels_bf16(pn + g * (GROUP / 2), table);
    for (int64_t m = 0; m < M; ++m) {
      acc[m] = _mm512_add_ps(acc[m], group(g, m, q));
      offset[m] += sn[2 * g + 1] * xsum[m * G + g];
    }
  }
  for (int64_t m = 0; m < M; ++m)
    y[m * N + n] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[m]) + offset[m]);
}
#else
constexpr bool BF16_PAIRS = false;
#endif

template <typename T, int64_t M>
void tile(const float* x, const T* x_bf16, const float* xsum, const uint8_t* packed,
          const float* sc, T* y, int64_t N, int64_t K) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    alignas(64) uint16_t levels[32] = {};
    for (int i = 0; i < 16; ++i) levels[i] = at::BFloat16(static_cast<float>(i)).x;
    const __m512i table = _mm512_load_si512(levels);
    at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n)
        column_bf16<M>(x_bf16, xsum, packed, sc, y, n, N, K, table);
    });
    return;
  }
#endif
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) column<T, M>(x, xsum, packed, sc, y, n, N, K);
  });
}

// x is copied as float once per call (unless its bf16 rows go to the CPU's pair products as
// they are): bf16 rows widened inside the loop over the weights' columns cost a third more at
// one row (29.1 against 21.7 ms over 63 MiB on an AVX-512 CPU).
template <typename T>
void run(const T* x, const uint8_t* packed, const float* sc, T* y, int64_t M, int64_t N,
         int64_t K) {
  const int64_t G = K / GROUP;
  constexpr bool pairs = BF16_PAIRS && std::is_same_v<T, at::BFloat16>;
  std::vector<float> xf(pairs ? 0 : M * K), xsum(M * G);
  if (!pairs) std::copy(x, x + M * K, xf.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float total = 0.f;
      for (int64_t i = 0; i < GROUP; ++i) total += static_cast<float>(x[m * K + g * GROUP + i]);
      xsum[m * G + g] = total;
    }
  for (int64_t m0 = 0; m0 < M; m0 += TILE) {  // one pass over the weights per tile of rows
    const float* xt = pairs ? nullptr : xf.data() + m0 * K;
    const float* st = xsum.data() + m0 * G;
    T* yt = y + m0 * N;
    switch (std::min(TILE, M - m0)) {
#define CASE(C) case C: tile<T, C>(xt, x + m0 * K, st, packed, sc, yt, N, K); break;
      CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
    }
  }
}

}  // namespace

// x [M, K] contiguous, float32 or bfloat16; packed uint8 [N, K / 2] (int4_pack's layout);
// scales float32 [N, K / 32, 2], each group's (s, c) -> [M, N] in x's dtype.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(1) % GROUP == 0,
              "int4_linear: x must be [M, K], contiguous, K a multiple of ", GROUP);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == K / 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte,
              "int4_linear: packed must be uint8 [N, K / 2], contiguous");
  const int64_t N = packed.size(0);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == N && scales.size(1) == K / GROUP &&
                  scales.size(2) == 2 && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              "int4_linear: scales must be float32 [N, K / ", GROUP, ", 2], contiguous");
  auto y = at::empty({M, N}, x.options());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat:
      run<float>(x.data_ptr<float>(), p, sc, y.data_ptr<float>(), M, N, K);
      break;
    case at::kBFloat16:
      run<at::BFloat16>(x.data_ptr<at::BFloat16>(), p, sc, y.data_ptr<at::BFloat16>(), M, N, K);
      break;
    default: TORCH_CHECK(false, "int4_linear: unsupported dtype ", x.scalar_type());
  }
  return y;
}
