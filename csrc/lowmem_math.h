// Per-element math of the low-memory kernels, shared by the CPU (.cpp) and CUDA (.cu)
// kernels so that the CPU tests exercise the very formulas the GPU runs.
//
// The templates take a value type V that is a scalar (float, double) or, on the CPU, an
// at::vec::Vectorized of one: only +, -, * and construction from a scalar are used.
#pragma once

#include <algorithm>
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


// Dropout masks from a counter-based generator, so that a backward regenerates its forward's mask from the
// seed alone: Philox4x32-10 (Salmon et al., SC 2011), the very rounds of ATen's PhiloxRNGEngine and Triton's
// tl.philox, so every backend draws the same mask from one seed. A seed is a key and a first counter (0 unless
// given: a GPU's generator hands out one key and consecutive counters, as to ATen's own random kernels). Element
// i of a (contiguous) tensor is kept when word i % 4 of the block for counter first + i / 4 (its low and high
// words the counter's first two; key: its low and high words) is at least dropout_threshold(p); kept values are
// scaled by 1 / (1 - p).
constexpr int kPhiloxRounds = 10;
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u, kPhiloxKeyB = 0xBB67AE85u;

// One Philox round on the counter words under key (k0, k1).
LOWMEM_HD void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  const uint64_t p0 = uint64_t{0xD2511F53u} * c0, p1 = uint64_t{0xCD9E8D57u} * c2;
  const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0, n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
  c1 = static_cast<uint32_t>(p1);
  c3 = static_cast<uint32_t>(p0);
  c0 = n0;
  c2 = n2;
}

// The four words of counter `counter` under key `seed`.
LOWMEM_HD void philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
LOWMEM_UNROLL
  for (int round = 0; round < kPhiloxRounds; ++round) {
    philox_round(c0, c1, c2, c3, k0, k1);
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// The smallest kept word for drop probability p in [0, 1): p * 2^32 rounded, so a word is dropped with
// probability p to within 2^-33. (lightning_lowmem/kernels/torch_ops.py computes the same.)
inline uint32_t dropout_threshold(double p) {
  return static_cast<uint32_t>(std::min(std::floor(p * 4294967296.0 + 0.5), 4294967295.0));
}

// Gated MLPs: h = act(g) * u. The activations the kernels know, by the activation registry's kernel id
// (lightning_lowmem/registry/activations.py), as X(enumerator, id). A new one is an entry here, its
// formulas in activation_and_slope below, and its ATen op in stock_activation_out (lowmem_kernels.h). M
// supplies the transcendental functions for V (exp, erf, tanh) and a select, so the CPU (scalar and
// Vectorized) and the GPU evaluate the same formulas.
#define LOWMEM_ACTIVATIONS(X) \
  X(kSilu, "silu")            \
  X(kGelu, "gelu")            \
  X(kGeluTanh, "gelu_tanh")

#define LOWMEM_ENUMERATOR(name, id) name,
enum class Activation : int { LOWMEM_ACTIVATIONS(LOWMEM_ENUMERATOR) };
#undef LOWMEM_ENUMERATOR

// Host-side: call ``f`` with the activation as a compile-time constant.
template <typename F>
inline void dispatch_activation(Activation kind, F&& f) {
  switch (kind) {
#define LOWMEM_CASE(name, id)                                       \
  case Activation::name:                                            \
    f(std::integral_constant<Activation, Activation::name>());      \
    break;
    LOWMEM_ACTIVATIONS(LOWMEM_CASE)
#undef LOWMEM_CASE
  }
}

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;

// value = act(g), slope = act'(g).
template <Activation kKind, typename M, typename V>
LOWMEM_HD void activation_and_slope(V g, V& value, V& slope) {
  const V one(1), half(0.5);
  if constexpr (kKind == Activation::kSilu) {
    const V s = one / (one + M::exp(V(0) - g));
    value = g * s;
    slope = s * (one + g * (one - s));
  } else if constexpr (kKind == Activation::kGelu) {
    const V cdf = half * (one + M::erf(g * V(kInvSqrt2)));
    value = g * cdf;
    slope = cdf + g * M::exp(V(-0.5) * g * g) * V(kInvSqrt2Pi);
  } else {
    const V t = M::tanh(V(kSqrt2OverPi) * (g + V(kTanhCubic) * g * g * g));
    value = half * g * (one + t);
    slope = half * (one + t) + half * g * (one - t * t) * V(kSqrt2OverPi) * (one + V(3 * kTanhCubic) * g * g);
  }
}

// Gradients of h = act(g) * u: grad_up = dh * act(g), grad_gate = dh * u * act'(g), from value =
// act(g) as the forward multiplied by it (rounded to the tensors' dtype) and slope = act'(g). With
// kRecoverUp the second input is h itself and u = h / act(g), which is exact only when value holds the
// forward's very bits (0 where act(g) == 0: there grad_up is exact and grad_gate is taken as 0, i.e.
// wrong only where g == 0 exactly and u != 0).
template <bool kRecoverUp, typename M, typename V>
LOWMEM_HD void gated_grads(V grad, V value, V slope, V second, V& grad_gate, V& grad_up) {
  V up = second;
  if constexpr (kRecoverUp) up = M::nonzero_or_zero(value, second / value);
  grad_up = grad * value;
  grad_gate = grad * up * slope;
}

// grad_gate where act(g) == 0 and u is known (kept by the forward, gated_exceptions): dh * u * act'(g), what
// gated_grads gives when it need not recover u.
template <Activation kKind, typename M, typename V>
LOWMEM_HD V exception_grad_gate(V grad, V gate, V up) {
  V value, slope;
  activation_and_slope<kKind, M>(gate, value, slope);
  return grad * up * slope;
}

}  // namespace lowmem
