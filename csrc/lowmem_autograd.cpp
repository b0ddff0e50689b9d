// Autograd in C++ for the eager calls of the compiled backends: `lowmem::ms_norm`, `lowmem::affine_linear`,
// `lowmem::seeded_dropout`, `lowmem::step_activation` and `lowmem::gated_activation` (schemas in lightning_lowmem/kernels/library.py) compute what the autograd
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

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "lowmem_kernels.h"

namespace lowmem {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

// Every tensor of a call on x's device, type and index: the functions below call kernels directly, which read them
// all as one device's memory (a weight on another GPU would be an illegal address there).
void check_devices(c10::string_view op, const at::Tensor& x,
                   std::initializer_list<std::pair<const char*, const OptionalTensor*>> others) {
  for (const auto& [name, tensor] : others) {
    TORCH_CHECK(!tensor->has_value() || (*tensor)->device() == x.device(), op, ": ", name, " must be on ", x.device(),
                " with the input, got ", (*tensor)->device());
  }
}

// The Python functions' message (lightning_lowmem/ops/_checks.py: refuse_double_backward).
void refuse_double_backward(const std::string& op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), op,
              " does not support double backward (create_graph=True / higher-order gradients): its backward uses "
              "only the compact tensors saved in forward. Use the stock module for higher-order gradients.");
}

bool requires_grad(const OptionalTensor& t) { return t.has_value() && t->defined() && t->requires_grad(); }

at::Tensor value_or_undefined(const OptionalTensor& t) { return t.has_value() ? *t : at::Tensor(); }

// `t` in `dtype`: `t` itself, no operator called, where it already is (this runs on every call).
at::Tensor in_dtype(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

// A column sum as the gradient of `param` (its dtype and shape).
at::Tensor as_parameter(const at::Tensor& sums, const at::Tensor& param) {
  at::Tensor grad = in_dtype(sums, param.scalar_type());
  return grad.sizes() == param.sizes() ? grad : grad.view(param.sizes());
}

// ops.norm.affine_scale: `gamma + offset`, the norm's scale (Gemma's RMSNorm: 1 + weight), added in fp32 at least
// (as Hugging Face's Gemma: 1 + weight.float()); gamma itself without an offset.
at::Tensor affine_scale(const at::Tensor& gamma, double offset) {
  return offset != 0.0 ? gamma.to(c10::promoteTypes(gamma.scalar_type(), at::kFloat)) + offset : gamma;
}

std::tuple<at::Tensor, at::Tensor> norm_forward(const at::Tensor& x, int64_t dim, double eps, bool center,
                                                at::ScalarType out_dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::norm_forward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, double, bool,
                                                                 at::ScalarType)>();
  return op.call(x, dim, eps, center, out_dtype);
}

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

