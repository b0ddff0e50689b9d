"""The verify stage: the converted model computes what the stock model computed, within its dtype's rounding.

Two checks, both on the probe's own input. In evaluation, the outputs (:func:`verify`). In training, what the
optimizer sees (:func:`training_step`): with every dropout off (stock's and ours), the loss (or the outputs, where the
model returns none) and the gradients of the trainable parameters and of the float inputs, each to its dtype's
rounding. The k-bit activations take their exact derivative for the check (:func:`~lightning_lowmem.ops.activation.
exact_derivatives`): what is checked is everything the conversion wires, not the approximation, whose error on the
probe's batch the report gives apart (:func:`approximation_error`). Gradients are compared by their norms and a few
random projections (a handful of numbers per tensor, taken as each gradient arrives: no copy of the gradients is
kept). A change whose kind can be undone alone and fails is rolled back alone, with its figures
(:func:`check_training`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from lightning_lowmem.ops.activation import exact_derivatives
from lightning_lowmem.ops.dropout import dropout_suspended
from lightning_lowmem.surgery.changes import Plan
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.example import CallArgs, batch_size, call, isolated, loss_in, tensors_in, with_batch_size

_PROJECTIONS = 3
_CHUNK = 1 << 24  # elements of a gradient projected at once: the random directions are drawn chunk by chunk
_ROWS = 2  # the training check runs on the example's first rows
_KEPT = 1 << 16  # a gradient this small is kept whole (fp32, host): cheaper than its projections, and exact


def eval_outputs(model: nn.Module, example: Any) -> list[torch.Tensor]:
    """The tensors of one eval-mode forward on ``example``, detached, in fp32."""
    with isolated(model, train=False):
        return [t.detach().float() for t in tensors_in(call(model, example))]


def output_tolerance(model: nn.Module) -> float:
    """How close the converted model's outputs must be to the stock model's: 1e-4 where it computes in
    fp32/fp64, 5e-2 where half-precision parameters or autocast round every layer's output (the two
    models then differ by that rounding, both as close to an fp32 run)."""
    half = (torch.float16, torch.bfloat16)
    device_types = {p.device.type for p in model.parameters()} or {"cpu"}
    return HALF_TOLERANCE if _autocast(device_types) or any(p.dtype in half for p in model.parameters()) else 1e-4


HALF_TOLERANCE = 5e-2


def _autocast(device_types: set[str]) -> bool:
    return any(torch.amp.is_autocast_available(d) and torch.is_autocast_enabled(d) for d in device_types)


def _differs(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> str | None:
    """How ``b`` differs from ``a`` beyond ``tolerance`` (relative to ``a``'s largest magnitude, at least 1), or None."""
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)} instead of {tuple(a.shape)}"
    scale = max(a.abs().max().item() if a.numel() else 0.0, 1.0)
    if torch.allclose(a, b, rtol=tolerance, atol=tolerance * scale, equal_nan=True):
        return None
    return f"max diff {(a - b).abs().max().item():.3g}"


def check_same(before: list[torch.Tensor], after: list[torch.Tensor], tolerance: float) -> None:
    """Raise unless the converted model's outputs equal the stock model's within ``tolerance`` (relative)."""
    if len(before) != len(after):
        raise RuntimeError(f"the converted model returns {len(after)} tensors instead of {len(before)}")
    for i, (a, b) in enumerate(zip(before, after)):
        difference = _differs(a, b, tolerance)
        if difference is not None:
            raise RuntimeError(f"output {i} of the converted model differs from the stock model ({difference})")


def verify(model: nn.Module, example: Any, reference: list[torch.Tensor]) -> None:
    """Raise unless the (converted) model's eval outputs on ``example`` equal ``reference``, the stock model's."""
    check_same(reference, eval_outputs(model, example), output_tolerance(model))


class _StockDropoutOff(TorchFunctionMode):
    """torch's dropouts as in evaluation (the identity), attention's ``dropout_p`` 0; ``autocast``: whether a call ran
    under autocast (entered inside the model's call, as accelerate's patched forward does)."""

    _DROPOUTS = frozenset(
        {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout}
    )

    def __init__(self) -> None:
        super().__init__()
        self.autocast = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.autocast = self.autocast or torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
        if func in self._DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:  # (query, key, value, attn_mask, dropout_p, ...)
            args, kwargs = (
                (args[:4] + (0.0,) + args[5:], kwargs) if len(args) > 4 else (args, {**kwargs, "dropout_p": 0.0})
            )
        return func(*args, **kwargs)


@contextmanager
def dropout_off() -> Iterator[_StockDropoutOff]:
    """Every dropout the identity, stock's and this library's: a training step as deterministic as evaluation."""
    with _StockDropoutOff() as mode, dropout_suspended():
        yield mode


@dataclass
class TrainingStep:
    """The figures of one training step: its loss (or its outputs, where it returns no loss) and, per gradient
    (trainable parameters by name, then the float inputs), its norm and its projections on fixed random directions
    (or, for a small one, the gradient itself)."""

    loss: torch.Tensor | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    half: bool = False  # it ran under autocast
    norms: dict[str, float] = field(default_factory=dict)
    projections: dict[str, torch.Tensor] = field(default_factory=dict)
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # gradients of at most _KEPT elements, whole


