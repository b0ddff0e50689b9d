"""Fine-tune a LLaMA-architecture causal LM with peft LoRA on all linear layers.

Data: the Python standard library's own source files (real text that ships with every Python),
byte-level tokens, so nothing is downloaded. The model is a random-init ``LlamaForCausalLM`` from
a small config, or any local Hugging Face checkpoint given as ``--model.checkpoint`` (its tokenizer
is then used instead of bytes).

    python examples/llama_finetune.py fit --config examples/configs/llama_lora_lowmem.yaml
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, TensorDataset

try:  # run as a script (examples/ is on sys.path) or imported as examples.llama_finetune
    from stdlib_data import stdlib_text
except ImportError:
    from examples.stdlib_data import stdlib_text

LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class StdlibTextDataModule(pl.LightningDataModule):
    """Fixed-length windows of stdlib source; the last ``val_fraction`` of the text validates."""

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 8,
        max_bytes: int = 400_000,
        val_fraction: float = 0.1,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _tokens(self) -> torch.Tensor:
        text = stdlib_text(self.hparams.max_bytes)
        if self.hparams.tokenizer is None:
            return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.hparams.tokenizer)
        return torch.tensor(tokenizer(text.decode("utf-8", "replace"))["input_ids"])

    def setup(self, stage: str | None = None) -> None:
        tokens = self._tokens()
        windows = tokens[: len(tokens) // self.hparams.seq_len * self.hparams.seq_len].view(-1, self.hparams.seq_len)
        n_val = max(1, int(len(windows) * self.hparams.val_fraction))
        self.train_set, self.val_set = TensorDataset(windows[:-n_val]), TensorDataset(windows[-n_val:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.hparams.batch_size)


class LlamaLoRA(pl.LightningModule):
    """LlamaForCausalLM (random init from a small config, or a local checkpoint) with LoRA."""

    def __init__(
        self,
        hidden_size: int = 256,
        intermediate_size: int = 688,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        vocab_size: int = 256,
        lora_rank: int = 8,
        lr: float = 2e-3,
        checkpoint: str | None = None,
        seq_len: int = 128,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        if checkpoint:
            model = LlamaForCausalLM.from_pretrained(checkpoint)
        else:
            config = LlamaConfig(
                vocab_size=vocab_size,
                hidden_size=hidden_size,
                intermediate_size=intermediate_size,
                num_hidden_layers=num_hidden_layers,
                num_attention_heads=num_attention_heads,
                max_position_embeddings=max(seq_len, 128),
            )
            model = LlamaForCausalLM(config)
        lora = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=LLAMA_LINEARS)
        self.model = get_peft_model(model, lora)
        tokens = torch.zeros(2, seq_len, dtype=torch.long)
        self.example_input_array = {"input_ids": tokens, "labels": tokens}  # a training step's call, loss included

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.model(input_ids=input_ids, labels=labels)

    def _loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self(input_ids, labels=input_ids).loss  # the model's own causal LM loss (next-token, shifted)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch[0])
        self.log("train/loss", loss, prog_bar=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch[0])
        self.log_dict({"val/loss": loss, "val/ppl": math.e ** loss.item()}, prog_bar=True)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.lr)

    def on_fit_start(self) -> None:
        report = next((c.report for c in self.trainer.callbacks if type(c).__name__ == "LowMemBP"), None)
        if report is not None and report.saved_by_module_before:
            rank_zero_info(head_share(report))


def head_share(report) -> str:
    """What the language-model head and its loss saved for backward in the probe step, before and after."""
    heads = {e.name for e in report.entries if e.kind == "head"}
    owners = lambda name: name in heads or name.endswith("lm_head")
    shares = []
    for stage in ("before", "after"):
        by_module = getattr(report, f"saved_by_module_{stage}")
        head, total = sum(v for k, v in by_module.items() if owners(k)), sum(by_module.values())
        shares.append(f"{head / 2**20:.2f} of {total / 2**20:.2f} MiB ({head / max(total, 1):.0%})")
    return f"language-model head and loss, saved for backward: {shares[0]} -> {shares[1]}"


def main() -> None:
    LightningCLI(LlamaLoRA, StdlibTextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