// ops.norm.output_affine: gamma + offset and beta as the output ops take them (which widen them): as they are
// where both are in the input's dtype or both in its accumulate type, else in the latter.
std::tuple<OptionalTensor, OptionalTensor> output_affine(at::ScalarType in_dtype, const at::Tensor& gamma,
                                                         const at::Tensor& beta, double offset) {
  const at::ScalarType acc = at::toOpMathType(in_dtype);
  const at::Tensor scale = gamma.defined() ? affine_scale(gamma, offset) : gamma;
  const at::Tensor& any = scale.defined() ? scale : beta;
  const at::ScalarType dtype = any.scalar_type();
  const bool as_they_are = (dtype == in_dtype || dtype == acc) && (!beta.defined() || beta.scalar_type() == dtype);
  const auto taken = [&](const at::Tensor& t) -> OptionalTensor {
    if (!t.defined()) return std::nullopt;
    return as_they_are ? t : t.to(acc);
  };
  return {taken(scale), taken(beta)};
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

at::Tensor affine_weight_grad(const at::Tensor& product, const OptionalTensor& total, const OptionalTensor& scale,
                              const OptionalTensor& shift, at::ScalarType dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::affine_weight_grad", "")
                       .typed<at::Tensor(const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                                         const OptionalTensor&, at::ScalarType)>();
  return op.call(product, total, scale, shift, dtype);
}

// lightning_lowmem.ops.norm.MemorySharingNormFunction: with an affine returns (y, z), z without a gradient, or
// (y) where it saves y, and z at its exact columns (at most max_exact_columns of them), instead; without one (z),
// its output, saved as it is.
struct MemorySharingNormFunction : public torch::autograd::Function<MemorySharingNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& gamma,
                               const OptionalTensor& beta, int64_t max_exact_columns, int64_t dim, double eps,
                               bool center, at::ScalarType out_dtype, double offset, c10::string_view name) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["center"] = center;
    ctx->saved_data["in_dtype"] = x.scalar_type();
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["name"] = std::string(name);
    ctx->saved_data["saves_output"] = false;
    if (max_exact_columns >= 0) {  // a frozen affine: y saved where few columns need z exactly
      auto [scale, shift] = output_affine(x.scalar_type(), value_or_undefined(gamma), value_or_undefined(beta), offset);
      const at::Tensor columns = norm_exact_columns(scale, shift);
      // traced (fake tensors), their number is not known: z, as under torch.compile
      const std::optional<int64_t> n_exact = columns.sym_numel().maybe_as_int();
      if (n_exact.has_value() && *n_exact <= max_exact_columns) {  // only the input needs a gradient
        ctx->saved_data["saves_output"] = true;
        auto [y, rstd, exact] = norm_output_forward(x, dim, eps, center, out_dtype, scale, shift, columns);
        ctx->save_for_backward({y, rstd, value_or_undefined(gamma), value_or_undefined(beta), columns, exact});
        return {y};
      }
    }
    ctx->saved_data["needs"] = std::vector<bool>{x.requires_grad(), requires_grad(gamma), requires_grad(beta)};
    if (!gamma.has_value() && !beta.has_value()) {
      auto [z, rstd] = norm_forward(x, dim, eps, center, out_dtype);
      ctx->save_for_backward({z, rstd, at::Tensor(), at::Tensor()});
      return {z};
    }
    auto [scale, shift] = affine_values(x.scalar_type(), value_or_undefined(gamma), value_or_undefined(beta), offset);
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
      auto [scale, shift] = output_affine(in_dtype, saved[2], saved[3], ctx->saved_data["offset"].toDouble());
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
      if (gamma.defined()) scale = in_dtype(affine_scale(gamma, ctx->saved_data["offset"].toDouble()), acc);
      std::tie(out[0], sums) =
          norm_backward(grad, z, rstd, scale, dim, ctx->saved_data["center"].toBool(),
                        ctx->saved_data["in_dtype"].toScalarType(), needs_gamma || needs_beta);
    } else {  // torch_ops.affine_grad_sums
      at::Tensor g = in_dtype(grad, acc).reshape({-1, dim});
      sums = at::stack({(g * in_dtype(z, acc).reshape({-1, dim})).sum(0), g.sum(0)});
    }
    if (needs_gamma || needs_beta) {
      const std::vector<at::Tensor> rows = sums.unbind(0);
      if (needs_gamma) out[1] = as_parameter(rows[0], gamma);
      if (needs_beta) out[2] = as_parameter(rows[1], beta);
    }
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> ms_norm(const at::Tensor& x, const OptionalTensor& gamma,
                                           const OptionalTensor& beta, int64_t max_exact_columns, int64_t dim,
                                           double eps, bool center, at::ScalarType out_dtype, double offset,
                                           c10::string_view name) {
  check_devices(name, x, {{"weight", &gamma}, {"bias", &beta}});
  variable_list out =
      MemorySharingNormFunction::apply(x, gamma, beta, max_exact_columns, dim, eps, center, out_dtype, offset, name);
  return {out[0], out.size() > 1 ? out[1] : at::Tensor()};  // no z (None) where the norm saved y
}

// Whether `t` holds data in this process (not a fake or functional tensor of a trace, nor a transform's wrapper):
// the kernels may then run on it directly, with no operator called (this runs on every dropout).
bool holds_data(const at::Tensor& t) {
  static const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                           c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper});
  return !t.key_set().has_any(traced);
}

at::Tensor dropout_operator(const at::Tensor& x, double p, const at::Tensor& seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::dropout", "")
                       .typed<at::Tensor(const at::Tensor&, double, const at::Tensor&)>();
  return op.call(x, p, seed);
}

