// The ops declared in lightning_lowmem/kernels/torch_ops.py, for one device: argument checks,
// output allocation, and the registration of the kernels of the `lowmem` operators (their schemas
// inferred from those declarations) for the extension's dispatch key. Shared by the CPU and
// CUDA extensions; the CUDA build defines LOWMEM_CUDA.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "lowmem_kernels.h"
#include "lowmem_math.h"

namespace lowmem {
namespace {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

at::ScalarType accumulate_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// `t` on this extension's device type and, as every tensor of one call, on `device` (the first input's): a kernel
// reads them all as one GPU's memory, so an index that differs is refused here, not an illegal address there.
void check_tensor(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.device().type() == kKernelDevice, op, ": ", name, " must be on ", c10::DeviceTypeName(kKernelDevice, /*lower_case=*/true),
              " for this extension, got ", t.device());
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, " with the other tensors, got ", t.device());
}

void check_float(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  check_tensor(op, name, t, device);
  TORCH_CHECK_TYPE(is_float_type(t.scalar_type()), op, ": unsupported dtype ", t.scalar_type(), " for ", name,
                   "; supported: float16, bfloat16, float32, float64");
}

// Bytes holding numel codes of `bits` bits each.
int64_t packed_size(int64_t numel, int bits) { return (numel * bits + 7) / 8; }

void check_thresholds(const char* op, at::ArrayRef<double> thresholds) {
  TORCH_CHECK_VALUE(storage_bits(static_cast<int64_t>(thresholds.size())) > 0, op,
                    ": expected 1 to 15 thresholds (1-4 bit codes), got ", thresholds.size());
  for (size_t t = 1; t < thresholds.size(); ++t) {
    TORCH_CHECK_VALUE(thresholds[t - 1] <= thresholds[t], op, ": thresholds must be ascending");
  }
}

at::Tensor packed_for(const at::Tensor& x, at::ArrayRef<double> thresholds) {
  const int bits = storage_bits(static_cast<int64_t>(thresholds.size()));
  return at::empty({packed_size(x.numel(), bits)}, x.options().dtype(at::kByte));
}

// Codes only: the activation itself is the caller's (the stock op, bit-exact by construction).
at::Tensor act_codes_op(const at::Tensor& x, at::ArrayRef<double> thresholds) {
  check_float("act_codes", "x", x, x.device());
  check_thresholds("act_codes", thresholds);
  at::Tensor packed = packed_for(x, thresholds);
  if (x.numel() > 0) act_codes(x.contiguous(), thresholds.data(), thresholds.size(), packed);
  return packed;
}

// The stock activation's output and the codes of x, in one pass where the device has one.
std::tuple<at::Tensor, at::Tensor> act_forward_op(const at::Tensor& x, c10::string_view kind,
                                                  at::ArrayRef<double> thresholds) {
  check_float("act_forward", "x", x, x.device());
  const Activation activation = activation_of("act_forward", kind);
  check_thresholds("act_forward", thresholds);
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc, at::MemoryFormat::Contiguous);
  at::Tensor packed = packed_for(x, thresholds);
  if (x.numel() > 0) act_forward(xc, activation, thresholds.data(), thresholds.size(), y, packed);
  return {y, packed};
}

at::Tensor act_backward_op(const at::Tensor& grad, const at::Tensor& packed, at::ArrayRef<double> levels) {
  check_float("act_backward", "grad", grad, grad.device());
  check_tensor("act_backward", "packed", packed, grad.device());
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, "act_backward: packed codes must be uint8, got ",
                   packed.scalar_type());
  const int bits = levels.size() >= 2 ? storage_bits(static_cast<int64_t>(levels.size()) - 1) : 0;
  TORCH_CHECK_VALUE(bits > 0, "act_backward: expected 2 to 16 levels (1-4 bit codes), got ", levels.size());
  TORCH_CHECK_VALUE(packed.numel() == packed_size(grad.numel(), bits), "act_backward: ", packed.numel(),
                    " packed bytes do not hold ", grad.numel(), " codes of ", bits, " bits");
  at::Tensor g = grad.contiguous();
  at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (g.numel() > 0) step_scale(g, packed.contiguous(), levels.data(), levels.size(), out);
  return out;
}

