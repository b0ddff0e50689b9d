// CUDA kernels: grid-stride loops with 64-bit indices, launched on the current stream.
// Element-wise kernels take one packed byte (8/k elements of k-bit codes) per thread; norms take one row
// per block with a two-pass (mean, then centered squares) block reduction in fp32 (fp64).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "lowmem_kernels.h"
#include "lowmem_math.h"

namespace lowmem {

const c10::DeviceType kKernelDevice = c10::DeviceType::CUDA;

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

int64_t elementwise_blocks(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, kMaxBlocks * 8));
}

template <typename acc_t>
struct Table {
  acc_t v[16];
};

// One packed byte (8/kBits elements) per thread.
template <int kBits, typename T>
__global__ void step_codes_kernel(const T* __restrict__ x, int64_t numel, Table<at::opmath_type<T>> thresholds,
                                  uint8_t* __restrict__ packed) {
  using acc_t = at::opmath_type<T>;
  constexpr int P = Packing<kBits>::kPerByte;
  const int64_t bytes = (numel + P - 1) / P;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < bytes; j += int64_t(gridDim.x) * blockDim.x) {
    uint8_t codes[P];
LOWMEM_UNROLL
    for (int slot = 0; slot < P; ++slot) {
      const int64_t i = P * j + slot;
      codes[slot] = i < numel ? step_code<kBits>(static_cast<acc_t>(x[i]), thresholds.v) : uint8_t(0);
    }
    packed[j] = pack_byte<kBits>(codes);
  }
}

template <int kBits, typename T>
__global__ void step_scale_kernel(const T* __restrict__ grad, const uint8_t* __restrict__ packed, int64_t numel,
                                  Table<at::opmath_type<T>> levels, T* __restrict__ out) {
  using acc_t = at::opmath_type<T>;
  constexpr int P = Packing<kBits>::kPerByte;
  const int64_t bytes = (numel + P - 1) / P;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < bytes; j += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t byte = packed[j];
LOWMEM_UNROLL
    for (int slot = 0; slot < P; ++slot) {
      const int64_t i = P * j + slot;
      if (i < numel) {
        out[i] = static_cast<T>(static_cast<acc_t>(grad[i]) * level_of<kBits>(unpack<kBits>(byte, slot), levels.v));
      }
    }
  }
}

template <typename acc_t>
__device__ acc_t warp_sum(acc_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block, returned to every thread. `shared` holds 32 values.
template <typename acc_t>
__device__ acc_t block_sum(acc_t v, acc_t* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  __syncthreads();  // the previous call's readers are done with `shared`
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (blockDim.x + 31) / 32 ? shared[lane] : acc_t(0);
    v = warp_sum(v);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

// z and rstd of each row; with a scale or a shift also y = scale * z + shift from z as stored (rounded to U), in
// the pass that writes z.
template <typename T, typename U>
__global__ void norm_forward_kernel(const T* __restrict__ x, int64_t rows, int64_t dim, at::opmath_type<T> eps,
                                    bool center, U* __restrict__ z, at::opmath_type<T>* __restrict__ rstd,
                                    const at::opmath_type<T>* __restrict__ scale,
                                    const at::opmath_type<T>* __restrict__ shift, U* __restrict__ y) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t shared[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * dim;
    acc_t mean = 0;
    if (center) {
      acc_t sum = 0;
      for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += static_cast<acc_t>(xr[i]);
      mean = block_sum(sum, shared) / acc_t(dim);
    }
    acc_t squares = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) squares += centered_square(static_cast<acc_t>(xr[i]), mean);
    const acc_t r = inverse_std(block_sum(squares, shared) / acc_t(dim), eps);
    if (threadIdx.x == 0) rstd[row] = r;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      const U zi = static_cast<U>(normalized(static_cast<acc_t>(xr[i]), mean, r));
      z[row * dim + i] = zi;
      if (y) y[row * dim + i] = static_cast<U>((scale ? scale[i] : acc_t(1)) * static_cast<acc_t>(zi) + (shift ? shift[i] : acc_t(0)));
    }
  }
}

