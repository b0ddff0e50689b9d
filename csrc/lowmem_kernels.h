// Device-specific launchers behind the contract in lowmem_bind.cpp. lowmem_cpu.cpp and
// lowmem_cuda.cu each implement all of them; an extension links exactly one.
// Callers pass contiguous tensors of checked dtypes and preallocated outputs.
#pragma once

#include <ATen/core/Tensor.h>

namespace lowmem {

// The device type the linked kernels run on.
extern const c10::DeviceType kKernelDevice;

// packed[i/4] |= code(x[i]) << 2*(i%4), thresholds in x's accumulate type.
void step_codes(const at::Tensor& x, const double* thresholds, at::Tensor& packed);

// out[i] = grad[i] * levels[code(i)], computed in grad's accumulate type.
void step_scale(const at::Tensor& grad, const at::Tensor& packed, const double* levels, at::Tensor& out);

// Row-wise affine-free norm over the trailing `dim` elements; rstd holds one value per row.
void norm_forward(const at::Tensor& x, int64_t dim, double eps, bool center, at::Tensor& z, at::Tensor& rstd);

// Input gradient from the saved output z and rstd only.
void norm_backward(const at::Tensor& grad, const at::Tensor& z, const at::Tensor& rstd, int64_t dim, bool center,
                   at::Tensor& grad_input);

}  // namespace lowmem
