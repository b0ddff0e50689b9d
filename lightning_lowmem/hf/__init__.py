"""Hugging Face's ``Trainer`` and TRL's ``SFTTrainer``: :class:`LowMemCallback` (needs ``transformers``, the ``hf``
extra); a causal LM's per-token log-probs without its logits, for DPO, KTO and GRPO: :func:`causal_lm_log_probs`."""

from lightning_lowmem.hf.callback import LowMemCallback
from lightning_lowmem.nn.causal_lm import causal_lm_log_probs

__all__ = ["LowMemCallback", "causal_lm_log_probs"]