template <typename U, typename T>
__global__ void norm_backward_kernel(const U* __restrict__ grad, const U* __restrict__ z,
                                     const at::opmath_type<U>* __restrict__ rstd,
                                     const at::opmath_type<U>* __restrict__ scale, int64_t rows, int64_t dim,
                                     bool center, T* __restrict__ grad_input) {
  using acc_t = at::opmath_type<U>;
  __shared__ acc_t shared[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const U* g = grad + row * dim;
    const U* zr = z + row * dim;
    acc_t sum_g = 0, sum_gz = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      const acc_t gi = static_cast<acc_t>(g[i]) * (scale ? scale[i] : acc_t(1));
      sum_g += gi;
      sum_gz += gi * static_cast<acc_t>(zr[i]);
    }
    const acc_t mean_g = center ? block_sum(sum_g, shared) / acc_t(dim) : acc_t(0);
    const acc_t mean_gz = block_sum(sum_gz, shared) / acc_t(dim);
    const acc_t r = rstd[row];
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      const acc_t gi = static_cast<acc_t>(g[i]) * (scale ? scale[i] : acc_t(1));
      grad_input[row * dim + i] = static_cast<T>(norm_input_grad(gi, static_cast<acc_t>(zr[i]), r, mean_g, mean_gz));
    }
  }
}

// A norm's gamma and beta gradients, sum(grad * z) and sum(grad) over the rows, in two launches: this kernel sums
// each chunk of rows (blockIdx.y) for a tile of columns (blockIdx.x; a warp reads a row's tile, coalesced), the
// caller sums the chunks. Fixed order throughout: the same bits from run to run.
constexpr int kColumnTile = 32, kColumnLanes = 8;
constexpr int64_t kColumnSumRows = 64, kColumnSumChunks = 64;

template <typename U>
__global__ void norm_column_sums_kernel(const U* __restrict__ grad, const U* __restrict__ z, int64_t rows,
                                        int64_t dim, int64_t rows_per_chunk, at::opmath_type<U>* __restrict__ partial) {
  using acc_t = at::opmath_type<U>;
  __shared__ acc_t lanes[2][kColumnLanes][kColumnTile + 1];
  const int64_t column = blockIdx.x * int64_t(kColumnTile) + threadIdx.x;
  const int64_t first = blockIdx.y * rows_per_chunk;
  const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  acc_t grad_z = 0, grad_sum = 0;
  if (column < dim) {
    for (int64_t r = first + threadIdx.y; r < last; r += kColumnLanes) {
      const acc_t g = static_cast<acc_t>(grad[r * dim + column]);
      grad_z += g * static_cast<acc_t>(z[r * dim + column]);
      grad_sum += g;
    }
  }
  lanes[0][threadIdx.y][threadIdx.x] = grad_z;
  lanes[1][threadIdx.y][threadIdx.x] = grad_sum;
  __syncthreads();
  if (threadIdx.y < 2 && column < dim) {
    acc_t total = 0;
    for (int k = 0; k < kColumnLanes; ++k) total += lanes[threadIdx.y][k][threadIdx.x];
    partial[(blockIdx.y * 2 + threadIdx.y) * dim + column] = total;
  }
}

// Transcendentals and select for activation_and_slope / gated_grads in device code.
struct DeviceMath {
  __device__ static float exp(float x) { return ::expf(x); }
  __device__ static double exp(double x) { return ::exp(x); }
  __device__ static float erf(float x) { return ::erff(x); }
  __device__ static double erf(double x) { return ::erf(x); }
  __device__ static float tanh(float x) { return ::tanhf(x); }
  __device__ static double tanh(double x) { return ::tanh(x); }
  template <typename T>
  __device__ static T nonzero_or_zero(T cond, T value) { return cond != T(0) ? value : T(0); }
};

// act(gate) is the forward's (`act`, with kRecoverUp) or evaluated here, rounded as the forward's product saw it.
template <Activation kKind, bool kRecoverUp, typename T>
__global__ void gated_backward_kernel(const T* __restrict__ grad, const T* __restrict__ gate,
                                      const T* __restrict__ second, const T* __restrict__ act, int64_t numel,
                                      T* __restrict__ grad_gate, T* __restrict__ grad_up) {
  using acc_t = at::opmath_type<T>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x) {
    acc_t value, slope, dg, du;
    activation_and_slope<kKind, DeviceMath>(static_cast<acc_t>(gate[i]), value, slope);
    value = static_cast<acc_t>(kRecoverUp ? act[i] : static_cast<T>(value));
    gated_grads<kRecoverUp, DeviceMath>(static_cast<acc_t>(grad[i]), value, slope, static_cast<acc_t>(second[i]), dg, du);
    grad_gate[i] = static_cast<T>(dg);
    grad_up[i] = static_cast<T>(du);
  }
}

