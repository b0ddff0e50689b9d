"""The language-model heads whose loss the fused linear + cross-entropy computes: Hugging Face causal LMs.

A causal LM is nominated by its class name (``...ForCausalLM``, GPT-2's ``...LMHeadModel``) and a method that
gives its head (``get_output_embeddings``); the surgery then checks that it computes transformers' standard
causal LM loss (:func:`standard_loss`), the semantics the fused loss reproduces.
"""

from __future__ import annotations

import re

from torch import nn

_CAUSAL_LM_NAME = re.compile(r"(ForCausalLM|LMHeadModel)$")
STANDARD_LOSS = "ForCausalLMLoss"
"""transformers' causal LM loss (``transformers.loss.loss_utils``): labels shifted by one, ``ignore_index``
-100, averaged, or summed and divided by ``num_items_in_batch`` when given."""


def names_causal_lm(module: nn.Module) -> bool:
    """Whether ``module``'s class says it is a causal LM with a head (Hugging Face's naming)."""
    return bool(_CAUSAL_LM_NAME.search(type(module).__name__)) and callable(
        getattr(module, "get_output_embeddings", None)
    )


def standard_loss(module: nn.Module) -> bool:
    """Whether the causal LM ``module`` computes its loss with transformers' :data:`STANDARD_LOSS`."""
    return getattr(getattr(module, "loss_function", None), "__name__", None) == STANDARD_LOSS
