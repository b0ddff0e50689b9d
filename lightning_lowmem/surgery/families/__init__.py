"""The families of candidates, one module each, in the order they nominate and plan (:data:`FAMILIES`).

The order is what each family needs of the ones before it: gated MLPs claim their activation before the
activation modules are nominated; the adapters fold their dropouts before the model's own dropouts are; the norms
decide their consumers (``plan.norm_of``) before the linear layers and adapters are planned; the linear layers are
replaced before the adapters read their replacements and the head is fused over its own.
"""

from lightning_lowmem.surgery.families import (
    activations,
    adapters,
    attention,
    dropouts,
    functional,
    gated,
    heads,
    linears,
    lora,
    norms,
)
from lightning_lowmem.surgery.families.base import Candidates, Family

FAMILIES: tuple[Family, ...] = (
    gated.FAMILY,
    functional.FAMILY,
    norms.FAMILY,
    linears.FAMILY,
    adapters.FAMILY,
    lora.FAMILY,
    dropouts.FAMILY,
    activations.FAMILY,
    attention.FAMILY,
    heads.FAMILY,
)

__all__ = ["FAMILIES", "Candidates", "Family"]