// The seed as the `seed` argument of lowmem::dropout: its tensor, or [key, first] on the CPU.
at::Tensor seed_tensor(const PhiloxSeed& seed) {
  if (seed.tensor.defined()) return seed.tensor;
  at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  int64_t* values = out.mutable_data_ptr<int64_t>();
  values[0] = static_cast<int64_t>(seed.key);
  values[1] = static_cast<int64_t>(seed.first);
  return out;
}

// The seed a `seed` argument holds: its values where they can be read here, else the tensor itself.
PhiloxSeed seed_of(const at::Tensor& seed) {
  if (holds_data(seed)) return philox_seed(seed);
  PhiloxSeed traced;
  traced.tensor = seed;
  return traced;
}

// A fresh dropout of `x` and its seed, drawn from the device's generator by the kernels; in a trace, by
// torch.randint (a random operator the trace keeps, as the Python functions draw it).
std::tuple<at::Tensor, PhiloxSeed> draw_dropout(const at::Tensor& x, double p) {
  at::Tensor xc = x.contiguous();
  PhiloxSeed seed;
  if (holds_data(xc)) {
    at::Tensor out = at::empty_like(xc, at::MemoryFormat::Contiguous);
    seed = dropout_draw(xc, p, out);
    return {out, seed};
  }
  seed.tensor = at::randint(int64_t{1} << 62, {2}, xc.options().dtype(at::kLong));
  return {dropout_operator(xc, p, seed.tensor), seed};
}

// The dropout of `x` with `seed`, written over `x` where it is the caller's own contiguous tensor (`owned`).
at::Tensor dropped(const at::Tensor& x, double p, const PhiloxSeed& seed, bool owned) {
  if (!holds_data(x) || (seed.tensor.defined() && !holds_data(seed.tensor))) {
    return dropout_operator(x, p, seed_tensor(seed));
  }
  at::Tensor xc = x.contiguous();
  at::Tensor out = owned && xc.is_same(x) ? xc : at::empty_like(xc, at::MemoryFormat::Contiguous);
  if (xc.numel() > 0) dropout(xc, p, seed, out);
  return out;
}

// dropout_input_and_grad of the kernels, called directly where the tensors hold data, else as the operator.
std::tuple<at::Tensor, at::Tensor> drop_input_and_grad(const at::Tensor& x, const OptionalTensor& scale,
                                                       const OptionalTensor& shift, at::ScalarType dtype,
                                                       const at::Tensor& grad, double p, const PhiloxSeed& seed) {
  if (!holds_data(x) || !holds_data(grad) || (seed.tensor.defined() && !holds_data(seed.tensor))) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("lowmem::dropout_input_and_grad", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptionalTensor&,
                                                                    const OptionalTensor&, at::ScalarType,
                                                                    const at::Tensor&, double, const at::Tensor&)>();
    return op.call(x, scale, shift, dtype, grad, p, seed_tensor(seed));
  }
  at::Tensor xc = x.contiguous(), g = grad.contiguous();
  at::Tensor read = at::empty(xc.sizes(), xc.options().dtype(dtype));
  at::Tensor masked = g.is_same(grad) ? g : at::empty_like(g);  // the caller's own gradient: masked in place
  if (xc.numel() > 0) {
    dropout_input_and_grad(xc, value_or_undefined(scale), value_or_undefined(shift), g, p, seed, read, masked);
  }
  return {read, masked};
}

// kernels.torch_ops.affine: scale * z + shift in their dtype (either may be absent), returned in `dtype`.
at::Tensor affine(const at::Tensor& z, const OptionalTensor& scale, const OptionalTensor& shift, at::ScalarType dtype) {
  const at::Tensor out = in_dtype(z, (scale.has_value() ? *scale : *shift).scalar_type());
  if (scale.has_value() && shift.has_value()) return in_dtype(at::addcmul(*shift, out, *scale), dtype);
  return in_dtype(scale.has_value() ? out * *scale : out + *shift, dtype);
}

