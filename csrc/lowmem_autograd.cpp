// Autograd in C++ for the eager calls of the compiled backends: `lowmem::ms_norm`, `lowmem::affine_linear`
// and `lowmem::step_activation` (schemas in lightning_lowmem/kernels/library.py) compute what the autograd
// functions of lightning_lowmem/ops compute, and save the same tensors, with no Python in forward or
// backward: at the sizes of a small model the Python of a custom autograd function costs more than its
// kernels. The Python functions stay the reference (tests compare the two) and the path of torch.compile,
// the Triton and the pure-PyTorch backends. Registered for the extension's Autograd key; the kernels are
// reached through the dispatcher (lowmem_bind.cpp), so the profiler shows them as for the Python path.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace lowmem {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

// The Python functions' message (lightning_lowmem/ops/_checks.py: refuse_double_backward).
void refuse_double_backward(const std::string& op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), op,
              " does not support double backward (create_graph=True / higher-order gradients): its backward uses "
              "only the compact tensors saved in forward. Use the stock module for higher-order gradients.");
}

bool requires_grad(const OptionalTensor& t) { return t.has_value() && t->defined() && t->requires_grad(); }

at::Tensor value_or_undefined(const OptionalTensor& t) { return t.has_value() ? *t : at::Tensor(); }

// `gamma + offset`, the norm's scale (Gemma's RMSNorm: 1 + weight); gamma itself without an offset.
at::Tensor affine_scale(const at::Tensor& gamma, double offset) { return offset != 0.0 ? gamma + offset : gamma; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_affine_forward(const at::Tensor& x, int64_t dim, double eps,
                                                                   bool center, at::ScalarType out_dtype,
                                                                   const OptionalTensor& scale,
                                                                   const OptionalTensor& shift) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::norm_affine_forward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, int64_t, double, bool, at::ScalarType, const OptionalTensor&,
                           const OptionalTensor&)>();
  return op.call(x, dim, eps, center, out_dtype, scale, shift);
}

std::tuple<at::Tensor, at::Tensor> norm_backward(const at::Tensor& grad, const at::Tensor& z, const at::Tensor& rstd,
                                                 const OptionalTensor& scale, int64_t dim, bool center,
                                                 at::ScalarType dtype, bool column_sums) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::norm_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const OptionalTensor&, int64_t,
                                                                  bool, at::ScalarType, bool)>();
  return op.call(grad, z, rstd, scale, dim, center, dtype, column_sums);
}

at::Tensor norm_exact_columns(const OptionalTensor& scale, const OptionalTensor& shift) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::norm_exact_columns", "")
                       .typed<at::Tensor(const OptionalTensor&, const OptionalTensor&)>();
  return op.call(scale, shift);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_output_forward(const at::Tensor& x, int64_t dim, double eps,
                                                                   bool center, at::ScalarType out_dtype,
                                                                   const OptionalTensor& scale,
                                                                   const OptionalTensor& shift,
                                                                   const at::Tensor& columns) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::norm_output_forward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, int64_t, double, bool, at::ScalarType, const OptionalTensor&,
                           const OptionalTensor&, const at::Tensor&)>();
  return op.call(x, dim, eps, center, out_dtype, scale, shift, columns);
}

at::Tensor norm_output_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd,
                                const OptionalTensor& scale, const OptionalTensor& shift, const at::Tensor& columns,
                                const at::Tensor& exact, int64_t dim, bool center, at::ScalarType dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::norm_output_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                         const OptionalTensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
                                         at::ScalarType)>();
  return op.call(grad, y, rstd, scale, shift, columns, exact, dim, center, dtype);
}

// `t` in dtype `acc`, contiguous: `t` itself where it is (no operator called: this runs on every call).
at::Tensor contiguous_in(const at::Tensor& t, at::ScalarType acc) {
  return t.scalar_type() == acc && t.is_contiguous() ? t : t.to(acc).contiguous();
}

// ops.norm.affine_values: gamma + offset and beta in the input's accumulate type.
std::tuple<OptionalTensor, OptionalTensor> affine_values(at::ScalarType in_dtype, const at::Tensor& gamma,
                                                         const at::Tensor& beta, double offset) {
  const at::ScalarType acc = at::toOpMathType(in_dtype);
  OptionalTensor scale, shift;
  if (gamma.defined()) scale = contiguous_in(affine_scale(gamma, offset), acc);
  if (beta.defined()) shift = contiguous_in(beta, acc);
  return {scale, shift};
}

std::tuple<at::Tensor, at::Tensor> act_forward(const at::Tensor& x, c10::string_view kind,
                                               at::ArrayRef<double> thresholds) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::act_forward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, c10::string_view,
                                                                  at::ArrayRef<double>)>();
  return op.call(x, kind, thresholds);
}

at::Tensor act_backward(const at::Tensor& grad, const at::Tensor& packed, at::ArrayRef<double> levels) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::act_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ArrayRef<double>)>();
  return op.call(grad, packed, levels);
}