int64_t rows_of(const char* op, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(dim > 0 && t.numel() % dim == 0, op, ": cannot normalize ", t.numel(),
                    " elements over trailing size ", dim);
  return t.numel() / dim;
}

// What both norm forward operators check.
void check_norm_forward(const char* op, const at::Tensor& x, double eps, at::ScalarType out_dtype) {
  check_float(op, "x", x, x.device());
  TORCH_CHECK_TYPE(is_float_type(out_dtype), op, ": unsupported output dtype ", out_dtype);
  TORCH_CHECK_VALUE(eps > 0, op, ": eps must be positive, got ", eps);
}

std::tuple<at::Tensor, at::Tensor> norm_forward_op(const at::Tensor& x, int64_t dim, double eps, bool center,
                                                   at::ScalarType out_dtype) {
  check_norm_forward("norm_forward", x, eps, out_dtype);
  const int64_t rows = rows_of("norm_forward", x, dim);
  at::Tensor z = at::empty(x.sizes(), x.options().dtype(out_dtype));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(accumulate_type(x.scalar_type())));
  at::Tensor none;
  if (rows > 0) norm_forward(x.contiguous(), dim, eps, center, z, rstd, none, none, none);
  return {z, rstd};
}

// `dim` values of the accumulate type (or of `also`: the input's own, which the output ops widen), contiguous;
// undefined when not given.
at::Tensor affine_values(const char* op, const char* name, const std::optional<at::Tensor>& t, int64_t dim,
                         at::ScalarType acc, const at::Device& device, at::ScalarType also = at::ScalarType::Undefined) {
  if (!t.has_value()) return at::Tensor();
  check_tensor(op, name, *t, device);
  if (t->numel() != dim || (t->scalar_type() != acc && t->scalar_type() != also)) {
    std::string dtypes = c10::toString(acc);
    if (also != at::ScalarType::Undefined && also != acc) dtypes += std::string(" or ") + c10::toString(also);
    TORCH_CHECK_VALUE(false, op, ": expected ", dim, " ", name, " values of dtype ", dtypes, ", got ", t->numel(),
                      " of ", t->scalar_type());
  }
  return t->contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_affine_forward_op(const at::Tensor& x, int64_t dim, double eps,
                                                                      bool center, at::ScalarType out_dtype,
                                                                      const std::optional<at::Tensor>& scale,
                                                                      const std::optional<at::Tensor>& shift) {
  check_norm_forward("norm_affine_forward", x, eps, out_dtype);
  TORCH_CHECK_VALUE(scale.has_value() || shift.has_value(), "norm_affine_forward: needs a scale or a shift");
  const int64_t rows = rows_of("norm_affine_forward", x, dim);
  const at::ScalarType acc = accumulate_type(x.scalar_type());
  const at::Tensor scale_values = affine_values("norm_affine_forward", "scale", scale, dim, acc, x.device());
  const at::Tensor shift_values = affine_values("norm_affine_forward", "shift", shift, dim, acc, x.device());
  at::Tensor z = at::empty(x.sizes(), x.options().dtype(out_dtype));
  at::Tensor y = at::empty_like(z);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(acc));
  if (rows > 0) norm_forward(x.contiguous(), dim, eps, center, z, rstd, scale_values, shift_values, y);
  return {y, z, rstd};
}

