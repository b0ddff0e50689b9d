"""Hugging Face's ``Trainer`` and TRL's ``SFTTrainer``: :class:`LowMemCallback` (needs ``transformers``, the ``hf``
extra)."""

from lightning_lowmem.hf.callback import LowMemCallback

__all__ = ["LowMemCallback"]
