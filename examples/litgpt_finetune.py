"""Fine-tune a LitGPT model with LoRA through Lightning Fabric, as ``litgpt finetune lora`` does, with
lightning-lowmem: ``apply_lowmem(model, example_input=...)`` before ``fabric.setup(model)``.

Data: the Python standard library's own source files, byte-level tokens (nothing is downloaded). The model is a
random-init ``litgpt.lora.GPT`` of a real architecture's config (``--model``, any name of
``litgpt.Config.from_name``) at a small size, LoRA on every linear layer and the head, ``bf16-true``.

    python examples/litgpt_finetune.py --model Llama-2-7b-hf --steps 20
    python examples/litgpt_finetune.py --model pythia-160m --devices 2 --strategy ddp
    python examples/litgpt_finetune.py --model Llama-2-7b-hf --devices 2 --strategy fsdp2
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import litgpt
import litgpt.lora
import torch
from litgpt.utils import chunked_cross_entropy
from torch.utils.data import DataLoader

from lightning_lowmem import apply_lowmem

try:  # run as a script (examples/ is on sys.path) or imported as examples.litgpt_finetune
    from stdlib_data import stdlib_text
except ImportError:
    from examples.stdlib_data import stdlib_text


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="Llama-2-7b-hf", help="a litgpt.Config name (its architecture)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--lora-dropout", type=float, default=0.05)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", choices=["auto", "ddp", "fsdp2"], default="auto")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--stock", action="store_true", help="train without lightning-lowmem (the baseline)")
    return parser.parse_args(argv)


def fsdp2(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
    """Fabric's ``ModelParallelStrategy`` hook: FSDP2 shards each block, then the rest (a converted model shards
    as a stock one does)."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def strategy(args: argparse.Namespace):
    if args.strategy == "fsdp2":
        return L.fabric.strategies.ModelParallelStrategy(fsdp2, data_parallel_size=args.devices, tensor_parallel_size=1)
    return args.strategy


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse(argv)
    fabric = L.Fabric(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy(args), precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(1337)
    real = litgpt.Config.from_name(args.model)
    intermediate = round(real.intermediate_size / real.n_embd * args.n_embd)  # the architecture's MLP ratio
    config = litgpt.lora.Config.from_name(
        args.model, n_layer=args.n_layer, n_embd=args.n_embd, intermediate_size=intermediate, n_head=args.n_head, n_query_groups=args.n_head,
        head_size=args.n_embd // args.n_head, padded_vocab_size=256, block_size=args.seq_len, lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r, lora_dropout=args.lora_dropout, lora_query=True, lora_key=True, lora_value=True,
        lora_projection=True, lora_mlp=True, lora_head=True,
    )  # fmt: skip
    with fabric.init_module():
        model = litgpt.lora.GPT(config)
    litgpt.lora.mark_only_lora_as_trainable(model)

    text = torch.frombuffer(bytearray(stdlib_text(400_000)), dtype=torch.uint8).long()
    windows = text[: len(text) // (args.seq_len + 1) * (args.seq_len + 1)].view(-1, args.seq_len + 1)
    example = windows[: args.batch_size, :-1].to(fabric.device)
    reduction = 0.0
    if not args.stock:  # before fabric.setup: the surgery sees the model as the user built it
        with fabric.autocast():
            report = apply_lowmem(model, example_input=example)
        fabric.print(report)
        reduction = report.reduction
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    )
    loader = fabric.setup_dataloaders(DataLoader(windows, batch_size=args.batch_size, shuffle=True, drop_last=True))

    losses, started = [], time.perf_counter()
    model.train()
    for step, batch in zip(range(args.steps), loader):
        logits = model(batch[:, :-1])
        loss = chunked_cross_entropy(logits, batch[:, 1:])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 5 == 0 or step == args.steps - 1:
            fabric.print(f"step {step:3d}  loss {losses[-1]:.3f}")
    seconds = (time.perf_counter() - started) / max(len(losses), 1)
    saved = "stock: no conversion" if args.stock else f"{100 * reduction:.1f}% less activation memory than stock"
    fabric.print(f"{args.model} (LitGPT, LoRA r={args.lora_r}, {args.precision}): {saved}, {seconds:.2f} s/step")
    return {"first_loss": losses[0], "last_loss": losses[-1], "reduction": reduction}


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # gloo's worker threads, still holding tensors at interpreter shutdown,
        torch.distributed.destroy_process_group()  # abort the process now and then (pytorch/pytorch#179291)
