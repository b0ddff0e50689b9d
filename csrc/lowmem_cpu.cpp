// CPU kernels: ATen's parallel_for (respects torch.set_num_threads) over blocks of elements or
// rows, at::vec::Vectorized arithmetic, fp32 accumulation (fp64 for fp64). Half and bfloat16
// blocks are staged into a small fp32 buffer so every kernel body works on one type.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#include "lowmem_kernels.h"
#include "lowmem_math.h"

namespace lowmem {

const c10::DeviceType kKernelDevice = c10::DeviceType::CPU;

namespace {

using at::vec::Vectorized;

constexpr int64_t kBlockBytes = 1024;  // packed bytes per staged block: 4096 elements, L1-resident

// Elements of T as acc_t: the data itself when the types agree, else a converted copy in buf.
template <typename T, typename acc_t>
const acc_t* as_acc(const T* src, acc_t* buf, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

template <typename acc_t>
acc_t load(const acc_t* p, int64_t i, acc_t) { return p[i]; }
template <typename acc_t>
Vectorized<acc_t> load(const acc_t* p, int64_t i, Vectorized<acc_t>) { return Vectorized<acc_t>::loadu(p + i); }
template <typename acc_t>
void store(acc_t* p, int64_t i, acc_t v) { p[i] = v; }
template <typename acc_t>
void store(acc_t* p, int64_t i, Vectorized<acc_t> v) { v.store(p + i); }

// Calls f(i, V{}) over [0, n): V is Vectorized<acc_t> in the body, acc_t in the tail.
template <typename acc_t, typename F>
void row_for_each(int64_t n, F&& f) {
  using Vec = Vectorized<acc_t>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) f(i, Vec());
  for (; i < n; ++i) f(i, acc_t());
}

// Sums over [0, n) of the K values term(i, V{}) returns: four independent vector accumulators
// per value (no add-latency chain), lanes reduced at the end, then the scalar tail.
template <typename acc_t, int K, typename F>
std::array<acc_t, K> row_sums(int64_t n, F&& term) {
  using Vec = Vectorized<acc_t>;
  constexpr int kUnroll = 4;
  constexpr int64_t W = Vec::size();
  std::array<std::array<Vec, kUnroll>, K> lanes;
  for (auto& per_value : lanes) per_value.fill(Vec(acc_t(0)));
  int64_t i = 0;
  for (; i + kUnroll * W <= n; i += kUnroll * W) {
    for (int u = 0; u < kUnroll; ++u) {
      const auto t = term(i + u * W, Vec());
      for (int k = 0; k < K; ++k) lanes[k][u] = lanes[k][u] + t[k];
    }
  }
  for (; i + W <= n; i += W) {
    const auto t = term(i, Vec());
    for (int k = 0; k < K; ++k) lanes[k][0] = lanes[k][0] + t[k];
  }
  std::array<acc_t, K> sums;
  for (int k = 0; k < K; ++k) {
    const Vec total = (lanes[k][0] + lanes[k][1]) + (lanes[k][2] + lanes[k][3]);
    sums[k] = at::vec::vec_reduce_all([](Vec a, Vec b) { return a + b; }, total);
  }
  for (; i < n; ++i) {
    const auto t = term(i, acc_t());
    for (int k = 0; k < K; ++k) sums[k] += t[k];
  }
  return sums;
}

// Codes of a staged block, one byte per element: a plain loop the compiler vectorizes.
template <typename acc_t>
void block_codes(const acc_t* x, int64_t n, const acc_t* thresholds, uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = step_code(x[i], thresholds);
}

// Byte-per-element codes <-> packed bytes; __restrict lets the compiler vectorize the 4:1 shuffle.
void pack_block(const uint8_t* __restrict codes, int64_t bytes, uint8_t* __restrict packed) {
  for (int64_t j = 0; j < bytes; ++j) {
    packed[j] = pack4(codes[4 * j], codes[4 * j + 1], codes[4 * j + 2], codes[4 * j + 3]);
  }
}

void unpack_block(const uint8_t* __restrict packed, int64_t bytes, uint8_t* __restrict codes) {
  for (int64_t j = 0; j < bytes; ++j) {
    for (int slot = 0; slot < 4; ++slot) codes[4 * j + slot] = unpack(packed[j], slot);
  }
}

template <typename T>
void step_codes_kernel(const T* x, int64_t numel, const double* thresholds_in, uint8_t* packed) {
  using acc_t = at::opmath_type<T>;
  const acc_t thresholds[3] = {acc_t(thresholds_in[0]), acc_t(thresholds_in[1]), acc_t(thresholds_in[2])};
  const int64_t bytes = (numel + 3) / 4;
  at::parallel_for(0, bytes, kBlockBytes, [&](int64_t begin, int64_t end) {
    std::array<acc_t, 4 * kBlockBytes> buf;
    std::array<uint8_t, 4 * kBlockBytes> codes;
    for (int64_t b0 = begin; b0 < end; b0 += kBlockBytes) {
      const int64_t nb = std::min(kBlockBytes, end - b0);
      const int64_t ne = std::min(4 * nb, numel - 4 * b0);
      block_codes(as_acc(x + 4 * b0, buf.data(), ne), ne, thresholds, codes.data());
      std::fill(codes.begin() + ne, codes.begin() + 4 * nb, uint8_t(0));  // a partial last byte pads with 0
      pack_block(codes.data(), nb, packed + b0);
    }
  });
}

template <typename acc_t>
void scale_block(const acc_t* __restrict grad, const uint8_t* __restrict codes, int64_t n, const acc_t* levels_in,
                 acc_t* __restrict out) {
  const acc_t levels[4] = {levels_in[0], levels_in[1], levels_in[2], levels_in[3]};  // local: the selects vectorize
  for (int64_t i = 0; i < n; ++i) out[i] = grad[i] * level_of(codes[i], levels);
}

template <typename T>
void step_scale_kernel(const T* grad, const uint8_t* packed, int64_t numel, const double* levels_in, T* out) {
  using acc_t = at::opmath_type<T>;
  const acc_t levels[4] = {acc_t(levels_in[0]), acc_t(levels_in[1]), acc_t(levels_in[2]), acc_t(levels_in[3])};
  const int64_t bytes = (numel + 3) / 4;
  at::parallel_for(0, bytes, kBlockBytes, [&](int64_t begin, int64_t end) {
    std::array<acc_t, 4 * kBlockBytes> buf;
    std::array<uint8_t, 4 * kBlockBytes> codes;
    for (int64_t b0 = begin; b0 < end; b0 += kBlockBytes) {
      const int64_t nb = std::min(kBlockBytes, end - b0);
      const int64_t ne = std::min(4 * nb, numel - 4 * b0);
      unpack_block(packed + b0, nb, codes.data());
      const acc_t* g = as_acc(grad + 4 * b0, buf.data(), ne);
      acc_t* result = std::is_same_v<T, acc_t> ? reinterpret_cast<acc_t*>(out + 4 * b0) : buf.data();
      scale_block(g, codes.data(), ne, levels, result);
      if constexpr (!std::is_same_v<T, acc_t>) at::vec::convert(result, out + 4 * b0, ne);
    }
  });
}

// Rows per parallel task: enough elements (ATen's grain size) that a task outweighs its scheduling.
int64_t row_grain(int64_t dim) { return std::max<int64_t>(1, 32768 / dim); }

template <typename T, typename U>
void norm_forward_kernel(const T* x, int64_t rows, int64_t dim, double eps_in, bool center, U* z, at::opmath_type<T>* rstd) {
  using acc_t = at::opmath_type<T>;
  const acc_t eps = acc_t(eps_in);
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> staged(std::is_same_v<T, acc_t> ? 0 : dim), out_buf(std::is_same_v<U, acc_t> ? 0 : dim);
    for (int64_t row = begin; row < end; ++row) {
      const acc_t* xr = as_acc(x + row * dim, staged.data(), dim);
      acc_t mean = 0;
      if (center) {
        mean = row_sums<acc_t, 1>(dim, [&](int64_t i, auto v) { return std::array{load(xr, i, v)}; })[0] / acc_t(dim);
      }
      const acc_t mean_square = row_sums<acc_t, 1>(dim, [&](int64_t i, auto v) {
        using V = decltype(v);
        return std::array{centered_square(load(xr, i, v), V(mean))};
      })[0] / acc_t(dim);
      const acc_t r = inverse_std(mean_square, eps);
      rstd[row] = r;
      acc_t* zr = std::is_same_v<U, acc_t> ? reinterpret_cast<acc_t*>(z + row * dim) : out_buf.data();
      row_for_each<acc_t>(dim, [&](int64_t i, auto v) {
        using V = decltype(v);
        store(zr, i, normalized(load(xr, i, v), V(mean), V(r)));
      });
      if constexpr (!std::is_same_v<U, acc_t>) at::vec::convert(zr, z + row * dim, dim);
    }
  });
}

