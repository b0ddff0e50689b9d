// Device-specific launchers behind the operators of lowmem_bind.cpp. lowmem_cpu.cpp and
// lowmem_cuda.cu each implement all of them; an extension links exactly one.
// Callers pass contiguous tensors of checked dtypes and preallocated outputs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include "lowmem_math.h"

namespace lowmem {

// The device type the linked kernels run on.
extern const c10::DeviceType kKernelDevice;

// packed[i/p] |= code(x[i]) << bits*(i%p) with p = 8/bits, bits the storage bits of `count` thresholds
// (see storage_bits), thresholds compared in x's accumulate type.
void act_codes(const at::Tensor& x, const double* thresholds, int64_t count, at::Tensor& packed);

// y = the stock activation `kind` of x, as F.silu / F.gelu compute it, bit for bit, and the codes of x as
// act_codes writes them; a device may compute both in one pass.
void act_forward(const at::Tensor& x, Activation kind, const double* thresholds, int64_t count, at::Tensor& y,
                 at::Tensor& packed);

// The activation of a registry kernel id (lowmem_math.h), else a clear error naming `op`.
inline Activation activation_of(const char* op, c10::string_view kind) {
#define LOWMEM_MATCH(name, id) \
  if (kind == id) return Activation::name;
  LOWMEM_ACTIVATIONS(LOWMEM_MATCH)
#undef LOWMEM_MATCH
#define LOWMEM_ID(name, id) " " id
  TORCH_CHECK_VALUE(false, op, ": unknown activation kind '", kind, "'; expected one of" LOWMEM_ACTIVATIONS(LOWMEM_ID));
#undef LOWMEM_ID
}

// The stock ATen activation `kind` of x: into y, or as a new tensor.
inline void stock_activation_out(const at::Tensor& x, Activation kind, at::Tensor& y) {
  if (kind == Activation::kSilu) {
    at::silu_out(y, x);
  } else {
    at::gelu_out(y, x, kind == Activation::kGeluTanh ? "tanh" : "none");
  }
}

inline at::Tensor stock_activation(const at::Tensor& x, Activation kind) {
  return kind == Activation::kSilu ? at::silu(x) : at::gelu(x, kind == Activation::kGeluTanh ? "tanh" : "none");
}

// out[i] = grad[i] * levels[code(i)] over `count` levels, computed in grad's accumulate type.
void step_scale(const at::Tensor& grad, const at::Tensor& packed, const double* levels, int64_t count, at::Tensor& out);

// Row-wise affine-free norm over the trailing `dim` elements; rstd holds one value per row. A defined `y` (z's
// dtype) also receives y = scale * z + shift (an undefined scale is 1, an undefined shift 0; both `dim` values of
// rstd's dtype), computed in rstd's dtype from z as stored: what a stock affine of z gives (to a fused
// multiply-add: whether the compiler fuses scale * z + shift is its choice, here as in ATen).
void norm_forward(const at::Tensor& x, int64_t dim, double eps, bool center, at::Tensor& z, at::Tensor& rstd,
                  const at::Tensor& scale, const at::Tensor& shift, at::Tensor& y);

// Input gradient of y = scale * z + beta from the saved output z and rstd only; an undefined `scale` is 1.
// A defined `sums` (2 x dim, accumulate type) receives the column sums of grad * z and grad.
void norm_backward(const at::Tensor& grad, const at::Tensor& z, const at::Tensor& rstd, const at::Tensor& scale,
                   int64_t dim, bool center, at::Tensor& grad_input, at::Tensor& sums);

#if !defined(LOWMEM_CUDA)
// CPU only (a fused language-model head, lightning_lowmem/ops/cross_entropy.py): the cross-entropy of each row of
// `logits` (fp32, bf16 or fp16, computed in fp32; softcap > 0: of softcap * tanh(logits / softcap)) against `target`
// into `loss` (fp32), and the row overwritten with the loss's gradient with respect to it, times the row's
// `row_scale` (fp32, when defined), rounded once; rows whose target is ignore_index get 0 and 0.
void cross_entropy_grad(at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, double label_smoothing,
                        double softcap, const at::Tensor& row_scale, at::Tensor& loss);

// CPU only (per-token log-probs of a head, lightning_lowmem/ops/log_probs.py): of each row of `logits` (fp32, bf16 or
// fp16, computed in fp32) scaled to s = logits / temperature, the target's log-prob s[target] - lse, the entropy
// lse - sum(p s) and lse = logsumexp(s) (fp32 each); rows whose target is ignore_index get 0 and 0 (and their lse).
void token_log_probs(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, double temperature,
                     at::Tensor& log_prob, at::Tensor& entropy, at::Tensor& lse);

// CPU only: each row of `logits` overwritten with (g_lp (onehot(target) - p) - g_H p (log p + H)) / temperature, the
// gradient of g_lp * log_prob + g_H * entropy (g_H: `grad_entropy`, 0 when undefined), rounded once; 0 on ignored rows.
void token_log_probs_grad(at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                          const at::Tensor& entropy, const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy,
                          int64_t ignore_index, double temperature);

// CPU only (a norm with a frozen affine, lightning_lowmem/ops/norm.py): norm_forward writing y, not z, with y
// rounded once from the unrounded z (as stock), and z at the `columns` (int64) of each row into `exact`
// (rows x columns, y's dtype): those y cannot give z back. These two take scale and shift in the accumulate type
// or in x's own (a frozen half / bfloat16 parameter as it is), and widen them.
void norm_output_forward(const at::Tensor& x, int64_t dim, double eps, bool center, at::Tensor& rstd,
                         const at::Tensor& scale, const at::Tensor& shift, at::Tensor& y, const at::Tensor& columns,
                         at::Tensor& exact);

// norm_backward's input gradient from y and rstd: z = (y - shift) / scale (an undefined scale is 1, an undefined
// shift 0; `dim` values of rstd's or y's dtype), except at `columns`, whose z is `exact`.
void norm_output_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd, const at::Tensor& scale,
                          const at::Tensor& shift, const at::Tensor& columns, const at::Tensor& exact, int64_t dim,
                          bool center, at::Tensor& grad_input);
