// Per-element math of the low-memory kernels, shared by the CPU (.cpp) and CUDA (.cu)
// kernels so that the CPU tests exercise the very formulas the GPU runs.
//
// The templates take a value type V that is a scalar (float, double) or, on the CPU, an
// at::vec::Vectorized of one: only +, -, * and construction from a scalar are used.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define LOWMEM_HD __host__ __device__ __forceinline__
#else
#define LOWMEM_HD inline
#endif

namespace lowmem {

// 2-bit code of one element: how many of the three ascending thresholds it exceeds.
template <typename acc_t>
LOWMEM_HD uint8_t step_code(acc_t x, const acc_t* thresholds) {
  return static_cast<uint8_t>((x > thresholds[0]) + (x > thresholds[1]) + (x > thresholds[2]));
}

// Element i of a packed buffer lives in bits 2*(i%4) of byte i/4.
LOWMEM_HD uint8_t pack4(uint8_t c0, uint8_t c1, uint8_t c2, uint8_t c3) {
  return static_cast<uint8_t>(c0 | (c1 << 2) | (c2 << 4) | (c3 << 6));
}

LOWMEM_HD uint8_t unpack(uint8_t byte, int slot) {
  return static_cast<uint8_t>((byte >> (2 * slot)) & 3);
}

// Derivative level of a code, without indexing (a dynamic index would spill to local memory on GPU).
template <typename acc_t>
LOWMEM_HD acc_t level_of(uint8_t code, const acc_t* levels) {
  return code == 0 ? levels[0] : code == 1 ? levels[1] : code == 2 ? levels[2] : levels[3];
}

template <typename V>
LOWMEM_HD V centered_square(V x, V mean) {
  V d = x - mean;
  return d * d;
}

template <typename acc_t>
LOWMEM_HD acc_t inverse_std(acc_t mean_square, acc_t eps) {
  using std::sqrt;
  return acc_t(1) / sqrt(mean_square + eps);
}

// Affine-free norm output; RMSNorm passes mean = 0.
template <typename V>
LOWMEM_HD V normalized(V x, V mean, V rstd) {
  return (x - mean) * rstd;
}

// Paper, algorithms 2-3: dx = rstd * (g - mean(g) - z * mean(g*z)); RMSNorm passes mean_g = 0.
template <typename V>
LOWMEM_HD V norm_input_grad(V g, V z, V rstd, V mean_g, V mean_gz) {
  return rstd * ((g - mean_g) - z * mean_gz);
}

}  // namespace lowmem