def training_batch(example: Any) -> Any:
    """The example's first rows (all of it where its tensors do not share a batch size)."""
    try:
        rows = batch_size(example, "verify")
    except ValueError:
        return example
    return example if rows <= _ROWS else with_batch_size(example, _ROWS)


def _project(grad: torch.Tensor, index: int) -> torch.Tensor:
    """``grad``'s dot products with :data:`_PROJECTIONS` standard normal directions of its shape, the same for every
    call with ``index`` (drawn chunk by chunk from a generator seeded by it)."""
    generator = torch.Generator(grad.device).manual_seed(index)
    flat = grad.detach().reshape(-1)
    total = torch.zeros(_PROJECTIONS, dtype=torch.float64, device=grad.device)
    for chunk in flat.split(_CHUNK):
        directions = torch.randn(
            _PROJECTIONS, chunk.numel(), generator=generator, device=grad.device, dtype=torch.float32
        )
        total += (directions @ chunk.float()).double()
    return total.cpu()


def _with_input_gradients(example: Any) -> tuple[Any, list[torch.Tensor]]:
    """``example`` with each float tensor a leaf that takes a gradient, and those leaves."""
    leaves: list[torch.Tensor] = []

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            leaves.append(value.detach().clone().requires_grad_(True))
            return leaves[-1]
        return value

    if isinstance(example, CallArgs):
        return CallArgs(tree_map(leaf, example.args), tree_map(leaf, example.kwargs), example.module), leaves
    return tree_map(leaf, example), leaves


def training_step(model: nn.Module, example: Any, exact: bool = True) -> TrainingStep:
    """One training step's figures on ``example``, dropout off (``exact``: the k-bit activations with their exact
    derivative), nothing of the model changed: buffers and RNG restored, and the gradients taken by
    ``torch.autograd.grad``, so no ``.grad`` is written and no hook on a parameter's gradient fires (DeepSpeed's
    reductions, DDP's buckets)."""
    example, inputs = _with_input_gradients(example)
    leaves = {name: p for name, p in model.named_parameters() if p.requires_grad}
    leaves |= {f"input {i}": t for i, t in enumerate(inputs)}
    step = TrainingStep()
    with isolated(model, train=True), dropout_off() as mode, exact_derivatives() if exact else nullcontext():
        output = call(model, example)
        step.half = mode.autocast
        loss = loss_in(output)
        outputs = [t for t in tensors_in(output) if t.is_floating_point()]
        if loss is None:
            step.outputs = [t.detach().float() for t in outputs]
            terms = [(t.float() * _direction(t, i)).sum() for i, t in enumerate(outputs) if t.requires_grad]
            loss = sum(terms[1:], terms[0]) if terms else None  # no tensor made on the default device
        else:
            step.loss = loss.detach().float()
        del output, outputs
        if loss is None or not loss.requires_grad:
            return step
        grads = list(torch.autograd.grad(loss, list(leaves.values()), allow_unused=True))
    for index, name in enumerate(leaves):
        grad, grads[index] = grads[index], None  # each gradient freed once projected
        if grad is not None:
            step.norms[name] = float(grad.detach().float().norm())
            if grad.numel() <= _KEPT:
                step.kept[name] = grad.detach().float().reshape(-1).cpu()
            else:
                step.projections[name] = _project(grad, index)
    return step


def _direction(output: torch.Tensor, index: int) -> torch.Tensor:
    """A fixed random weighting of ``output``'s elements: the backward of a model that returns no loss."""
    generator = torch.Generator(output.device).manual_seed(1_000_003 + index)
    return torch.randn(output.shape, generator=generator, device=output.device, dtype=torch.float32)


def gradient_errors(reference: TrainingStep, step: TrainingStep) -> dict[str, float]:
    """Each gradient's distance from the stock one, estimated from the projections (the difference's projection on a
    standard normal direction has the difference's norm as its spread)."""
    errors = {
        name: math.sqrt(float(((step.projections[name] - projected) ** 2).mean()))
        for name, projected in reference.projections.items()
        if name in step.projections
    }
    errors |= {
        name: float((step.kept[name] - kept).norm()) for name, kept in reference.kept.items() if name in step.kept
    }
    return errors


def approximation_error(reference: TrainingStep, step: TrainingStep) -> float:
    """``|g - g_stock| / |g_stock|`` over all gradients together: how far the k-bit activations' approximate backward
    takes a step from stock's."""
    total = math.sqrt(sum(n * n for n in reference.norms.values()))
    return math.sqrt(sum(e * e for e in gradient_errors(reference, step).values())) / max(total, 1e-30)


