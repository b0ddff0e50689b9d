"""Language-model heads: a Hugging Face causal LM computes its training loss through the fused linear +
cross-entropy (:class:`~lightning_lowmem.nn.causal_lm.FusedLossForward`), which never holds the logits.

Its entry is the model's own (``name:head`` in the candidates): the model is not replaced, its forward (and its
head's) gain the fused loss. The head goes last: it is built over the head's replacement, if any.

What the loss computes is decided by computing it, not by a name: the model's own training loss on the example's
first rows (its ``input_ids`` as labels where it has none) is compared with the fused loss of the same hidden states
with labels shifted and as given, the logits scaled by the model's ``logit_scale`` (:func:`loss_semantics`). A model
whose loss is neither (ProphetNet's two-step predictions) keeps its head, with the figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from numbers import Real
from typing import Any

import torch
from torch import nn

from lightning_lowmem.nn.adapters import adapter_of, not_a_linear_head
from lightning_lowmem.nn.causal_lm import FusedLossForward, LossSemantics, causal_lm_loss, fused_loss_of
from lightning_lowmem.registry import heads
from lightning_lowmem.surgery import fsdp
from lightning_lowmem.surgery.example import CallArgs, call, isolated, loss_in
from lightning_lowmem.surgery.families.base import Candidates, Family
from lightning_lowmem.surgery.identify import NotConvertible, foreign_hooks
from lightning_lowmem.surgery.report import Entry
from lightning_lowmem.surgery.verify import dropout_off, output_tolerance, training_batch

_DETAIL = "training loss through the fused linear + cross-entropy (no logits; logits None with labels)"


def fusable_head(model: nn.Module) -> nn.Module:
    """The head of the causal LM ``model`` whose loss the fused linear + cross-entropy can compute, or
    :class:`NotConvertible`: transformers' standard loss, and a head its library's adapter can give as a linear
    layer (a floating 2-d weight of its own or tied to the embedding, an optional bias; FSDP2-sharded or not)."""
    if not heads.standard_loss(model):
        raise NotConvertible(f"its loss is not transformers' {heads.STANDARD_LOSS}")
    if "forward" in model.__dict__:
        raise NotConvertible("its forward is patched by another library (TRL's fused LM head?): kept as it is")
    head = model.get_output_embeddings()
    if head is None:
        raise NotConvertible("it has no output embeddings (head)")
    adapter = adapter_of(head)
    refusal = not_a_linear_head(head) if adapter is None else adapter.head_refusal(head)
    if refusal is not None:
        raise NotConvertible(refusal)
    if any(not fsdp.owns_hook(hook) for hook in foreign_hooks(head)) or (
        "forward" in head.__dict__ and fused_loss_of(model) is None
    ):
        raise NotConvertible("its head has hooks or a patched forward (other than FSDP2's)")
    return head


def _labelled(value: Any) -> Mapping | None:
    """The keyword arguments holding ``labels`` in ``value`` (a call's, or a dict inside them: a LightningModule's
    ``forward(batch)``), or None."""
    if isinstance(value, Mapping):
        if isinstance(value.get("labels"), torch.Tensor):
            return value
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return next((found for item in value if (found := _labelled(item)) is not None), None)
    return None


def _with_labels(example: Any) -> tuple[Any, Mapping]:
    """``example`` (its first rows) with ``labels`` (its ``input_ids`` where it has none), and the keyword arguments
    holding them."""
    example = training_batch(example)
    call = (example.args, example.kwargs) if isinstance(example, CallArgs) else example
    if (kwargs := _labelled(call)) is not None:
        return example, kwargs
    kwargs = example.kwargs if isinstance(example, CallArgs) else example if isinstance(example, Mapping) else None
    if kwargs is None or not isinstance(kwargs.get("input_ids"), torch.Tensor):
        raise NotConvertible("the example input has no labels or input_ids (keyword arguments) to check its loss on")
    kwargs = {**kwargs, "labels": kwargs["input_ids"]}
    return (replace(example, kwargs=kwargs) if isinstance(example, CallArgs) else kwargs), kwargs


def loss_semantics(
    model: nn.Module,
    lm: nn.Module,
    head: nn.Module,
    example: Any,
    gathered: Callable[[], AbstractContextManager] = nullcontext,
) -> LossSemantics:
    """How the fused loss computes the causal LM ``lm``'s own training loss: the semantics under which the fused loss
    of the hidden states ``head`` reads equals the loss ``model`` returns on ``example`` (with labels), or
    :class:`NotConvertible` with the figures. ``gathered()``: the head's parameters whole (FSDP2) for the fused loss."""
    if example is None:
        raise NotConvertible("no example input to check its loss on")
    batch, kwargs = _with_labels(example)
    scale = getattr(lm, "logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise NotConvertible(f"its logits are scaled by a {type(scale).__name__} (logit_scale), not a number")
    hidden: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _, args: hidden.append(args[0]))
    try:
        with isolated(model, train=True), torch.no_grad(), dropout_off():  # a LoRA head's dropout: the same identity
            loss = loss_in(call(model, batch))
    except Exception as err:
        raise NotConvertible(f"it cannot run the example with labels ({type(err).__name__}: {err})") from err
    finally:
        handle.remove()
    if loss is None or len(hidden) != 1:
        raise NotConvertible("it returns no loss with labels" if loss is None else f"its head ran {len(hidden)} times")
    softcap = getattr(getattr(lm, "config", None), "final_logit_softcapping", None)
    tolerance, figures = output_tolerance(model), []
    for shift in (True, False):
        semantics = LossSemantics(shift, float(scale))
        try:
            with torch.no_grad(), dropout_off(), gathered():
                fused = causal_lm_loss(hidden[0], head, **{**kwargs, "softcap": softcap, "semantics": semantics}).item()
        except (ValueError, RuntimeError) as err:
            raise NotConvertible(f"its loss is not one the fused loss computes ({err})") from err
        if math.isclose(fused, loss.item(), rel_tol=tolerance, abs_tol=tolerance):
            return semantics
        figures.append(f"{fused:.6g} with labels {'shifted' if shift else 'as given'}")
    raise NotConvertible(f"its training loss {loss.item():.6g} is not the fused loss's ({', '.join(figures)})")