std::tuple<at::Tensor, at::Tensor> norm_backward_op(const at::Tensor& grad, const at::Tensor& z, const at::Tensor& rstd,
                                                    const std::optional<at::Tensor>& scale, int64_t dim, bool center,
                                                    at::ScalarType dtype, bool column_sums) {
  check_float("norm_backward", "grad", grad, grad.device());
  check_float("norm_backward", "z", z, grad.device());
  check_tensor("norm_backward", "rstd", rstd, grad.device());
  TORCH_CHECK_TYPE(is_float_type(dtype), "norm_backward: unsupported output dtype ", dtype);
  TORCH_CHECK_VALUE(grad.sizes() == z.sizes(), "norm_backward: grad shape ", grad.sizes(), " differs from output shape ",
                    z.sizes());
  const int64_t rows = rows_of("norm_backward", z, dim);
  const at::ScalarType acc = accumulate_type(z.scalar_type());
  TORCH_CHECK_VALUE(rstd.numel() == rows && rstd.scalar_type() == acc, "norm_backward: expected ", rows,
                    " rstd values of dtype ", acc, ", got ", rstd.numel(), " of ", rstd.scalar_type());
  at::Tensor scale_values;
  if (scale.has_value()) {
    check_tensor("norm_backward", "scale", *scale, grad.device());
    TORCH_CHECK_VALUE(scale->numel() == dim && scale->scalar_type() == acc, "norm_backward: expected ", dim,
                      " scale values of dtype ", acc, ", got ", scale->numel(), " of ", scale->scalar_type());
    scale_values = scale->contiguous();
  }
  at::Tensor g = grad.to(z.scalar_type()).contiguous();
  at::Tensor grad_input = at::empty(z.sizes(), z.options().dtype(dtype));
  // the kernels write the sums whole where there are rows
  at::Tensor sums = column_sums ? (rows > 0 ? at::empty({2, dim}, rstd.options()) : at::zeros({2, dim}, rstd.options()))
                                : at::empty({0}, rstd.options());
  at::Tensor sums_out = column_sums ? sums : at::Tensor();
  if (rows > 0) norm_backward(g, z.contiguous(), rstd.contiguous(), scale_values, dim, center, grad_input, sums_out);
  return {grad_input, sums};
}

#if !defined(LOWMEM_CUDA)
// `columns`: ascending int64 indices below dim, each once (a loop: this runs on every call, on CPU).
at::Tensor checked_columns(const char* op, const at::Tensor& columns, int64_t dim, const at::Device& device) {
  check_tensor(op, "columns", columns, device);
  TORCH_CHECK_TYPE(columns.scalar_type() == at::kLong && columns.dim() == 1, op,
                   ": columns must be a 1-d int64 tensor, got ", columns.dim(), "-d ", columns.scalar_type());
  at::Tensor c = columns.contiguous();
  const int64_t* index = c.const_data_ptr<int64_t>();
  for (int64_t k = 0; k < c.numel(); ++k) {
    TORCH_CHECK_VALUE(index[k] >= (k > 0 ? index[k - 1] + 1 : 0) && index[k] < dim, op,
                      ": columns must be ascending indices in [0, ", dim, "), each once, got ", c);
  }
  return c;
}

// torch_ops.norm_exact_columns, as a loop over the values: scale 0 or |shift| > |scale|.
template <typename value_t>
at::Tensor exact_columns(const at::Tensor& scale, const at::Tensor& shift, int64_t dim) {
  using acc_t = at::opmath_type<value_t>;  // exact: half / bfloat16 widened
  const value_t* s = scale.defined() ? scale.const_data_ptr<value_t>() : nullptr;
  const value_t* b = shift.defined() ? shift.const_data_ptr<value_t>() : nullptr;
  std::vector<int64_t> columns;
  for (int64_t k = 0; k < dim; ++k) {
    const acc_t size = s != nullptr ? std::abs(static_cast<acc_t>(s[k])) : acc_t(1);
    if (size == acc_t(0) || (b != nullptr && std::abs(static_cast<acc_t>(b[k])) > size)) columns.push_back(k);
  }
  // one allocation, no operator (at::tensor calls several): this runs on every forward of a frozen norm
  at::Tensor out = at::empty({static_cast<int64_t>(columns.size())}, at::kLong);
  std::copy(columns.begin(), columns.end(), out.mutable_data_ptr<int64_t>());
  return out;
}