// ops.affine._norm_output: the output y of the norm whose z a linear shares, as the norm computed it.
at::Tensor norm_output(const at::Tensor& z, const at::Tensor& gamma, const at::Tensor& beta, double offset) {
  const auto [scale, shift] = affine_values(z.scalar_type(), gamma, beta, offset);
  return affine(z, scale, shift, z.scalar_type());
}

// The seed a function keeps for its backward: its values where they live on the host (no tensor saved), its tensor
// otherwise (appended to `saved`).
void keep_seed(AutogradContext* ctx, const PhiloxSeed& seed, std::vector<at::Tensor>& saved) {
  ctx->saved_data["key"] = static_cast<int64_t>(seed.key);
  ctx->saved_data["first"] = static_cast<int64_t>(seed.first);
  saved.push_back(seed.tensor);
}

PhiloxSeed kept_seed(AutogradContext* ctx, const at::Tensor& tensor) {
  PhiloxSeed seed;
  seed.key = static_cast<uint64_t>(ctx->saved_data["key"].toInt());
  seed.first = static_cast<uint64_t>(ctx->saved_data["first"].toInt());
  seed.tensor = tensor;
  return seed;
}

// lightning_lowmem.ops.affine.AffineLinearFunction, dropout included: with p > 0 and no `dropped` seed, the layer
// drops its input with a seed drawn here (a LoRA adapter's folded dropout); with one, its input is already that
// dropout of the norm's output whose z it saves (BERT's embedding dropout).
struct AffineLinearFunction : public torch::autograd::Function<AffineLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& z,
                            const at::Tensor& weight, const OptionalTensor& bias, const OptionalTensor& gamma,
                            const OptionalTensor& beta, at::ScalarType dtype, double offset, double p,
                            const OptionalTensor& dropped_seed) {
    at::Tensor x_in = in_dtype(x, dtype);  // under autocast `dtype` is its dtype: autocast has nothing left to cast
    const bool applies = p > 0.0 && !dropped_seed.has_value();
    PhiloxSeed seed;
    at::Tensor read = x_in;
    if (applies) {
      std::tie(read, seed) = draw_dropout(x_in, p);
    } else if (dropped_seed.has_value()) {
      seed = seed_of(*dropped_seed);
    }
    OptionalTensor bias_in;
    if (bias.has_value()) bias_in = in_dtype(*bias, dtype);
    at::Tensor out = at::linear(read, in_dtype(weight, dtype), bias_in);
    // only the weight gradient reads the input: a frozen linear saves none, as stock; a narrower input
    // (bf16 into fp32 adapters) is saved as it is, and widened again in backward
    const bool narrower = c10::promoteTypes(x.scalar_type(), dtype) == dtype;
    at::Tensor saved;
    if (weight.requires_grad()) saved = z.has_value() ? *z : narrower ? x : x_in;
    std::vector<at::Tensor> tensors{saved, weight, value_or_undefined(gamma), value_or_undefined(beta)};
    const bool masked = applies || dropped_seed.has_value();
    if (masked) keep_seed(ctx, seed, tensors);
    ctx->save_for_backward(tensors);
    ctx->saved_data["dtype"] = dtype;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["shared"] = z.has_value();
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["p"] = masked ? p : 0.0;
    ctx->saved_data["applies"] = applies;
    ctx->saved_data["needs"] = std::vector<bool>{x.requires_grad(), weight.requires_grad(), requires_grad(bias)};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &inputs_saved = saved[0], &weight = saved[1], &gamma = saved[2], &beta = saved[3];
    const auto needs = ctx->saved_data["needs"].toBoolList();
    const bool needs_x = needs.get(0), needs_w = needs.get(1), needs_b = needs.get(2);
    const at::ScalarType dtype = ctx->saved_data["dtype"].toScalarType();
    const double p = ctx->saved_data["p"].toDouble();
    const PhiloxSeed seed = p > 0.0 ? kept_seed(ctx, saved[4]) : PhiloxSeed();
    const at::Tensor grad = in_dtype(grads[0], dtype);
    const at::Tensor grad_2d = grad.reshape({-1, grad.size(-1)});
    variable_list out(10);
    at::Tensor grad_sum;
    if (needs_b) grad_sum = grad_2d.sum(0);  // one pass over grad, for the bias and the beta term
    const bool shared = ctx->saved_data["shared"].toBool() && (gamma.defined() || beta.defined());
    const double offset = ctx->saved_data["offset"].toDouble();
    const bool applies = ctx->saved_data["applies"].toBool();
    at::Tensor grad_x;
    if (needs_x) grad_x = grad.matmul(in_dtype(weight, dtype));
    if (needs_w && applies && needs_x) {  // the input the layer read and the gradient of it: one mask, one pass
      OptionalTensor scale, shift;  // the kernels round the rebuilt input to z's dtype, then to `dtype`
      if (shared) std::tie(scale, shift) = affine_values(dtype, gamma, beta, offset);
      at::Tensor read;
      std::tie(read, grad_x) = drop_input_and_grad(inputs_saved, scale, shift, dtype, grad_x, p, seed);
      out[2] = in_dtype(grad_2d.t().mm(read.reshape({-1, read.size(-1)})), weight.scalar_type());
    } else if (needs_w && p > 0.0) {  // ops.affine._dropped_input: the input the layer read, rebuilt, then the mask
      // the mask where the forward took it: the layer's own in its dtype, a dropout before it in x's
      const at::Tensor x = shared ? norm_output(inputs_saved, gamma, beta, offset) : inputs_saved;
      const at::Tensor input = applies ? in_dtype(x, dtype) : x;
      const at::Tensor read = in_dtype(dropped(input, p, seed, /*owned=*/!input.is_same(inputs_saved)), dtype);
      out[2] = in_dtype(grad_2d.t().mm(read.reshape({-1, read.size(-1)})), weight.scalar_type());
    } else if (needs_w) {
      // ops.affine._weight_grad: (grad^T z) * (gamma + offset) + outer(sum(grad), beta) from a shared z, one pass
      const at::Tensor grad_w = grad_2d.t().mm(in_dtype(inputs_saved.reshape({-1, inputs_saved.size(-1)}), dtype));
      if (shared) {
        const auto [scale, shift] = affine_values(weight.scalar_type(), gamma, beta, offset);
        OptionalTensor total;
        if (beta.defined()) total = grad_sum.defined() ? grad_sum : grad_2d.sum(0);
        out[2] = affine_weight_grad(grad_w, total, scale, shift, weight.scalar_type());
      } else {
        out[2] = in_dtype(grad_w, weight.scalar_type());
      }
    }
    if (needs_b) out[3] = in_dtype(grad_sum, weight.scalar_type());
    if (needs_x) {
      if (applies && !needs_w) grad_x = dropped(grad_x, p, seed, true);  // the mask, on what it read
      out[0] = in_dtype(grad_x, ctx->saved_data["x_dtype"].toScalarType());
    }
    return out;
  }
};