template <typename U, typename T>
void norm_backward_kernel(const U* grad, const U* z, const at::opmath_type<U>* rstd, int64_t rows, int64_t dim,
                          bool center, T* grad_input) {
  using acc_t = at::opmath_type<U>;
  constexpr bool staged = !std::is_same_v<U, acc_t>;
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> g_buf(staged ? dim : 0), z_buf(staged ? dim : 0), out_buf(std::is_same_v<T, acc_t> ? 0 : dim);
    for (int64_t row = begin; row < end; ++row) {
      const acc_t* g = as_acc(grad + row * dim, g_buf.data(), dim);
      const acc_t* zr = as_acc(z + row * dim, z_buf.data(), dim);
      const auto [sum_g, sum_gz] = row_sums<acc_t, 2>(dim, [&](int64_t i, auto v) {
        const auto gv = load(g, i, v);
        return std::array{gv, gv * load(zr, i, v)};
      });
      const acc_t mean_g = center ? sum_g / acc_t(dim) : acc_t(0);
      const acc_t mean_gz = sum_gz / acc_t(dim);
      const acc_t r = rstd[row];
      acc_t* dx = std::is_same_v<T, acc_t> ? reinterpret_cast<acc_t*>(grad_input + row * dim) : out_buf.data();
      row_for_each<acc_t>(dim, [&](int64_t i, auto v) {
        using V = decltype(v);
        store(dx, i, norm_input_grad(load(g, i, v), load(zr, i, v), V(r), V(mean_g), V(mean_gz)));
      });
      if constexpr (!std::is_same_v<T, acc_t>) at::vec::convert(dx, grad_input + row * dim, dim);
    }
  });
}

}  // namespace

