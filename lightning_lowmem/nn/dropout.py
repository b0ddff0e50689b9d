"""``SeededDropout``: an ``nn.Dropout`` that saves only a seed for backward (:mod:`lightning_lowmem.ops.dropout`)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem.ops.dropout import seeded_dropout


class SeededDropout(nn.Dropout):
    """``nn.Dropout`` (same ``p``, ``inplace``, evaluation identity; still an ``nn.Dropout`` to code that asks) whose
    backward regenerates the mask from a seed instead of keeping it.

    Args:
        p: the probability of an element to be zeroed.
        inplace: write the result into the input, as ``nn.Dropout(inplace=True)`` does.
    """

    @classmethod
    def from_module(cls, module: nn.Dropout) -> SeededDropout:
        """The seeded version of a stock ``nn.Dropout`` (its ``p``, ``inplace`` and training flag)."""
        if not isinstance(module, nn.Dropout):
            raise TypeError(f"SeededDropout.from_module expects nn.Dropout, got {type(module).__name__}")
        new = cls(module.p, module.inplace)
        new.train(module.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return seeded_dropout(x, self.p, self.training, self.inplace)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", saves=seed"