at::Tensor norm_exact_columns_op(const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift) {
  const char* op = "norm_exact_columns";
  TORCH_CHECK_VALUE(scale.has_value() || shift.has_value(), op, ": needs a scale or a shift");
  const at::Tensor& any = scale.has_value() ? *scale : *shift;
  check_float(op, scale.has_value() ? "scale" : "shift", any, any.device());
  const at::Tensor scale_values = affine_values(op, "scale", scale, any.numel(), any.scalar_type(), any.device());
  const at::Tensor shift_values = affine_values(op, "shift", shift, any.numel(), any.scalar_type(), any.device());
  at::Tensor columns;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, any.scalar_type(), "norm_exact_columns",
                                  [&] { columns = exact_columns<scalar_t>(scale_values, shift_values, any.numel()); });
  return columns;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_output_forward_op(const at::Tensor& x, int64_t dim, double eps,
                                                                      bool center, at::ScalarType out_dtype,
                                                                      const std::optional<at::Tensor>& scale,
                                                                      const std::optional<at::Tensor>& shift,
                                                                      const at::Tensor& columns) {
  const char* op = "norm_output_forward";
  check_norm_forward(op, x, eps, out_dtype);
  TORCH_CHECK_VALUE(scale.has_value() || shift.has_value(), op, ": needs a scale or a shift");
  const int64_t rows = rows_of(op, x, dim);
  const at::ScalarType acc = accumulate_type(x.scalar_type());
  const at::Tensor scale_values = affine_values(op, "scale", scale, dim, acc, x.device(), x.scalar_type());
  const at::Tensor shift_values = affine_values(op, "shift", shift, dim, acc, x.device(), x.scalar_type());
  const at::Tensor c = checked_columns(op, columns, dim, x.device());
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(acc));
  at::Tensor exact = at::empty({rows, c.numel()}, y.options());
  if (rows > 0) norm_output_forward(x.contiguous(), dim, eps, center, rstd, scale_values, shift_values, y, c, exact);
  return {y, rstd, exact};
}

at::Tensor norm_output_backward_op(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd,
                                   const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift,
                                   const at::Tensor& columns, const at::Tensor& exact, int64_t dim, bool center,
                                   at::ScalarType dtype) {
  const char* op = "norm_output_backward";
  check_float(op, "grad", grad, grad.device());
  check_float(op, "y", y, grad.device());
  check_tensor(op, "rstd", rstd, grad.device());
  TORCH_CHECK_TYPE(is_float_type(dtype), op, ": unsupported output dtype ", dtype);
  TORCH_CHECK_VALUE(grad.sizes() == y.sizes(), op, ": grad shape ", grad.sizes(), " differs from output shape ",
                    y.sizes());
  const int64_t rows = rows_of(op, y, dim);
  const at::ScalarType acc = accumulate_type(y.scalar_type());
  TORCH_CHECK_VALUE(rstd.numel() == rows && rstd.scalar_type() == acc, op, ": expected ", rows,
                    " rstd values of dtype ", acc, ", got ", rstd.numel(), " of ", rstd.scalar_type());
  const at::Tensor c = checked_columns(op, columns, dim, grad.device());
  check_tensor(op, "exact", exact, grad.device());
  TORCH_CHECK_VALUE(exact.dim() == 2 && exact.size(0) == rows && exact.size(1) == c.numel() &&
                        exact.scalar_type() == y.scalar_type(),
                    op, ": expected exact of shape [", rows, ", ", c.numel(), "] and dtype ", y.scalar_type(),
                    ", got ", exact.sizes(), " ", exact.scalar_type());
  const at::Tensor scale_values = affine_values(op, "scale", scale, dim, acc, grad.device(), y.scalar_type());
  const at::Tensor shift_values = affine_values(op, "shift", shift, dim, acc, grad.device(), y.scalar_type());
  at::Tensor grad_input = at::empty(y.sizes(), y.options().dtype(dtype));
  if (rows > 0) {
    norm_output_backward(grad.to(y.scalar_type()).contiguous(), y.contiguous(), rstd.contiguous(), scale_values,
                         shift_values, c, exact.contiguous(), dim, center, grad_input);
  }
  return grad_input;
}
#endif