void step_codes(const at::Tensor& x, const double* thresholds, at::Tensor& packed) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "step_codes", [&] {
    step_codes_kernel(x.const_data_ptr<scalar_t>(), x.numel(), thresholds, packed.mutable_data_ptr<uint8_t>());
  });
}

void step_scale(const at::Tensor& grad, const at::Tensor& packed, const double* levels, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "step_scale", [&] {
    step_scale_kernel(grad.const_data_ptr<scalar_t>(), packed.const_data_ptr<uint8_t>(), grad.numel(), levels,
                      out.mutable_data_ptr<scalar_t>());
  });
}

void norm_forward(const at::Tensor& x, int64_t dim, double eps, bool center, at::Tensor& z, at::Tensor& rstd) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "norm_forward", [&] {
    using in_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "norm_forward", [&] {
      norm_forward_kernel(x.const_data_ptr<in_t>(), rstd.numel(), dim, eps, center, z.mutable_data_ptr<scalar_t>(),
                          rstd.mutable_data_ptr<at::opmath_type<in_t>>());
    });
  });
}

void norm_backward(const at::Tensor& grad, const at::Tensor& z, const at::Tensor& rstd, int64_t dim, bool center,
                   at::Tensor& grad_input) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "norm_backward", [&] {
    using out_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_input.scalar_type(), "norm_backward", [&] {
      norm_backward_kernel(grad.const_data_ptr<out_t>(), z.const_data_ptr<out_t>(),
                           rstd.const_data_ptr<at::opmath_type<out_t>>(), rstd.numel(), dim, center,
                           grad_input.mutable_data_ptr<scalar_t>());
    });
  });
}

}  // namespace lowmem