#endif

// A dropout mask's seed (see philox4x32): its Philox key and first counter as host values (CPU), or `tensor`,
// int64 [key] or [key, first counter] where the values are not on the host: on the GPU, read there by the kernel
// (nothing waits for the host, and a CUDA graph replays it), or in a trace.
struct PhiloxSeed {
  uint64_t key = 0, first = 0;
  at::Tensor tensor;
};

// The seed an operator's `seed` argument holds (one int64 key, or key and first counter, on the kernels' device).
PhiloxSeed philox_seed(const at::Tensor& seed);

// out = x * keep / (1 - p), keep from the Philox words of `seed` (see philox4x32), in x's accumulate type; x and
// out contiguous, 0 <= p < 1. A backward calls it on the gradient with the same seed.
void dropout(const at::Tensor& x, double p, const PhiloxSeed& seed, at::Tensor& out);

// A folded dropout's backward in one pass, one mask (of `seed`) on both: read = dropout of x * scale + shift, computed
// in read's accumulate type and rounded to x's dtype, then read's (a norm's output as the norm rounded it; x as it is
// without scale and shift; each undefined or `dim` values of that type, per element of the last dimension), masked =
// dropout of grad. All contiguous; read, grad and masked one dtype, x any floating dtype.
void dropout_input_and_grad(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, const at::Tensor& grad,
                            double p, const PhiloxSeed& seed, at::Tensor& read, at::Tensor& masked);

// A linear's weight gradient from a norm's shared z: out = product * scale + outer(total, shift) in out's accumulate
// type (scale and shift: undefined or `in` values of that type; total: `out` values of product's dtype, defined with
// a shift), product contiguous (out x in), out (its shape, the weight's dtype) written once.
void affine_weight_grad(const at::Tensor& product, const at::Tensor& total, const at::Tensor& scale,
                        const at::Tensor& shift, at::Tensor& out);

// dropout with a seed drawn from the default generator of x's device, as ATen's own dropout draws: a key from the
// CPU's, the GPU's key and as many consecutive counters as the mask uses (no launch, no host synchronisation,
// CUDA-graph safe: the kernel writes them to `tensor`). torch.manual_seed and checkpointing's replay of the
// generators govern it as they govern stock dropout. Returns the seed.
PhiloxSeed dropout_draw(const at::Tensor& x, double p, at::Tensor& out);

// Where act == 0, per row (act's last dimension, rows x slots outputs): the first columns (int32, ascending, -1 past
// the row's last) and up there (0 past the last). act contiguous; up rows x cols with unit column stride.
void gated_exceptions(const at::Tensor& act, const at::Tensor& up, at::Tensor& columns, at::Tensor& up_at);

// Gradients of h = act(gate) * up (kind: silu, gelu or gelu_tanh) from grad = dL/dh. An undefined `act`:
// `second` is up and act is evaluated here; else `act` holds the forward's act(gate) and `second` is h,
// from which up = h / act where act != 0, and where act == 0 up is up_at at its slot in `columns` (both from
// gated_exceptions; undefined: 0). All tensors but `columns` one dtype.
void gated_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& second, const at::Tensor& act,
                    const at::Tensor& columns, const at::Tensor& up_at, Activation kind, at::Tensor& grad_gate,
                    at::Tensor& grad_up);

}  // namespace lowmem