void check_like(const char* name, const at::Tensor& t, const at::Tensor& grad) {
  check_float("gated_backward", name, t, grad.device());
  TORCH_CHECK_VALUE(t.sizes() == grad.sizes(), "gated_backward: shapes differ: grad ", grad.sizes(), ", ", name, " ",
                    t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == grad.scalar_type(), "gated_backward: dtypes differ: grad ", grad.scalar_type(),
                   ", ", name, " ", t.scalar_type());
}

// A tensor as rows of its last dimension (a scalar: one row of one).
std::pair<int64_t, int64_t> rows_and_columns(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return {rows, t.dim() ? t.size(-1) : 1};
}

std::tuple<at::Tensor, at::Tensor> gated_exceptions_op(const at::Tensor& act, const at::Tensor& up, int64_t slots) {
  const char* op = "gated_exceptions";
  check_float(op, "act", act, act.device());
  check_tensor(op, "up", up, act.device());
  TORCH_CHECK_VALUE(up.sizes() == act.sizes() && up.scalar_type() == act.scalar_type(), op,
                    ": act and up must be floating tensors of one shape and dtype, got ", act.sizes(), " ",
                    act.scalar_type(), " and ", up.sizes(), " ", up.scalar_type());
  TORCH_CHECK_VALUE(slots >= 0, op, ": slots must be >= 0, got ", slots);
  const auto [rows, cols] = rows_and_columns(act);
  TORCH_CHECK_VALUE(cols <= std::numeric_limits<int32_t>::max(), op, ": rows of ", cols, " columns do not fit int32");
  at::Tensor columns = at::empty({rows, slots}, act.options().dtype(at::kInt));
  at::Tensor up_at = at::empty({rows, slots}, up.options());
  if (rows > 0 && slots > 0) {
    at::Tensor rows_of_up = up.reshape({rows, cols});  // a view where it can be (a packed half: row stride 2 x cols)
    if (rows_of_up.stride(1) != 1) rows_of_up = rows_of_up.contiguous();
    if (cols > 0) {
      gated_exceptions(act.contiguous(), rows_of_up, columns, up_at);
    } else {
      columns.fill_(-1);
      up_at.zero_();
    }
  }
  return {columns, up_at};
}

std::tuple<at::Tensor, at::Tensor> gated_backward_op(const at::Tensor& grad, const at::Tensor& gate,
                                                     const at::Tensor& second, c10::string_view kind,
                                                     const std::optional<at::Tensor>& act,
                                                     const std::optional<at::Tensor>& columns,
                                                     const std::optional<at::Tensor>& up_at) {
  check_float("gated_backward", "grad", grad, grad.device());
  const Activation activation = activation_of("gated_backward", kind);
  check_like("gate", gate, grad);
  check_like("second", second, grad);
  at::Tensor forward_act, found, kept;
  if (act.has_value()) {
    check_like("act", *act, grad);
    forward_act = act->contiguous();
  }
  TORCH_CHECK_VALUE(columns.has_value() == up_at.has_value() && (!columns.has_value() || act.has_value()),
                    "gated_backward: columns and up_at come together, and with act (gated_exceptions' output)");
  if (columns.has_value()) {
    check_tensor("gated_backward", "columns", *columns, grad.device());
    check_tensor("gated_backward", "up_at", *up_at, grad.device());
    const int64_t rows = rows_and_columns(grad).first;
    TORCH_CHECK_VALUE(columns->scalar_type() == at::kInt && columns->dim() == 2 && columns->size(0) == rows &&
                          up_at->sizes() == columns->sizes(),
                      "gated_backward: expected int32 columns and up_at of one shape (", rows, ", slots), got ",
                      columns->sizes(), " ", columns->scalar_type(), " and ", up_at->sizes(), " ",
                      up_at->scalar_type());
    TORCH_CHECK_VALUE(up_at->scalar_type() == grad.scalar_type(), "gated_backward: up_at must be ",
                      grad.scalar_type(), ", got ", up_at->scalar_type());
    found = columns->contiguous();
    kept = up_at->contiguous();
  }
  at::Tensor g = grad.contiguous();
  at::Tensor grad_gate = at::empty_like(g, at::MemoryFormat::Contiguous);
  at::Tensor grad_up = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (g.numel() > 0) {
    gated_backward(g, gate.contiguous(), second.contiguous(), forward_act, found, kept, activation, grad_gate, grad_up);
  }
  return {grad_gate, grad_up};
}