at::Tensor affine_linear(const at::Tensor& x, const OptionalTensor& z, const at::Tensor& weight,
                         const OptionalTensor& bias, const OptionalTensor& gamma, const OptionalTensor& beta,
                         at::ScalarType dtype, double offset, double p, const OptionalTensor& dropped_seed) {
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "affine_linear: dropout p must be in [0, 1), got ", p);
  const OptionalTensor w = weight;
  check_devices("affine_linear", x,
                {{"z", &z}, {"weight", &w}, {"bias", &bias}, {"gamma", &gamma}, {"beta", &beta}, {"seed", &dropped_seed}});
  return AffineLinearFunction::apply(x, z, weight, bias, gamma, beta, dtype, offset, p, dropped_seed);
}

// lightning_lowmem.ops.dropout.SeededDropoutFunction with a seed drawn here: (y, seed), the seed for the readers
// of y that save what y was dropped from (nn.norm.tag_dropped).
struct SeededDropoutFunction : public torch::autograd::Function<SeededDropoutFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, double p) {
    auto [y, seed] = draw_dropout(x, p);
    std::vector<at::Tensor> tensors;
    keep_seed(ctx, seed, tensors);
    ctx->save_for_backward(tensors);
    ctx->saved_data["p"] = p;
    at::Tensor seed_out = seed_tensor(seed);
    ctx->mark_non_differentiable({seed_out});
    return {y, seed_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("seeded_dropout");
    const PhiloxSeed seed = kept_seed(ctx, ctx->get_saved_variables()[0]);
    return {dropped(grads[0], ctx->saved_data["p"].toDouble(), seed, false), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> seeded_dropout(const at::Tensor& x, double p) {
  TORCH_CHECK_VALUE(p > 0.0 && p < 1.0, "seeded_dropout: p must be in (0, 1), got ", p);
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "seeded_dropout: unsupported dtype ", x.scalar_type());
  variable_list out = SeededDropoutFunction::apply(x, p);
  return {out[0], out[1]};
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

std::tuple<at::Tensor, at::Tensor> gated_exceptions(const at::Tensor& act, const at::Tensor& up, int64_t slots) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::gated_exceptions", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(act, up, slots);
}

std::tuple<at::Tensor, at::Tensor> gated_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& second,
                                                  c10::string_view kind, const OptionalTensor& act,
                                                  const OptionalTensor& columns, const OptionalTensor& up_at) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lowmem::gated_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                  c10::string_view, const OptionalTensor&,
                                                                  const OptionalTensor&, const OptionalTensor&)>();
  return op.call(grad, gate, second, kind, act, columns, up_at);
}

