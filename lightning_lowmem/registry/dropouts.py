"""The dropouts a seeded dropout replaces: modules that zero each element independently with probability ``p``.

``nn.Dropout`` and the library classes that are ``nn.Dropout`` with its own forward (Hugging Face, timm and
peft use it directly). Channel dropouts (``nn.Dropout1d/2d/3d``) and alpha dropouts draw other masks and are
not ``nn.Dropout`` subclasses, so they are not candidates.
"""

from __future__ import annotations

from torch import nn


def is_elementwise_dropout(module: nn.Module) -> bool:
    """An ``nn.Dropout`` that computes what ``nn.Dropout`` computes (a subclass may override ``forward``)."""
    return isinstance(module, nn.Dropout) and type(module).forward is nn.Dropout.forward
