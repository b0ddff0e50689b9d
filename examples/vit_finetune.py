"""Fine-tune a timm ViT with LoRA (q/v or all linear), LoRA-FA or full fine-tuning.

Data: scikit-learn's bundled handwritten digits (1,797 real 8x8 scans, nothing to download),
upsampled to the model's resolution, or any ImageFolder you point ``--data.image_folder`` at.

    python examples/vit_finetune.py fit --config examples/configs/vit_lora_lowmem.yaml
    python examples/vit_finetune.py fit --config examples/configs/vit_lora_baseline.yaml
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import timm
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset, random_split

Tuning = Literal["lora_qv", "lora_all", "lora_fa", "full"]
LORA_TARGETS = {"lora_qv": ["qkv"], "lora_all": ["qkv", "proj", "fc1", "fc2"], "lora_fa": ["qkv", "proj", "fc1", "fc2"]}


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's digits as 3-channel images, or an ImageFolder when ``image_folder`` is set."""

    def __init__(
        self,
        img_size: int = 32,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        image_folder: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        dataset = self._image_folder() if self.hparams.image_folder else self._digits()
        n_val = int(len(dataset) * self.hparams.val_fraction)
        generator = torch.Generator().manual_seed(self.hparams.seed)
        self.train_set, self.val_set = random_split(dataset, [len(dataset) - n_val, n_val], generator=generator)

    def _digits(self) -> TensorDataset:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        images = F.interpolate(images, size=self.hparams.img_size, mode="bilinear", align_corners=False)
        images = ((images - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()
        return TensorDataset(images, torch.tensor(digits.target))

    def _image_folder(self):
        from torchvision import datasets, transforms

        size = self.hparams.img_size
        transform = transforms.Compose(
            [
                transforms.Resize(size),
                transforms.CenterCrop(size),
                transforms.ToTensor(),
                transforms.Normalize([0.5] * 3, [0.5] * 3),
            ]
        )
        return datasets.ImageFolder(self.hparams.image_folder, transform=transform)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.hparams.batch_size, num_workers=self.hparams.num_workers)


def apply_tuning(model: torch.nn.Module, tuning: Tuning, rank: int, head: str) -> torch.nn.Module:
    """Full fine-tuning, or peft LoRA (dropout 0) on the chosen linears; LoRA-FA also freezes A."""
    if tuning == "full":
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS[tuning], modules_to_save=[head]
    )
    model = get_peft_model(model, config)
    if tuning == "lora_fa":
        for name, parameter in model.named_parameters():
            if "lora_A" in name:
                parameter.requires_grad_(False)
    return model


class ViTFineTuner(pl.LightningModule):
    """A timm ViT classifier; random init unless ``checkpoint`` points at local weights."""

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        img_size: int = 32,
        patch_size: int = 8,
        num_classes: int = 10,
        tuning: Tuning = "lora_all",
        lora_rank: int = 4,
        lr: float = 1e-3,
        checkpoint: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        model = timm.create_model(
            model_name,
            pretrained=False,
            img_size=img_size,
            patch_size=patch_size,
            num_classes=num_classes,
            checkpoint_path=checkpoint or "",
        )
        self.model = apply_tuning(model, tuning, lora_rank, head="head")
        self.example_input_array = torch.zeros(2, 3, img_size, img_size)
        self.train_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits.float(), labels)
        self.train_accuracy(logits, labels)
        self.log_dict({"train/loss": loss, "train/acc": self.train_accuracy}, prog_bar=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.val_accuracy(logits, labels)
        self.log_dict(
            {"val/loss": F.cross_entropy(logits.float(), labels), "val/acc": self.val_accuracy}, prog_bar=True
        )

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.lr, weight_decay=0.01)


def main() -> None:
    LightningCLI(ViTFineTuner, DigitsDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
