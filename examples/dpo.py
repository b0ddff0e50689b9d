"""DPO on a LightningModule: peft LoRA on a LLaMA, the reference model the same weights with the adapters off, and
every log-prob computed without logits (:func:`lightning_lowmem.hf.causal_lm_log_probs`).

Data: preference pairs cut from the Python standard library's own source (nothing downloaded): a prompt, the text
that really follows it (chosen) and the same bytes shuffled (rejected); byte-level tokens. The model is a random-init
``LlamaForCausalLM`` from a small config.

    python examples/dpo.py [--steps 20] [--stock]
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

try:  # run as a script (examples/ is on sys.path) or imported as examples.dpo
    from stdlib_data import stdlib_text
except ImportError:
    from examples.stdlib_data import stdlib_text

from lightning_lowmem import LowMemBP
from lightning_lowmem.hf import causal_lm_log_probs

LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def preference_pairs(pairs: int, prompt: int, completion: int, seed: int = 0) -> TensorDataset:
    """``(chosen, rejected, labels)`` rows of ``prompt + completion`` byte tokens: the same prompt, then the text
    that follows it or those bytes shuffled; ``labels``: -100 on the prompt (only the completion is scored)."""
    text = torch.frombuffer(bytearray(stdlib_text(pairs * (prompt + completion))), dtype=torch.uint8).long()
    chosen = text[: pairs * (prompt + completion)].view(pairs, prompt + completion)
    generator = torch.Generator().manual_seed(seed)
    order = torch.argsort(torch.rand(pairs, completion, generator=generator), dim=1)
    rejected = torch.cat([chosen[:, :prompt], chosen[:, prompt:].gather(1, order)], dim=1)
    labels = torch.full_like(chosen, -100)
    labels[:, prompt:] = 0  # a mask: each row's own tokens are filled in by the step
    return TensorDataset(chosen, rejected, labels)


class LlamaDPO(pl.LightningModule):
    """A LLaMA with LoRA trained by DPO (Rafailov et al. 2023) against itself with its adapters off."""

    def __init__(
        self, beta: float = 0.1, lr: float = 2e-3, hidden_size: int = 128, layers: int = 2, lora_dropout: float = 0.05
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=256)  # fmt: skip
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=lora_dropout, target_modules=LLAMA_LINEARS)
        self.model = get_peft_model(LlamaForCausalLM(config), lora)
        tokens = torch.zeros(2, 48, dtype=torch.long)
        self.example_input_array = {"input_ids": tokens, "labels": tokens}  # what LowMemBP's surgery probes with

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.model(input_ids=input_ids, labels=labels)

    def sequence_log_probs(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each row's summed log-prob of its completion tokens."""
        labels = tokens.masked_fill(mask == -100, -100)
        return causal_lm_log_probs(self.model, tokens, labels).sum(-1)

    def dpo_loss(self, chosen: torch.Tensor, rejected: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        both = torch.cat([chosen, rejected])
        policy = self.sequence_log_probs(both, torch.cat([mask, mask]))
        with torch.no_grad(), self.model.disable_adapter():  # the reference: no gradient, no logits either
            reference = self.sequence_log_probs(both, torch.cat([mask, mask]))
        margin = (policy - reference).view(2, -1)
        return -F.logsigmoid(self.hparams.beta * (margin[0] - margin[1])).mean()

    def training_step(self, batch, batch_idx):
        loss = self.dpo_loss(*batch)
        self.log("train/dpo_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


def train(steps: int, lowmem: bool, seed: int = 0, lora_dropout: float = 0.05) -> list[float]:
    """The DPO losses of ``steps`` steps (batch 4 pairs of 16 + 32 tokens), with or without ``LowMemBP``."""
    pl.seed_everything(seed, verbose=False)
    module = LlamaDPO(lora_dropout=lora_dropout)
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record(), *([LowMemBP()] if lowmem else [])],
    )  # fmt: skip
    data = DataLoader(preference_pairs(4 * steps, prompt=16, completion=32), batch_size=4)
    trainer.fit(module, data)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stock", action="store_true", help="without LowMemBP")
    args = parser.parse_args()
    losses = train(args.steps, lowmem=not args.stock)
    print(f"DPO losses, first and last: {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