// x * keep / (1 - p), the mask drawn from `seed` (see philox4x32 in lowmem_math.h): a forward and its backward
// (on the gradient) with one seed apply one mask.
at::Tensor dropout_op(const at::Tensor& x, double p, const at::Tensor& seed) {
  check_float("dropout", "x", x, x.device());
  check_tensor("dropout", "seed", seed, x.device());
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got ", p);
  TORCH_CHECK_VALUE(seed.scalar_type() == at::kLong && (seed.numel() == 1 || seed.numel() == 2) &&
                        seed.is_contiguous(),
                    "dropout: seed must be one or two int64 values (a key, and a first counter), got ", seed.numel(),
                    " of ", seed.scalar_type());
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  if (x.numel() > 0) dropout(xc, p, philox_seed(seed), out);
  return out;
}

// A folded dropout's backward in one pass (see dropout_input_and_grad in lowmem_kernels.h).
std::tuple<at::Tensor, at::Tensor> dropout_input_and_grad_op(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                                                             const std::optional<at::Tensor>& shift,
                                                             at::ScalarType dtype, const at::Tensor& grad, double p,
                                                             const at::Tensor& seed) {
  const char* op = "dropout_input_and_grad";
  check_float(op, "x", x, x.device());
  check_float(op, "grad", grad, x.device());
  check_tensor(op, "seed", seed, x.device());
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, op, ": p must be in [0, 1), got ", p);
  TORCH_CHECK_VALUE(seed.scalar_type() == at::kLong && (seed.numel() == 1 || seed.numel() == 2) && seed.is_contiguous(),
                    op, ": seed must be one or two int64 values (a key, and a first counter), got ", seed.numel(), " of ",
                    seed.scalar_type());
  TORCH_CHECK_VALUE(x.dim() > 0 && grad.sizes() == x.sizes() && grad.scalar_type() == dtype, op, ": grad must be ",
                    dtype, " of x's shape ", x.sizes(), ", got ", grad.scalar_type(), " ", grad.sizes());
  const at::ScalarType acc = accumulate_type(dtype);
  const at::Tensor scale_values = affine_values(op, "scale", scale, x.size(-1), acc, x.device());
  const at::Tensor shift_values = affine_values(op, "shift", shift, x.size(-1), acc, x.device());
  at::Tensor xc = x.contiguous(), g = grad.contiguous();
  at::Tensor read = at::empty(xc.sizes(), xc.options().dtype(dtype));
  at::Tensor masked = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (x.numel() > 0) dropout_input_and_grad(xc, scale_values, shift_values, g, p, philox_seed(seed), read, masked);
  return {read, masked};
}

