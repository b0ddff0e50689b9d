// Per-element math of the low-memory kernels, shared by the CPU (.cpp) and CUDA (.cu)
// kernels so that the CPU tests exercise the very formulas the GPU runs.
//
// The templates take a value type V that is a scalar (float, double) or, on the CPU, an
// at::vec::Vectorized of one: only +, -, * and construction from a scalar are used.
#pragma once

#include <type_traits>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define LOWMEM_HD __host__ __device__ __forceinline__
#else
#define LOWMEM_HD inline
#endif

#if defined(__CUDACC__)
#define LOWMEM_UNROLL _Pragma("unroll")
#elif defined(__clang__)
#define LOWMEM_UNROLL _Pragma("unroll")
#else
#define LOWMEM_UNROLL _Pragma("GCC unroll 16")
#endif

namespace lowmem {

// k-bit codes (k = 1, 2 or 4): a code is how many of the 2^k - 1 ascending thresholds an element
// exceeds; 8/k codes per byte, element i in bits k*(i % (8/k)) of byte i / (8/k). Fewer thresholds
// than 2^k - 1 (3-bit tables stored as 4-bit) are padded with +infinity, which nothing exceeds.
template <int kBits>
struct Packing {
  static_assert(kBits == 1 || kBits == 2 || kBits == 4, "codes are 1, 2 or 4 bits");
  static constexpr int kPerByte = 8 / kBits;
  static constexpr int kThresholds = (1 << kBits) - 1;
  static constexpr int kLevels = 1 << kBits;
  static constexpr uint8_t kMask = static_cast<uint8_t>((1 << kBits) - 1);
};

template <int kBits, typename acc_t>
LOWMEM_HD uint8_t step_code(acc_t x, const acc_t* thresholds) {
  uint8_t code = 0;
LOWMEM_UNROLL
  for (int t = 0; t < Packing<kBits>::kThresholds; ++t) code += static_cast<uint8_t>(x > thresholds[t]);
  return code;
}

template <int kBits>
LOWMEM_HD uint8_t pack_byte(const uint8_t* codes) {
  uint8_t byte = 0;
LOWMEM_UNROLL
  for (int slot = 0; slot < Packing<kBits>::kPerByte; ++slot) byte |= static_cast<uint8_t>(codes[slot] << (kBits * slot));
  return byte;
}

template <int kBits>
LOWMEM_HD uint8_t unpack(uint8_t byte, int slot) {
  return static_cast<uint8_t>((byte >> (kBits * slot)) & Packing<kBits>::kMask);
}

// Derivative level of a code by an unrolled select chain, not indexing (a dynamic index would
// spill the table to local memory on GPU).
template <int kBits, typename acc_t>
LOWMEM_HD acc_t level_of(uint8_t code, const acc_t* levels) {
  acc_t level = levels[0];
LOWMEM_UNROLL
  for (int k = 1; k < Packing<kBits>::kLevels; ++k) level = code >= k ? levels[k] : level;
  return level;
}

// Storage bits for a number of thresholds (1 -> 1, 2..3 -> 2, 4..15 -> 4); 0 if unsupported.
LOWMEM_HD int storage_bits(int64_t thresholds) {
  return thresholds == 1 ? 1 : thresholds >= 2 && thresholds <= 3 ? 2 : thresholds >= 4 && thresholds <= 15 ? 4 : 0;
}

// Host-side: call ``f`` with the storage bits as a compile-time constant (1, 2 or 4).
template <typename F>
inline void dispatch_bits(int bits, F&& f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    default: f(std::integral_constant<int, 4>()); break;
  }
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