// A warp per row, 8 x 32 columns a step, each load coalesced; the step's zeros (rare) take the row's next slots in
// column order (a ballot per 32).
template <typename T>
__global__ void gated_exceptions_kernel(const T* __restrict__ act, const T* __restrict__ up, int64_t up_row_stride,
                                        int64_t rows, int64_t cols, int64_t slots, int32_t* __restrict__ columns,
                                        T* __restrict__ up_at) {
  using acc_t = at::opmath_type<T>;
  constexpr int kWarp = 32, kSteps = 8;
  const int lane = threadIdx.x % kWarp;
  const unsigned before = (1u << lane) - 1u;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; r < rows; r += warps) {
    const T* a = act + r * cols;
    int64_t n = 0;  // the row's zeros so far: the same in every lane
    for (int64_t c0 = 0; c0 < cols && n < slots; c0 += kWarp * kSteps) {
      bool zero[kSteps];
      bool any = false;
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        const int64_t c = c0 + k * kWarp + lane;
        zero[k] = c < cols && static_cast<acc_t>(a[c]) == acc_t(0);
        any |= zero[k];
      }
      if (!__any_sync(0xffffffffu, any)) continue;
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        const unsigned mask = __ballot_sync(0xffffffffu, zero[k]);
        const int64_t slot = n + __popc(mask & before);
        if (zero[k] && slot < slots) {
          const int64_t c = c0 + k * kWarp + lane;
          columns[r * slots + slot] = static_cast<int32_t>(c);
          up_at[r * slots + slot] = up[r * up_row_stride + c];
        }
        n += __popc(mask);
      }
    }
    for (int64_t s = n + lane; s < slots; s += kWarp) {
      columns[r * slots + s] = -1;
      up_at[r * slots + s] = T(0);
    }
  }
}

// The gate gradient at the forward's exceptions (gated_exceptions), which gated_backward_kernel took up = 0 at.
template <Activation kKind, typename T>
__global__ void gated_exceptions_backward_kernel(const T* __restrict__ grad, const T* __restrict__ gate,
                                                 const int32_t* __restrict__ columns, const T* __restrict__ up_at,
                                                 int64_t count, int64_t slots, int64_t cols, T* __restrict__ grad_gate) {
  using acc_t = at::opmath_type<T>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t c = columns[i];
    if (c < 0) continue;
    const int64_t e = i / slots * cols + c;
    grad_gate[e] = static_cast<T>(exception_grad_gate<kKind, DeviceMath>(
        static_cast<acc_t>(grad[e]), static_cast<acc_t>(gate[e]), static_cast<acc_t>(up_at[i])));
  }
}

// out = product * scale + total (x) shift, an element a thread (see affine_weight_grad in lowmem_kernels.h).
template <typename T, typename O>
__global__ void affine_weight_grad_kernel(const T* __restrict__ product, const T* __restrict__ total,
                                          const at::opmath_type<O>* __restrict__ scale,
                                          const at::opmath_type<O>* __restrict__ shift, int64_t numel, int64_t cols,
                                          O* __restrict__ out) {
  using acc_t = at::opmath_type<O>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % cols;
    acc_t value = static_cast<acc_t>(product[i]);
    if (scale) value *= scale[c];
    if (shift) value += static_cast<acc_t>(total[i / cols]) * shift[c];
    out[i] = static_cast<O>(value);
  }
}

// The first `count` values, the rest padded with `pad` (+inf thresholds: never exceeded; the last level).
template <typename acc_t>
Table<acc_t> table_of(const double* values, int64_t count, int size, bool thresholds) {
  Table<acc_t> table{};
  for (int k = 0; k < size; ++k) {
    table.v[k] = k < count ? acc_t(values[k])
                 : thresholds ? std::numeric_limits<acc_t>::infinity()
                              : acc_t(values[count - 1]);
  }
  return table;
}

// Threads per row: a multiple of 32 up to 512, no more than the row needs.
int norm_threads(int64_t dim) {
  return static_cast<int>(std::min<int64_t>(512, std::max<int64_t>(32, (dim + 31) / 32 * 32)));
}

