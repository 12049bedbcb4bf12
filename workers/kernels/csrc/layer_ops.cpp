// The per-token ops between a Llama layer's matmuls, fused for CPUs. torch runs RMSNorm as five
// kernels (seven in bf16, with its casts), RoPE as a complex multiply between views and casts,
// and SwiGLU's activation as two; at a decode step's few rows each kernel's dispatch costs more
// than its arithmetic. Here each is one pass over its rows, computed in float and rounded where
// the torch sequence rounds in the model's dtype, so a bf16 model computes what its torch path
// computes (fp32 differs only in the order of a sum).
#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t GRAIN = 8;  // rows per task: a step of up to 8 rows stays on one thread

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

// One row of RMSNorm from float values: dst = w * T(src / rms(src)), as HF's LlamaRMSNorm
// rounds the normalised row to the model's dtype before the weight multiplies it.
template <typename T>
inline void norm_row(const float* src, T* dst, const T* w, int64_t dim, float eps) {
  float sum = 0.f;
  for (int64_t d = 0; d < dim; ++d) sum += src[d] * src[d];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(f(w[d]) * f(static_cast<T>(src[d] * inv)));
}

// add: residual = T(residual + x), then x = RMSNorm(residual); else out = RMSNorm(x).
template <typename T, bool add>
void norm_rows(T* x, T* residual, T* out, const T* w, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        if constexpr (add) {
          T* rr = residual + r * dim;
          rr[d] = static_cast<T>(f(rr[d]) + f(xr[d]));
          row[d] = f(rr[d]);
        } else {
          row[d] = f(xr[d]);
        }
      }
      norm_row(row.data(), add ? xr : out + r * dim, w, dim, eps);
    }
  });
}

// Rotates the pairs (2i, 2i+1) of the first `heads` heads of each row by (cos, sin)[row, i]: the
// complex multiply (x0 + i x1)(cos + i sin).
template <typename T>
void rope_rows(T* qkv, const float* cos, const float* sin, int64_t rows, int64_t width,
               int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + r * half;
      const float* s = sin + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + (r * width + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x0 = f(x[2 * i]), x1 = f(x[2 * i + 1]);
          x[2 * i] = static_cast<T>(x0 * c[i] - x1 * s[i]);
          x[2 * i + 1] = static_cast<T>(x0 * s[i] + x1 * c[i]);
        }
      }
    }
  });
}

inline Vec silu(const Vec& g) { return g / (Vec(1.f) + g.neg().exp_u20()); }

// out = T(T(silu(gate)) * up), gate and up the two halves of each row: vectors of floats (two of
// them per bf16 vector, rounded to bf16 where torch rounds), then one value at a time.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t j = 0;
      if constexpr (std::is_same_v<T, float>) {
        for (; j + L <= inter; j += L) (silu(Vec::loadu(g + j)) * Vec::loadu(u + j)).store(o + j);
      } else if constexpr (std::is_same_v<T, at::BFloat16>) {
        using BVec = at::vec::Vectorized<at::BFloat16>;
        for (; j + 2 * L <= inter; j += 2 * L) {
          auto [g0, g1] = at::vec::convert_bfloat16_float(BVec::loadu(g + j));
          auto [u0, u1] = at::vec::convert_bfloat16_float(BVec::loadu(u + j));
          auto [a0, a1] = at::vec::convert_bfloat16_float(
              at::vec::convert_float_bfloat16(silu(g0), silu(g1)));
          at::vec::convert_float_bfloat16(a0 * u0, a1 * u1).store(o + j);
        }
      }
      for (; j < inter; ++j) {
        const float act = f(static_cast<T>(f(g[j]) / (1.f + std::exp(-f(g[j])))));
        o[j] = static_cast<T>(act * f(u[j]));
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 2 && x.size(-1) > 0, op,
              ": rows must be contiguous and not empty");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": unsupported dtype ", x.scalar_type());
}

void check_weight(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type() && w.numel() == x.size(-1),
              op, ": the weight must be contiguous, of x's dtype and row width");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  check_weight(x, weight, "rms_norm");
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t, false>(x.data_ptr<scalar_t>(), nullptr, out.data_ptr<scalar_t>(),
                               weight.data_ptr<scalar_t>(), x.numel() / dim, dim,
                               static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps) {
  check_rows(x, "add_rms_norm_");
  check_weight(x, weight, "add_rms_norm_");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: the residual must be contiguous, of x's shape and dtype");
  const int64_t dim = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm_", [&] {
    norm_rows<scalar_t, true>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), nullptr,
                              weight.data_ptr<scalar_t>(), x.numel() / dim, dim,
                              static_cast<float>(eps));
  });
  return x;
}

void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  check_rows(qkv, "rope_");
  TORCH_CHECK(qkv.dim() == 3 && heads >= 0 && heads <= qkv.size(1) && qkv.size(2) % 2 == 0,
              "rope_: qkv must be [rows, heads, even head_dim] with `heads` of them rotated");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == qkv.size(0) * qkv.size(2) / 2 && sin.numel() == cos.numel(),
              "rope_: cos and sin must be contiguous float32 [rows, head_dim / 2]");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_", [&] {
    rope_rows(qkv.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
              qkv.size(0), qkv.size(1), heads, qkv.size(2));
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_mul: rows must hold gate and up, of one width");
  const int64_t inter = gate_up.size(-1) / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                  gate_up.numel() / (2 * inter), inter);
  });
  return out;
}