def compare(reference: TrainingStep, step: TrainingStep, tolerance: float) -> str | None:
    """How the (converted) model's training step differs from the stock one's beyond the tolerance, in figures, or
    None: the loss or outputs within ``tolerance``, each gradient within ``10 * tolerance`` (at most 0.1) of its norm,
    or of ``10 * tolerance`` times the largest one's: a gradient that is 0 but for rounding (a bias before a
    BatchNorm, which removes it) is rounding noise in stock's step too (MobileViT: 1.5e-14 in fp64, stock's 6.9e-6,
    converted 8.4e-6, beside a largest norm of 44), and differs by 100% without anything computing otherwise."""
    if reference.loss is not None:
        if step.loss is None:
            return "no loss where the stock model returns one"
        a, b = reference.loss.item(), step.loss.item()
        if not math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance):
            return f"loss {b:.6g} vs stock's {a:.6g}"
    else:
        if len(step.outputs) != len(reference.outputs):
            return f"{len(step.outputs)} outputs instead of {len(reference.outputs)}"
        for i, (a, b) in enumerate(zip(reference.outputs, step.outputs)):
            difference = _differs(a, b, tolerance)
            if difference is not None:
                return f"training output {i}: {difference}"
    unmatched = sorted(set(reference.norms) ^ set(step.norms))
    if unmatched:
        return f"gradient of {unmatched[0]} {'missing' if unmatched[0] in reference.norms else 'unexpected'}"
    largest, relative = max(reference.norms.values(), default=0.0), min(10 * tolerance, 0.1)
    for name, error in gradient_errors(reference, step).items():
        norm = reference.norms[name]
        if error > relative * max(norm, relative * largest, 1e-12):
            return f"gradient of {name}: {error / max(norm, 1e-30):.3g} off stock's (relative, norm {norm:.3g})"
    return None


def check_training(
    model: nn.Module, example: Any, reference: TrainingStep, plan: Plan, surgery: Surgery, separable: frozenset[str]
) -> tuple[Surgery, dict[str, str]]:
    """The training check of the applied ``plan`` (``surgery``) against the stock ``reference``: where it fails, each
    ``separable`` kind is checked alone (with the others that cannot be undone) and those that fail are left out.
    Returns the surgery in force and the kinds left out with their figures; raises (everything undone) where the
    rest still fails."""
    tolerance = output_tolerance(model)

    def failure() -> str | None:
        step = training_step(model, example)
        return compare(reference, step, HALF_TOLERANCE if reference.half or step.half else tolerance)

    found = failure()
    if found is None:
        return surgery, {}
    alone = [kind for kind in dict.fromkeys(plan.kinds) if kind in separable]
    failures: dict[str, str] = {}
    try:
        for kind in alone:
            surgery.rollback()
            surgery = plan.apply(model, frozenset(alone) - {kind})
            failed = failure()
            if failed is not None:
                failures[kind] = f"the training step with it differs from stock's ({failed})"
        surgery.rollback()
        surgery = plan.apply(model, frozenset(failures))
        found = failure()
        if found is not None:
            blame = f" (its {', '.join(failures)} changes left out)" if failures else ""
            raise RuntimeError(f"the converted model's training step differs from the stock model's{blame}: {found}")
    except BaseException:
        surgery.rollback()
        raise
    return surgery, failures


APPROXIMATION_LIMIT = 10.0
"""The most the k-bit activations' backward may take a training step's gradients from stock's (``|g - g_stock| /
|g_stock|`` over all of them): an order of magnitude, where the error no longer averages out but compounds through
the depth. Transformers stay inside, random-init ones too, whose tiny pre-activations the steps fit worst (on their
probes: BERT 3%, GPT-2 38%, a 64-pixel ViT-Tiny 187%); a BatchNorm convnet's grows block by block (EfficientNet-B0 at
initialisation: 13% at the classifier, 126x at the stem, 5,093% in all), and its activations stay stock."""
_APPROXIMATE = ("activation", "functional")  # the families whose changes hold k-bit activations


def check_approximation(
    model: nn.Module, example: Any, reference: TrainingStep, plan: Plan, surgery: Surgery
) -> tuple[Surgery, Plan, dict[str, str], float | None]:
    """The k-bit activations' error on a training step against the stock ``reference`` (:func:`approximation_error`);
    past :data:`APPROXIMATION_LIMIT` their families are rolled back, module activations first. Returns the surgery and
    plan in force, the families rolled back with their figures, and the error of what stays (None: nothing
    approximate stays)."""
    failures: dict[str, str] = {}
    try:
        while approximate := [kind for kind in _APPROXIMATE if kind in plan.kinds]:
            error = approximation_error(reference, training_step(model, example, exact=False))
            if error <= APPROXIMATION_LIMIT:
                return surgery, plan, failures, error
            failures[approximate[0]] = (
                f"the k-bit activations' backward takes the step's gradients {error:.0%} off stock's, past "
                f"{APPROXIMATION_LIMIT:.0%}: it compounds through the depth"
            )
            surgery.rollback()
            plan = plan.without(approximate[:1])
            surgery = plan.apply(model)
    except BaseException:
        surgery.rollback()
        raise
    return surgery, plan, failures, None