class Heads(Family):
    kind = "head"
    switch = "head"
    separable = True

    def nominate(self, model, options, found: Candidates) -> None:
        for name, module in model.named_modules():
            if not (options.head and heads.names_causal_lm(module) and options.selected(name)):
                continue
            if fused_loss_of(module) is not None:
                found.entries[f"{name}:head"] = Entry(name, self.kind, type(module).__name__, "already converted", "")
                continue
            try:
                head = fusable_head(module)
                gathered = partial(found.gathered, next(n for n, m in model.named_modules() if m is head))
                found[self.kind][name] = loss_semantics(model, module, head, found.example, gathered)
            except NotConvertible as err:
                found.entries[f"{name}:head"] = Entry(name, self.kind, type(module).__name__, "left alone", str(err))

    def plan(self, model, found, flow, options, plan) -> None:
        named = dict(model.named_modules())
        for name, semantics in found[self.kind].items():
            module = named[name]
            head = module.get_output_embeddings()
            fused = FusedLossForward(module, plan.replaced.get(head, head), semantics)
            plan.install(module, "forward", fused)
            plan.install(fused.head, "forward", fused.head_forward)
            detail = _DETAIL + ("" if semantics.shift else "; labels as given, not shifted")
            detail += "" if semantics.scale == 1.0 else f"; logits scaled by {semantics.scale:g}"
            plan.entries.append(Entry(name, self.kind, type(module).__name__, "converted", detail))


FAMILY = Heads()