// A linear's weight gradient from a norm's shared z (see affine_weight_grad in lowmem_kernels.h).
at::Tensor affine_weight_grad_op(const at::Tensor& product, const std::optional<at::Tensor>& total,
                                 const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift,
                                 at::ScalarType dtype) {
  const char* op = "affine_weight_grad";
  check_float(op, "product", product, product.device());
  TORCH_CHECK_VALUE(product.dim() == 2, op, ": product must be a floating (out, in) matrix, got ", product.sizes());
  TORCH_CHECK_TYPE(is_float_type(dtype), op, ": unsupported dtype ", dtype);
  TORCH_CHECK_VALUE(scale.has_value() || shift.has_value(), op, ": needs a scale or a shift");
  const at::ScalarType acc = accumulate_type(dtype);
  const at::Tensor scale_values = affine_values(op, "scale", scale, product.size(1), acc, product.device());
  const at::Tensor shift_values = affine_values(op, "shift", shift, product.size(1), acc, product.device());
  TORCH_CHECK_VALUE(shift.has_value() == total.has_value(), op,
                    ": total (the gradient's sum) comes with a shift, and only with one");
  at::Tensor sums;
  if (total.has_value()) {
    check_tensor(op, "total", *total, product.device());
    TORCH_CHECK_VALUE(total->dim() == 1 && total->size(0) == product.size(0) &&
                          total->scalar_type() == product.scalar_type(),
                      op, ": expected ", product.size(0), " total values of dtype ", product.scalar_type(), ", got ",
                      total->sizes(), " ", total->scalar_type());
    sums = total->contiguous();
  }
  at::Tensor out = at::empty(product.sizes(), product.options().dtype(dtype));
  if (product.numel() > 0) affine_weight_grad(product.contiguous(), sums, scale_values, shift_values, out);
  return out;
}

#if !defined(LOWMEM_CUDA)
// Rows of logits a head's step takes (contiguous fp32, bf16 or fp16) and an int64 target per row, each a class or
// ignore_index: the targets, contiguous.
at::Tensor checked_targets(const char* op, const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index) {
  check_tensor(op, "logits", logits, logits.device());
  check_tensor(op, "target", target, logits.device());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.is_contiguous() &&
                        (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
                    op, ": logits must be contiguous float32, bfloat16 or float16 rows, got ", logits.sizes(), " ",
                    dtype);
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == logits.size(0), op,
                    ": target must be ", logits.size(0), " int64 values on ", logits.device());
  const at::Tensor targets = target.contiguous();
  if (logits.size(1) > 0) {
    const int64_t* t = targets.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < targets.numel(); ++r) {
      TORCH_CHECK_INDEX(t[r] == ignore_index || (t[r] >= 0 && t[r] < logits.size(1)), op, ": target ", t[r],
                        " is out of bounds for ", logits.size(1), " classes");
    }
  }
  return targets;
}

// One float32 value per row of `logits`, contiguous.
at::Tensor checked_rows(const char* op, const char* name, const at::Tensor& values, const at::Tensor& logits) {
  TORCH_CHECK_VALUE(values.scalar_type() == at::kFloat && values.dim() == 1 && values.size(0) == logits.size(0) &&
                        values.device() == logits.device(),
                    op, ": ", name, " must be ", logits.size(0), " float32 values on ", logits.device());
  return values.contiguous();
}

// The per-row loss of logits, which are overwritten with the loss's gradient (see cross_entropy_grad).
at::Tensor cross_entropy_grad_op(at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                                 double label_smoothing, double softcap, const std::optional<at::Tensor>& row_scale) {
  const at::Tensor targets = checked_targets("cross_entropy_grad_", logits, target, ignore_index);
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0 && softcap >= 0.0,
                    "cross_entropy_grad_: label_smoothing must be in [0, 1] and softcap >= 0, got ", label_smoothing,
                    ", ", softcap);
  const at::Tensor scale =
      row_scale.has_value() ? checked_rows("cross_entropy_grad_", "row_scale", *row_scale, logits) : at::Tensor();
  at::Tensor loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  if (logits.numel() > 0) cross_entropy_grad(logits, targets, ignore_index, label_smoothing, softcap, scale, loss);
  return loss;
}

