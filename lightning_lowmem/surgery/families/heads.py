"""Language-model heads: a Hugging Face causal LM computes its training loss through the fused linear +
cross-entropy (:class:`~lightning_lowmem.nn.causal_lm.FusedLossForward`), which never holds the logits.

Its entry is the model's own (``name:head`` in the candidates): the model is not replaced, its forward (and its
head's) gain the fused loss. The head goes last: it is built over the head's replacement, if any.
"""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn.adapters import adapter_of, not_a_linear_head
from lightning_lowmem.nn.causal_lm import FusedLossForward, fused_loss_of
from lightning_lowmem.registry import heads
from lightning_lowmem.surgery import fsdp
from lightning_lowmem.surgery.families.base import Candidates, Family
from lightning_lowmem.surgery.identify import NotConvertible, foreign_hooks
from lightning_lowmem.surgery.report import Entry

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
                fusable_head(module)
                found[self.kind][name] = module
            except NotConvertible as err:
                found.entries[f"{name}:head"] = Entry(name, self.kind, type(module).__name__, "left alone", str(err))

    def plan(self, model, found, flow, options, plan) -> None:
        for name, module in found[self.kind].items():
            head = module.get_output_embeddings()
            fused = FusedLossForward(module, plan.replaced.get(head, head))
            plan.install(module, "forward", fused)
            plan.install(fused.head, "forward", fused.head_forward)
            plan.entries.append(Entry(name, self.kind, type(module).__name__, "converted", _DETAIL))


FAMILY = Heads()
