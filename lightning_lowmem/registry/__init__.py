"""What lightning-lowmem knows about each family of candidate layers: one registry per family.

The bottom layer: plain descriptions, read by the kernels (an activation's id), the ops (step
derivatives, a norm's ``center``), the modules, the surgery's families (which modules to nominate and what
to check them against), the precision plugin (which layers are norms) and the table generator.

- :mod:`.activations`: GELU (erf, tanh), SiLU, QuickGELU, Mish, and the functions that compute them;
  :func:`register_activation`.
- :mod:`.norms`: LayerNorm, RMSNorm; :func:`register_norm`.
- :mod:`.dropouts`: the elementwise dropouts a seeded dropout replaces.
- :mod:`.heads`: the causal LMs whose loss the fused linear + cross-entropy computes.
- :mod:`.step_tables`: the fitted k-bit step derivatives (generated).
"""

from lightning_lowmem.registry.activations import ACTIVATIONS, Activation, register_activation
from lightning_lowmem.registry.norms import NORMS, NormKind, NormLayout, register_norm

__all__ = [
    "ACTIVATIONS",
    "NORMS",
    "Activation",
    "NormKind",
    "NormLayout",
    "register_activation",
    "register_norm",
]
