// Linear layers at a decode step's few rows: y = x w^T (+ b) for x [M, K] with M at most
// MAX_ROWS, w [N, K] as checkpoints store it. At so few rows the product is one pass over the
// weights, and its speed is the rate they stream from memory. BLAS libraries' small products reach
// half of that on some CPUs, and far less at 2 to 8 rows (docs/results.md). Here each output
// column reads its row of w once, in order (one stream: the hardware prefetcher's best case),
// U vectors at a time into M x U independent float sums, with x's M rows held in L1. bf16 on a
// CPU with AVX512-BF16 multiplies bf16 pairs directly (twice the rows' throughput at 2 to 4 rows,
// measured); elsewhere bf16 values are widened to float as they are loaded.
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <optional>
#include <type_traits>

namespace {

constexpr int64_t MAX_ROWS = 8;
constexpr int64_t GRAIN = 256;  // output columns per parallel task

// Output column n for all M rows of x.
template <typename T, int64_t M, int64_t U>
inline void column(const T* x, const T* w, const T* bias, T* y, int64_t n, int64_t N, int64_t K) {
  Vec acc[M][U];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t u = 0; u < U; ++u) acc[m][u] = Vec(0.f);
  const T* wn = w + n * K;
  int64_t k = 0;
  for (; k + U * L <= K; k += U * L) {
    for (int64_t u = 0; u < U; ++u) {
      const Vec wv = load(wn + k + u * L, L);
      for (int64_t m = 0; m < M; ++m)
        acc[m][u] = at::vec::fmadd(wv, load(x + m * K + k + u * L, L), acc[m][u]);
    }
  }
  for (; k < K; k += L) {
    const int64_t left = std::min(L, K - k);
    const Vec wv = load(wn + k, left);
    for (int64_t m = 0; m < M; ++m)
      acc[m][0] = at::vec::fmadd(wv, load(x + m * K + k, left), acc[m][0]);
  }
  const float b = bias == nullptr ? 0.f : static_cast<float>(bias[n]);
  for (int64_t m = 0; m < M; ++m) {
    Vec total = acc[m][0];
    for (int64_t u = 1; u < U; ++u) total = total + acc[m][u];
    y[m * N + n] = static_cast<T>(sum(total) + b);
  }
}

#if defined(__AVX512BF16__)
// bf16 rows with AVX512-BF16: each instruction multiplies 32 bf16 pairs and adds them, in pairs,
// into 16 float sums.
template <int64_t M, int64_t U>
inline void column_bf16(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
                        at::BFloat16* y, int64_t n, int64_t N, int64_t K) {
  __m512 acc[M][U];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  const at::BFloat16* wn = w + n * K;
  int64_t k = 0;
  for (; k + U * 32 <= K; k += U * 32) {
    for (int64_t u = 0; u < U; ++u) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + k + u * 32);
      for (int64_t m = 0; m < M; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv,
                                     (__m512bh)_mm512_loadu_si512(x + m * K + k + u * 32));
    }
  }
  for (; k < K; k += 32) {
    const int64_t left = std::min<int64_t>(32, K - k);
    const __mmask32 mask = (left == 32) ? ~__mmask32(0) : ((__mmask32(1) << left) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wn + k);
    for (int64_t m = 0; m < M; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv,
                                   (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
  }
  const float b = bias == nullptr ? 0.f : static_cast<float>(bias[n]);
  for (int64_t m = 0; m < M; ++m) {
    __m512 total = acc[m][0];
    for (int64_t u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[m][u]);
    y[m * N + n] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(total) + b);
  }
}
#endif

template <typename T, int64_t M>
void run(const T* x, const T* w, const T* bias, T* y, int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    constexpr int64_t UB = M <= 2 ? 4 : 2;
    at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) column_bf16<M, UB>(x, w, bias, y, n, N, K);
    });
    return;
  }
#endif
  constexpr int64_t U = M <= 2 ? 4 : 2;  // at most 8 sums, or 16 from five rows on (measured)
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) column<T, M, U>(x, w, bias, y, n, N, K);
  });
}

template <typename T>
void dispatch(int64_t m, const T* x, const T* w, const T* bias, T* y, int64_t N, int64_t K) {
  switch (m) {
#define CASE(C) case C: return run<T, C>(x, w, bias, y, N, K);
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
  }
}

}  // namespace

// x [M, K] (1 <= M <= small_linear_max_rows, contiguous), w [N, K] contiguous, bias [N] or none,
// one dtype (float32 or bfloat16) -> [M, N].
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "small_linear: x must be [M, K] and w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "small_linear: ", x.size(0),
              " rows; it takes 1 to ", MAX_ROWS);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: x and w must be contiguous");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "small_linear: x and w must share a dtype");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "small_linear: bias must be [N], contiguous, in x's dtype");
  }
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      dispatch<float>(x.size(0), x.data_ptr<float>(), w.data_ptr<float>(),
                      bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), w.size(0),
                      w.size(1));
      break;
    case at::kBFloat16:
      dispatch<at::BFloat16>(x.size(0), x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                             bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                             y.data_ptr<at::BFloat16>(), w.size(0), w.size(1));
      break;
    default: TORCH_CHECK(false, "small_linear: unsupported dtype ", x.scalar_type());
  }
  return y;
}

int64_t small_linear_max_rows() { return MAX_ROWS; }
