"""``SeededDropout``: an ``nn.Dropout`` that saves only a seed for backward (:mod:`lightning_lowmem.ops.dropout`).

On a memory-sharing norm's output (BERT's embedding dropout) it marks its own output as that norm's, dropped
with its seed (:func:`~lightning_lowmem.nn.norm.tag_dropped`): the linear layers reading it then save the
norm's ``z`` and the seed instead of the dropped copy, as they do without the dropout.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem.nn.norm import is_norm_output, tag_dropped
from lightning_lowmem.ops.dropout import dropout_and_seed, dropping, seeded_dropout


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
        if not (dropping(self.training) and 0 < self.p < 1 and not self.inplace and is_norm_output(x)):
            return seeded_dropout(x, self.p, self.training, self.inplace)
        # a memory-sharing norm's output: its consumers may save the norm's z and this seed, not our output
        y, seed = dropout_and_seed(x, self.p)
        return tag_dropped(y, x, self.p, seed)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", saves=seed"