// One Philox counter (four elements) per thread; the seed is read on the device (no host synchronisation): from
// `seed` (seed_words int64: key, first counter), or with kDraw from the generator's state, unpacked here (as ATen's
// kernels do: CUDA-graph safe) and written to `seed` for the backward. ATen's offset counts 32-bit values of a
// thread's subsequence; the mask takes subsequence 0's counters from offset / 4 on, four values each (what
// dropout_draw reserves). `x` and `out` may be one tensor (an owned input dropped in place): no __restrict__.
template <typename T, bool kDraw>
__global__ void dropout_kernel(const T* x, int64_t numel, int64_t* __restrict__ seed, int seed_words,
                               at::PhiloxCudaState state, uint32_t threshold, at::opmath_type<T> scale, T* out) {
  using acc_t = at::opmath_type<T>;
  uint64_t key, first;
  if constexpr (kDraw) {
    const auto unpacked = at::cuda::philox::unpack(state);
    key = std::get<0>(unpacked);
    first = std::get<1>(unpacked) / 4;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      seed[0] = static_cast<int64_t>(key);
      seed[1] = static_cast<int64_t>(first);
    }
  } else {
    key = static_cast<uint64_t>(seed[0]);
    first = seed_words > 1 ? static_cast<uint64_t>(seed[1]) : 0;
  }
  const int64_t counters = (numel + 3) / 4;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < counters;
       c += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    uint32_t words[4];
    philox4x32(key, first + static_cast<uint64_t>(c), words);
LOWMEM_UNROLL
    for (int k = 0; k < 4; ++k) {
      const int64_t i = 4 * c + k;
      if (i < numel) out[i] = static_cast<T>(words[k] >= threshold ? static_cast<acc_t>(x[i]) * scale : acc_t(0));
    }
  }
}

}  // namespace