// lightning_lowmem.ops.norm.MemorySharingNormFunction with an affine: returns (y, z), z without a gradient, or
// (y) where it saves y, and z at its exact columns (at most max_exact_columns of them), instead.
struct MemorySharingNormFunction : public torch::autograd::Function<MemorySharingNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& gamma,
                               const OptionalTensor& beta, int64_t max_exact_columns, int64_t dim, double eps,
                               bool center, at::ScalarType out_dtype, double offset, c10::string_view name) {
    auto [scale, shift] = affine_values(x.scalar_type(), value_or_undefined(gamma), value_or_undefined(beta), offset);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["center"] = center;
    ctx->saved_data["in_dtype"] = x.scalar_type();
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["name"] = std::string(name);
    const at::Tensor columns = max_exact_columns >= 0 ? norm_exact_columns(scale, shift) : at::Tensor();
    // traced (fake tensors), their number is not known: z, as under torch.compile
    const std::optional<int64_t> n_exact = columns.defined() ? columns.sym_numel().maybe_as_int() : std::nullopt;
    const bool saves_output = n_exact.has_value() && *n_exact <= max_exact_columns;
    ctx->saved_data["saves_output"] = saves_output;
    if (saves_output) {  // only the input needs a gradient
      auto [y, rstd, exact] = norm_output_forward(x, dim, eps, center, out_dtype, scale, shift, columns);
      ctx->save_for_backward({y, rstd, value_or_undefined(gamma), value_or_undefined(beta), columns, exact});
      return {y};
    }
    ctx->saved_data["needs"] = std::vector<bool>{x.requires_grad(), requires_grad(gamma), requires_grad(beta)};
    auto [y, z, rstd] = norm_affine_forward(x, dim, eps, center, out_dtype, scale, shift);
    // an input that needs no gradient (the first norm on frozen embeddings) keeps no rstd
    ctx->save_for_backward({z, x.requires_grad() ? rstd : at::Tensor(), value_or_undefined(gamma),
                            value_or_undefined(beta)});
    ctx->mark_non_differentiable({z});
    ctx->set_materialize_grads(false);  // z never gets a gradient: no zeros to make for it
    return {y, z};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(10);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;  // nothing read y
    refuse_double_backward(ctx->saved_data["name"].toStringRef());
    const variable_list saved = ctx->get_saved_variables();
    if (ctx->saved_data["saves_output"].toBool()) {
      const at::Tensor &y = saved[0], &rstd = saved[1], &columns = saved[4], &exact = saved[5];
      const at::ScalarType in_dtype = ctx->saved_data["in_dtype"].toScalarType();
      auto [scale, shift] = affine_values(in_dtype, saved[2], saved[3], ctx->saved_data["offset"].toDouble());
      out[0] = norm_output_backward(grad, y, rstd, scale, shift, columns, exact, ctx->saved_data["dim"].toInt(),
                                    ctx->saved_data["center"].toBool(), in_dtype);
      return out;
    }
    const at::Tensor &z = saved[0], &rstd = saved[1], &gamma = saved[2], &beta = saved[3];
    const auto needs = ctx->saved_data["needs"].toBoolList();
    const bool needs_input = needs.get(0), needs_gamma = needs.get(1), needs_beta = needs.get(2);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const at::ScalarType acc = at::toOpMathType(z.scalar_type());
    at::Tensor sums;
    if (needs_input) {
      OptionalTensor scale;
      if (gamma.defined()) scale = affine_scale(gamma, ctx->saved_data["offset"].toDouble()).to(acc);
      std::tie(out[0], sums) =
          norm_backward(grad, z, rstd, scale, dim, ctx->saved_data["center"].toBool(),
                        ctx->saved_data["in_dtype"].toScalarType(), needs_gamma || needs_beta);
    } else {  // torch_ops.affine_grad_sums
      at::Tensor g = grad.to(acc).reshape({-1, dim});
      sums = at::stack({(g * z.to(acc).reshape({-1, dim})).sum(0), g.sum(0)});
    }
    if (needs_gamma) out[1] = sums[0].to(gamma.scalar_type()).view(gamma.sizes());
    if (needs_beta) out[2] = sums[1].to(beta.scalar_type()).view(beta.sizes());
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> ms_norm(const at::Tensor& x, const OptionalTensor& gamma,
                                           const OptionalTensor& beta, int64_t max_exact_columns, int64_t dim,
                                           double eps, bool center, at::ScalarType out_dtype, double offset,
                                           c10::string_view name) {
  TORCH_CHECK_VALUE(gamma.has_value() || beta.has_value(), name, ": lowmem::ms_norm needs a weight or a bias");
  variable_list out =
      MemorySharingNormFunction::apply(x, gamma, beta, max_exact_columns, dim, eps, center, out_dtype, offset, name);
  return {out[0], out.size() > 1 ? out[1] : at::Tensor()};  // no z (None) where the norm saved y
}

// lightning_lowmem.ops.affine.AffineLinearFunction.
struct AffineLinearFunction : public torch::autograd::Function<AffineLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& z,
                            const at::Tensor& weight, const OptionalTensor& bias, const OptionalTensor& gamma,
                            const OptionalTensor& beta, at::ScalarType dtype, double offset) {
    at::Tensor x_in = x.to(dtype);  // under autocast `dtype` is its dtype: autocast has nothing left to cast
    OptionalTensor bias_in;
    if (bias.has_value()) bias_in = bias->to(dtype);
    at::Tensor out = at::linear(x_in, weight.to(dtype), bias_in);
    // only the weight gradient reads the input: a frozen linear saves none, as stock; a narrower input
    // (bf16 into fp32 adapters) is saved as it is, and widened again in backward
    const bool narrower = at::promote_types(x.scalar_type(), dtype) == dtype;
    at::Tensor saved;
    if (weight.requires_grad()) saved = z.has_value() ? *z : narrower ? x : x_in;
    ctx->save_for_backward({saved, weight, value_or_undefined(gamma), value_or_undefined(beta)});
    ctx->saved_data["dtype"] = dtype;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["shared"] = z.has_value();
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["needs"] = std::vector<bool>{x.requires_grad(), weight.requires_grad(), requires_grad(bias)};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &inputs_saved = saved[0], &weight = saved[1], &gamma = saved[2], &beta = saved[3];
    const auto needs = ctx->saved_data["needs"].toBoolList();
    const bool needs_x = needs.get(0), needs_w = needs.get(1), needs_b = needs.get(2);
    const at::ScalarType dtype = ctx->saved_data["dtype"].toScalarType();
    const at::Tensor grad = grads[0].to(dtype);
    const at::Tensor grad_2d = grad.reshape({-1, grad.size(-1)});
    variable_list out(8);
    at::Tensor grad_sum;
    if (needs_b) grad_sum = grad_2d.sum(0);  // one pass over grad, for the bias and the beta term
    if (needs_w) {
      // ops.affine._weight_grad: (grad^T z) * (gamma + offset) + outer(sum(grad), beta) from a shared z
      at::Tensor grad_w = grad_2d.t().mm(inputs_saved.reshape({-1, inputs_saved.size(-1)}).to(dtype));
      if (ctx->saved_data["shared"].toBool() && (gamma.defined() || beta.defined())) {
        const at::Tensor& param = gamma.defined() ? gamma : beta;
        grad_w = grad_w.to(at::promote_types(dtype, param.scalar_type()));
        if (gamma.defined()) grad_w.mul_(affine_scale(gamma, ctx->saved_data["offset"].toDouble()));
        if (beta.defined()) {
          at::Tensor sum = grad_sum.defined() ? grad_sum : grad_2d.sum(0);
          grad_w.addr_(sum.to(grad_w.scalar_type()), beta.to(grad_w.scalar_type()));
        }
      }
      out[2] = grad_w.to(weight.scalar_type());
    }
    if (needs_b) out[3] = grad_sum.to(weight.scalar_type());
    if (needs_x) out[0] = grad.matmul(weight.to(dtype)).to(ctx->saved_data["x_dtype"].toScalarType());
    return out;
  }
};

