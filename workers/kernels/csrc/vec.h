// What prefixserve's vectorised CPU kernels share: ATen's Vectorized<float> at the width the
// compiler targets (-march=native: AVX-512, AVX2, or ATen's portable vectors), a load of any
// dtype widened to float, and a vector's lane sum and largest lane. Included by one translation
// unit each, so its definitions sit in an unnamed namespace like the kernels' own.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();

// The first n (<= L) values at p as floats; the rest of the vector is zero.
inline Vec load(const float* p, int64_t n) { return n == L ? Vec::loadu(p) : Vec::loadu(p, n); }

template <typename T>
inline Vec load(const T* p, int64_t n) {
  Vec out;
  if (n == L) {
    at::vec::load_to_float(p, out);
  } else {
    T tail[L] = {};
    std::copy(p, p + n, tail);
    at::vec::load_to_float(tail, out);
  }
  return out;
}

// The vector's lanes summed (DEFAULT's reduce_add does not compile in torch's headers).
inline float sum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_add();
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
#endif
}

// The vector's largest lane (DEFAULT's reduce_max does not compile either).
inline float largest(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_max();
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
#endif
}

}  // namespace
