"""bitsandbytes' quantized layers (QLoRA's frozen 4-bit base layers), in one place.

bitsandbytes is never imported here unless the model's code already did: its layers are
recognised through the module the process has loaded. A frozen 4-bit layer saves nothing for backward, so it
reads a norm's output as a consumer would; on a CPU it repacks its weight for inference after an eval
forward, which the surgery keeps it from doing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from lightning_lowmem.nn.adapters import LinearAdapter


def is_frozen_4bit_linear(module: nn.Module) -> bool:
    """A bitsandbytes ``Linear4bit`` (QLoRA's frozen nf4/fp4 base layer): its autograd function keeps only the
    quantized weight for backward (bitsandbytes >= 0.44), so it reads a norm's output saving nothing, as a frozen
    ``nn.Linear`` does. Not ``Linear8bitLt``: its function keeps its input (as a ``ctx`` attribute)."""
    bnb = sys.modules.get("bitsandbytes")  # not imported: no module is one
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


class Frozen4bitLinear(LinearAdapter):
    name = "bitsandbytes"

    def matches(self, layer: nn.Module) -> bool:
        return is_frozen_4bit_linear(layer)

    def saves_its_input(self, layer: nn.Module) -> bool:
        return False

    def reads_linearly(self, layer: nn.Module) -> bool:
        return True  # it saves nothing


ADAPTER = Frozen4bitLinear()


def repacking_4bit_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that repack their quantized weight in place on an eval forward without grad: bitsandbytes'
    ``Linear4bit`` (0.50 here) on a CPU with AVX512-BF16, for an inference kernel. The repack fails when the
    output size is no multiple of 32, rounds the block scales to bfloat16, and leaves the layer computing through
    a kernel without autograd: a training forward after it (after Lightning's sanity check or a validation epoch)
    gives the layers before it no gradient through it."""
    return [m for m in model.modules() if getattr(m, "support_avx512bf16_for_cpu", False)]


@contextmanager
def repacking_off(model: nn.Module) -> Iterator[None]:
    """No repacking (:func:`repacking_4bit_layers`) during a throwaway forward; each layer's setting back after."""
    repacking = repacking_4bit_layers(model)
    for layer in repacking:
        layer.support_avx512bf16_for_cpu = False
    try:
        yield
    finally:
        for layer in repacking:
            layer.support_avx512bf16_for_cpu = True


def unpack_4bit_weight(layer: nn.Module) -> bool:
    """Undo an earlier repack of ``layer``'s weight (as bitsandbytes does before saving it); whether there was one.
    Its block scales stay rounded to bfloat16: the repack lost those bits."""
    state = getattr(layer.weight, "quant_state", None)
    if not getattr(state, "packing_format_for_cpu", False):
        return False
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu_inverse(layer.weight.data, state)
    return True


def keep_4bit_layers_trainable(model: nn.Module) -> list[str]:
    """Switch off bitsandbytes' CPU repacking of 4-bit weights for good, at once (a deferred conversion waits for
    the first training forward, Lightning's sanity check comes before it): after an eval forward the model would
    train without gradients through those layers (:func:`repacking_4bit_layers`). Unpacks any weight an earlier
    eval forward repacked. Returns what it did, for the report."""
    repacking = repacking_4bit_layers(model)
    for layer in repacking:
        layer.support_avx512bf16_for_cpu = False
    unpacked = sum(unpack_4bit_weight(layer) for layer in model.modules() if is_frozen_4bit_linear(layer))
    notes = []
    if repacking:
        notes.append(
            f"bitsandbytes' CPU repacking switched off on {len(repacking)} 4-bit layers (after an eval forward "
            "they would train without input gradients)"
        )
    if unpacked:
        notes.append(f"{unpacked} 4-bit weights repacked by an earlier eval forward unpacked (block scales stay bf16)")
    return notes