at::Tensor affine_linear(const at::Tensor& x, const OptionalTensor& z, const at::Tensor& weight,
                         const OptionalTensor& bias, const OptionalTensor& gamma, const OptionalTensor& beta,
                         at::ScalarType dtype, double offset) {
  return AffineLinearFunction::apply(x, z, weight, bias, gamma, beta, dtype, offset);
}

// lightning_lowmem.ops.activation.StepActivationFunction for a contiguous input of a fused kind.
struct StepActivationFunction : public torch::autograd::Function<StepActivationFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::string_view kind,
                            at::ArrayRef<double> thresholds, at::ArrayRef<double> levels, c10::string_view name) {
    auto [y, packed] = act_forward(x, kind, thresholds);
    ctx->save_for_backward({packed});
    ctx->saved_data["levels"] = levels.vec();
    ctx->saved_data["name"] = std::string(name);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward(ctx->saved_data["name"].toStringRef());
    const at::Tensor packed = ctx->get_saved_variables()[0];
    const auto levels = ctx->saved_data["levels"].toDoubleVector();
    return {act_backward(grads[0], packed, levels), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor step_activation(const at::Tensor& x, c10::string_view kind, at::ArrayRef<double> thresholds,
                           at::ArrayRef<double> levels, c10::string_view name) {
  return StepActivationFunction::apply(x, kind, thresholds, levels, name);
}

}  // namespace
}  // namespace lowmem

#if defined(LOWMEM_CUDA)
#define LOWMEM_AUTOGRAD_KEY AutogradCUDA
#else
#define LOWMEM_AUTOGRAD_KEY AutogradCPU
#endif

TORCH_LIBRARY_IMPL(lowmem, LOWMEM_AUTOGRAD_KEY, m) {
  m.impl("ms_norm", &lowmem::ms_norm);
  m.impl("affine_linear", &lowmem::affine_linear);
  m.impl("step_activation", &lowmem::step_activation);
}