// lightning_lowmem.ops.gated.GatedActivationFunction: the stock product, saving (gate, up), or (gate, h) and the
// exceptions where act(gate) is 0 (`slots` a row) to recover up from.
struct GatedActivationFunction : public torch::autograd::Function<GatedActivationFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up, c10::string_view kind,
                            bool recover_up, int64_t slots) {
    const Activation activation = activation_of("gated_activation", kind);
    const at::Tensor act = stock_activation(gate, activation);
    at::Tensor h = act * up;  // on the inputs as given: stock bits
    // a contiguous copy of a strided half (timm's packed fc1), not a view that keeps both halves alive; an expanded
    // gate is kept as it is (it holds fewer elements than a copy)
    const auto strides = gate.strides();
    const bool expanded = std::find(strides.begin(), strides.end(), 0) != strides.end();
    const at::Tensor saved_gate = expanded ? gate : gate.contiguous();
    if (recover_up) {
      auto [columns, up_at] = gated_exceptions(act, up, slots);
      ctx->save_for_backward({saved_gate, h, columns, up_at});
    } else {
      ctx->save_for_backward({saved_gate, up.contiguous()});
    }
    ctx->saved_data["kind"] = std::string(kind);
    if (!saved_gate.is_same(gate)) {  // the forward's layout, which the backward's act(gate) must see again
      ctx->saved_data["sizes"] = gate.sizes().vec();
      ctx->saved_data["strides"] = gate.strides().vec();
    }
    return h;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("gated_activation");
    const variable_list saved = ctx->get_saved_variables();
    const std::string kind = ctx->saved_data["kind"].toStringRef();
    const at::Tensor& gate = saved[0];
    OptionalTensor act, columns, up_at;
    if (saved.size() == 4) {  // ops.gated.forward_activation: the very bits the forward multiplied with
      at::Tensor laid_out = gate;
      if (ctx->saved_data.count("sizes")) {
        laid_out = at::empty_strided(ctx->saved_data["sizes"].toIntVector(), ctx->saved_data["strides"].toIntVector(),
                                     gate.options())
                       .copy_(gate);
      }
      act = stock_activation(laid_out, activation_of("gated_activation", kind));
      columns = saved[2];
      up_at = saved[3];
    }
    const at::Tensor grad = in_dtype(grads[0], gate.scalar_type()).contiguous();
    auto [grad_gate, grad_up] = gated_backward(grad, gate, saved[1], kind, act, columns, up_at);
    return {ctx->needs_input_grad(0) ? grad_gate : at::Tensor(), ctx->needs_input_grad(1) ? grad_up : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up, c10::string_view kind, bool recover_up,
                            int64_t slots) {
  const OptionalTensor u = up;
  check_devices("gated_activation", gate, {{"up", &u}});
  return GatedActivationFunction::apply(gate, up, kind, recover_up, slots);
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
  m.impl("seeded_dropout", &lowmem::seeded_dropout);
  m.impl("step_activation", &lowmem::step_activation);
  m.impl("gated_activation", &lowmem::gated_activation);
}