// Each row's target log-prob, entropy and log-sum-exp of logits / temperature (see token_log_probs).
std::tuple<at::Tensor, at::Tensor, at::Tensor> token_log_probs_op(const at::Tensor& logits, const at::Tensor& target,
                                                                  int64_t ignore_index, double temperature) {
  const at::Tensor targets = checked_targets("token_log_probs", logits, target, ignore_index);
  TORCH_CHECK_VALUE(temperature > 0, "token_log_probs: temperature must be positive, got ", temperature);
  const auto rows = [&] { return at::empty({logits.size(0)}, logits.options().dtype(at::kFloat)); };
  at::Tensor log_prob = rows(), entropy = rows(), lse = rows();
  if (logits.size(1) == 0) return {log_prob.zero_(), entropy.zero_(), lse.fill_(-INFINITY)};
  token_log_probs(logits, targets, ignore_index, temperature, log_prob, entropy, lse);
  return {log_prob, entropy, lse};
}

// Logits overwritten with the gradient of the rows' log-probs and entropies (see token_log_probs_grad).
void token_log_probs_grad_op(at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                             const at::Tensor& entropy, const at::Tensor& grad_log_prob,
                             const std::optional<at::Tensor>& grad_entropy, int64_t ignore_index, double temperature) {
  const char* op = "token_log_probs_grad_";
  const at::Tensor targets = checked_targets(op, logits, target, ignore_index);
  TORCH_CHECK_VALUE(temperature > 0, op, ": temperature must be positive, got ", temperature);
  const at::Tensor entropy_grad = grad_entropy.has_value() ? checked_rows(op, "grad_entropy", *grad_entropy, logits)
                                                           : at::Tensor();
  if (logits.numel() == 0) return;
  token_log_probs_grad(logits, targets, checked_rows(op, "lse", lse, logits), checked_rows(op, "entropy", entropy, logits),
                       checked_rows(op, "grad_log_prob", grad_log_prob, logits), entropy_grad, ignore_index,
                       temperature);
}
#endif

}  // namespace
}  // namespace lowmem

#if defined(LOWMEM_CUDA)
#define LOWMEM_DISPATCH_KEY CUDA
#else
#define LOWMEM_DISPATCH_KEY CPU
#endif

TORCH_LIBRARY_IMPL(lowmem, LOWMEM_DISPATCH_KEY, m) {
  m.impl("act_codes", &lowmem::act_codes_op);
  m.impl("act_forward", &lowmem::act_forward_op);
  m.impl("act_backward", &lowmem::act_backward_op);
  m.impl("norm_forward", &lowmem::norm_forward_op);
  m.impl("norm_affine_forward", &lowmem::norm_affine_forward_op);
  m.impl("norm_backward", &lowmem::norm_backward_op);
  m.impl("gated_exceptions", &lowmem::gated_exceptions_op);
  m.impl("gated_backward", &lowmem::gated_backward_op);
  m.impl("dropout", &lowmem::dropout_op);
  m.impl("dropout_input_and_grad", &lowmem::dropout_input_and_grad_op);
  m.impl("affine_weight_grad", &lowmem::affine_weight_grad_op);
#if !defined(LOWMEM_CUDA)  // GPUs run the reference (the ops layer takes this path on CPU only)
  m.impl("norm_exact_columns", &lowmem::norm_exact_columns_op);
  m.impl("norm_output_forward", &lowmem::norm_output_forward_op);
  m.impl("norm_output_backward", &lowmem::norm_output_backward_op);
  m.impl("cross_entropy_grad_", &lowmem::cross_entropy_grad_op);
  m.impl("token_log_probs", &lowmem::token_log_probs_op);
  m.impl("token_log_probs_grad_", &lowmem::token_log_probs_grad_op);
#endif
}