void act_codes(const at::Tensor& x, const double* thresholds, int64_t count, at::Tensor& packed) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t blocks = elementwise_blocks(packed.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_codes", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_bits(storage_bits(count), [&](auto bits) {
      constexpr int kBits = decltype(bits)::value;
      step_codes_kernel<kBits, scalar_t><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(), x.numel(), table_of<acc_t>(thresholds, count, Packing<kBits>::kThresholds, true),
          packed.mutable_data_ptr<uint8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void step_scale(const at::Tensor& grad, const at::Tensor& packed, const double* levels, int64_t count, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t blocks = elementwise_blocks(packed.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "step_scale", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_bits(storage_bits(count - 1), [&](auto bits) {
      constexpr int kBits = decltype(bits)::value;
      step_scale_kernel<kBits, scalar_t><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          grad.const_data_ptr<scalar_t>(), packed.const_data_ptr<uint8_t>(), grad.numel(),
          table_of<acc_t>(levels, count, Packing<kBits>::kLevels, false), out.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// With a scale or shift, the kernel writes the affine's output y beside z (norm_affine_forward), as on the CPU.
void norm_forward(const at::Tensor& x, int64_t dim, double eps, bool center, at::Tensor& z, at::Tensor& rstd,
                  const at::Tensor& scale, const at::Tensor& shift, at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = rstd.numel();
  const int64_t blocks = std::min<int64_t>(rows, kMaxBlocks * 32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "norm_forward", [&] {
    using in_t = scalar_t;
    using acc_t = at::opmath_type<in_t>;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "norm_forward", [&] {
      norm_forward_kernel<in_t, scalar_t><<<blocks, norm_threads(dim), 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<in_t>(), rows, dim, acc_t(eps), center, z.mutable_data_ptr<scalar_t>(),
          rstd.mutable_data_ptr<acc_t>(), scale.defined() ? scale.const_data_ptr<acc_t>() : nullptr,
          shift.defined() ? shift.const_data_ptr<acc_t>() : nullptr,
          y.defined() ? y.mutable_data_ptr<scalar_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void act_forward(const at::Tensor& x, Activation kind, const double* thresholds, int64_t count, at::Tensor& y,
                 at::Tensor& packed) {
  act_codes(x, thresholds, count, packed);  // first, as on the CPU: x is still in cache from the op that wrote it
  stock_activation_out(x, kind, y);
}

void norm_backward(const at::Tensor& grad, const at::Tensor& z, const at::Tensor& rstd, const at::Tensor& scale,
                   int64_t dim, bool center, at::Tensor& grad_input, at::Tensor& sums) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t rows = rstd.numel();
  const int64_t blocks = std::min<int64_t>(rows, kMaxBlocks * 32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "norm_backward", [&] {
    using out_t = scalar_t;
    using acc_t = at::opmath_type<out_t>;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_input.scalar_type(), "norm_backward", [&] {
      norm_backward_kernel<out_t, scalar_t><<<blocks, norm_threads(dim), 0, c10::cuda::getCurrentCUDAStream()>>>(
          grad.const_data_ptr<out_t>(), z.const_data_ptr<out_t>(), rstd.const_data_ptr<acc_t>(),
          scale.defined() ? scale.const_data_ptr<acc_t>() : nullptr, rows, dim, center,
          grad_input.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  if (sums.defined()) {  // per chunk of rows, then over the chunks: two launches, in a fixed order
    const int64_t chunks = std::min<int64_t>(kColumnSumChunks, (rows + kColumnSumRows - 1) / kColumnSumRows);
    const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
    at::Tensor partial = at::empty({chunks, 2, dim}, sums.options());
    const dim3 grid((dim + kColumnTile - 1) / kColumnTile, chunks);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "norm_backward", [&] {
      norm_column_sums_kernel<scalar_t><<<grid, dim3(kColumnTile, kColumnLanes), 0, c10::cuda::getCurrentCUDAStream()>>>(
          grad.const_data_ptr<scalar_t>(), z.const_data_ptr<scalar_t>(), rows, dim, rows_per_chunk,
          partial.mutable_data_ptr<at::opmath_type<scalar_t>>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    at::sum_out(sums, partial, 0);
  }
}

void gated_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& second, const at::Tensor& act,
                    const at::Tensor& columns, const at::Tensor& up_at, Activation kind, at::Tensor& grad_gate,
                    at::Tensor& grad_up) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t blocks = elementwise_blocks(grad.numel());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gated_backward", [&] {
    dispatch_activation(kind, [&](auto activation) {
      constexpr Activation kKind = decltype(activation)::value;
      const auto launch = [&](auto recover) {
        gated_backward_kernel<kKind, decltype(recover)::value, scalar_t><<<blocks, kThreads, 0, stream>>>(
            grad.const_data_ptr<scalar_t>(), gate.const_data_ptr<scalar_t>(), second.const_data_ptr<scalar_t>(),
            act.defined() ? act.const_data_ptr<scalar_t>() : nullptr, grad.numel(),
            grad_gate.mutable_data_ptr<scalar_t>(), grad_up.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (act.defined()) {
        launch(std::true_type());
      } else {
        launch(std::false_type());
      }
      if (columns.defined() && columns.numel() > 0) {
        gated_exceptions_backward_kernel<kKind, scalar_t><<<elementwise_blocks(columns.numel()), kThreads, 0, stream>>>(
            grad.const_data_ptr<scalar_t>(), gate.const_data_ptr<scalar_t>(), columns.const_data_ptr<int32_t>(),
            up_at.const_data_ptr<scalar_t>(), columns.numel(), columns.size(1), grad.dim() ? grad.size(-1) : 1,
            grad_gate.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
}

void gated_exceptions(const at::Tensor& act, const at::Tensor& up, at::Tensor& columns, at::Tensor& up_at) {
  const c10::cuda::CUDAGuard guard(act.device());
  constexpr int64_t kWarp = 32;
  const int64_t rows = up.size(0);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((rows * kWarp + kThreads - 1) / kThreads, kMaxBlocks));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, act.scalar_type(), "gated_exceptions", [&] {
    gated_exceptions_kernel<scalar_t><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        act.const_data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>(), up.stride(0), rows, up.size(1),
        columns.size(1), columns.mutable_data_ptr<int32_t>(), up_at.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

namespace {

// dropout_input_and_grad: one Philox counter (four elements) per thread, both outputs from its words. `masked` may
// be `grad` (a gradient masked in place): no __restrict__ on either.
template <typename X, typename T>
__global__ void dropout_pair_kernel(const X* __restrict__ x, const at::opmath_type<T>* __restrict__ scale,
                                    const at::opmath_type<T>* __restrict__ shift, int64_t dim,
                                    const T* grad, int64_t numel, const int64_t* __restrict__ seed,
                                    int seed_words, uint32_t threshold, at::opmath_type<T> kept_scale,
                                    T* __restrict__ read, T* masked) {
  using acc_t = at::opmath_type<T>;
  const uint64_t key = static_cast<uint64_t>(seed[0]);
  const uint64_t first = seed_words > 1 ? static_cast<uint64_t>(seed[1]) : 0;
  const int64_t counters = (numel + 3) / 4;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < counters;
       c += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    uint32_t words[4];
    philox4x32(key, first + static_cast<uint64_t>(c), words);
LOWMEM_UNROLL
    for (int k = 0; k < 4; ++k) {
      const int64_t i = 4 * c + k;
      if (i >= numel) continue;
      const bool keep = words[k] >= threshold;
      acc_t v = static_cast<acc_t>(x[i]);
      if (scale != nullptr) v = v * scale[i % dim];
      if (shift != nullptr) v = v + shift[i % dim];
      const acc_t rebuilt = static_cast<acc_t>(static_cast<T>(static_cast<acc_t>(static_cast<X>(v))));  // x's, then T's
      read[i] = static_cast<T>(keep ? rebuilt * kept_scale : acc_t(0));
      masked[i] = static_cast<T>(keep ? static_cast<acc_t>(grad[i]) * kept_scale : acc_t(0));
    }
  }
}

template <bool kDraw>
void launch_dropout(const at::Tensor& x, double p, const at::Tensor& seed, at::PhiloxCudaState state,
                    at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t blocks = elementwise_blocks((x.numel() + 3) / 4);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dropout", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dropout_kernel<scalar_t, kDraw><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), x.numel(), const_cast<int64_t*>(seed.const_data_ptr<int64_t>()),
        static_cast<int>(seed.numel()), state, dropout_threshold(p), static_cast<acc_t>(1.0 / (1.0 - p)),
        out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

PhiloxSeed philox_seed(const at::Tensor& seed) {
  PhiloxSeed out;
  out.tensor = seed;
  return out;
}

void dropout(const at::Tensor& x, double p, const PhiloxSeed& seed, at::Tensor& out) {
  launch_dropout<false>(x, p, seed.tensor, at::PhiloxCudaState(), out);
}

void dropout_input_and_grad(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, const at::Tensor& grad,
                            double p, const PhiloxSeed& seed, at::Tensor& read, at::Tensor& masked) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t blocks = elementwise_blocks((x.numel() + 3) / 4);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "dropout_input_and_grad", [&] {
    using T = scalar_t;
    using acc_t = at::opmath_type<T>;
    const acc_t* scales = scale.defined() ? scale.const_data_ptr<acc_t>() : nullptr;
    const acc_t* shifts = shift.defined() ? shift.const_data_ptr<acc_t>() : nullptr;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dropout_input_and_grad", [&] {
      dropout_pair_kernel<scalar_t, T><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(), scales, shifts, x.size(-1), grad.const_data_ptr<T>(), grad.numel(),
          seed.tensor.const_data_ptr<int64_t>(), static_cast<int>(seed.tensor.numel()), dropout_threshold(p),
          static_cast<acc_t>(1.0 / (1.0 - p)), read.mutable_data_ptr<T>(), masked.mutable_data_ptr<T>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void affine_weight_grad(const at::Tensor& product, const at::Tensor& total, const at::Tensor& scale,
                        const at::Tensor& shift, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(product.device());
  const int64_t blocks = elementwise_blocks(product.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "affine_weight_grad", [&] {
    using O = scalar_t;
    using acc_t = at::opmath_type<O>;
    const acc_t* scales = scale.defined() ? scale.const_data_ptr<acc_t>() : nullptr;
    const acc_t* shifts = shift.defined() ? shift.const_data_ptr<acc_t>() : nullptr;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, product.scalar_type(), "affine_weight_grad", [&] {
      affine_weight_grad_kernel<scalar_t, O><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          product.const_data_ptr<scalar_t>(), total.defined() ? total.const_data_ptr<scalar_t>() : nullptr, scales,
          shifts, product.numel(), product.size(1), out.mutable_data_ptr<O>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

PhiloxSeed dropout_draw(const at::Tensor& x, double p, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());  // before the state: a graph capture is read off x's device's stream
  auto* generator = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(x.device().index()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    // The values the kernel takes of subsequence 0: four per counter (ATen's own kernels reserve per thread).
    state = generator->philox_cuda_state(static_cast<uint64_t>(4 * ((x.numel() + 3) / 4)));
  }
  PhiloxSeed seed;
  seed.tensor = at::empty({2}, x.options().dtype(at::kLong));
  launch_dropout<true>(x, p, seed.tensor, state, out);
  return seed;
}


}  // namespace lowmem
