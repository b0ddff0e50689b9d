"""The recomputing forwards (``nn/recompute.py``): a tiled MLP keeps only its input and its backward one tile; an
offloaded block's device input is kept by nothing; the gradients are the plain forward's."""

from __future__ import annotations

import copy
import weakref
from functools import partial

import pytest
import torch
from torch import nn

from benchmarks import zoo
from lightning_lowmem import apply_lowmem
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.memory.peak import allocation_peak
from lightning_lowmem.nn.recompute import offloaded_forward, tiled_forward

pytest.importorskip("transformers")
TOKENS = 64


def converted_llama(dropout: float = 0.0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The tiny LLaMA, LoRA r=4 on every linear (random B), converted; a batch of 2 x 256 tokens."""
    torch.manual_seed(0)
    model = zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS, random_b=True, lora_dropout=dropout)
    ids = torch.randint(0, zoo.VOCAB, (2, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    apply_lowmem(model, example_input=batch)
    return model, batch


def mlps(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith(".mlp")]


def step(model: nn.Module, batch: dict[str, torch.Tensor], seed: int = 1) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(seed)
    model.train().zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-5, atol=1e-7, msg=name)


def backward_peak(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes allocated at most during the backward of a training step, above what the forward left."""
    model.train().zero_grad(set_to_none=True)
    loss = model(**batch).loss
    return allocation_peak(loss.backward)[0]


def mlp_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """What the MLPs save for backward, as the saved-tensor hooks see it."""
    with SavedTensorMeter(model) as meter:
        model.train()(**batch)
    return sum(n for name, n in meter.by_module.items() if name.endswith(".mlp") or ".mlp." in name)


def test_tiled_mlps_keep_only_their_input_hold_one_tile_in_backward_and_give_the_same_gradients():
    model, batch = converted_llama()
    plain, untiled, untiled_peak = step(model, batch), mlp_bytes(model, batch), backward_peak(model, batch)
    for mlp in mlps(model):
        mlp.forward = partial(tiled_forward, mlp, TOKENS)
    assert_same(step(model, batch), plain)
    assert untiled > 0 and mlp_bytes(model, batch) == 0  # their input is the norm's z, which the norm keeps
    one_layer = untiled / len(mlps(model))  # what one untiled MLP's backward holds at once, 4 tiles of it tiled
    assert backward_peak(model, batch) <= untiled_peak - 0.6 * one_layer * (1 - TOKENS / 256)


def test_a_tiled_mlp_with_dropout_recomputes_the_masks_it_drew():
    """With ``lora_dropout`` each tile draws its own masks (so not the untiled forward's); the recompute draws the
    same ones again: the gradients are those of the tiles run plainly, in order, from the same seed."""
    model, batch = converted_llama(dropout=0.1)
    plainly = copy.deepcopy(model)
    for mlp in mlps(plainly):
        mlp.forward = lambda x, mlp=mlp: torch.cat([type(mlp).forward(mlp, t) for t in x.split(TOKENS, -2)], -2)
    for mlp in mlps(model):
        mlp.forward = partial(tiled_forward, mlp, TOKENS)
    assert_same(step(model, batch), step(plainly, batch))


def test_tiling_is_the_plain_forward_without_gradients_or_within_one_tile():
    mlp = mlps(converted_llama()[0])[0]
    x = torch.randn(2, 256, 64)
    with torch.no_grad():
        torch.testing.assert_close(tiled_forward(mlp, TOKENS, x), mlp(x), rtol=0, atol=0)
    short = torch.randn(2, TOKENS, 64, requires_grad=True)
    assert tiled_forward(mlp, TOKENS, short).grad_fn.name() != "CatBackward0"


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_an_offloaded_blocks_device_input_is_kept_by_nothing_and_the_gradients_hold():
    x = torch.randn(4, 16, requires_grad=True)
    stock = Blocks()
    (stock(x) ** 2).sum().backward()
    expected = [p.grad.clone() for p in stock.parameters()] + [x.grad.clone()]
    x.grad = None
    model = Blocks()
    inputs: list[weakref.ref] = []
    for block in model.blocks:
        block.forward = partial(offloaded_forward, block)
        block.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    out = model(x)
    assert all(ref() is None for ref in inputs[1:])  # the residual stream between blocks: freed
    (out**2).sum().backward()
    for got, want in zip([p.grad for p in model.parameters()] + [x.grad], expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
