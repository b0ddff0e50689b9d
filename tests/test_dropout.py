"""Seeded dropout: the mask regenerated from a seed, stock dropout's semantics, nothing saved but the seed."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import run_ddp_script, run_on
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import zoo
from lightning_lowmem import apply_lowmem, kernels
from lightning_lowmem.kernels import torch_ops
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import LowMemLinear, MemorySharingNorm, SeededDropout
from lightning_lowmem.ops.affine import affine_linear
from lightning_lowmem.ops.dropout import dropout_and_seed, seeded_dropout
from lightning_lowmem.ops.norm import memory_sharing_norm

CPU = torch.device("cpu")


# -- the kernels ----------------------------------------------------------------------------
def test_the_generator_is_philox4x32_10():
    """Random123's known answer (counter 0, key 0): the generator ATen's PhiloxRNGEngine and Triton's tl.philox run."""
    assert torch_ops.philox(0, torch.tensor([0])).tolist() == [[0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_backend_draws_the_reference_mask(kernel_backend, dtype):
    x = torch.randn(3, 1001, 7, device=kernel_backend.device).to(dtype)  # not a multiple of 4 elements
    seed = torch.tensor([2**40 + 5], device=kernel_backend.device)
    want = torch_ops.dropout(x, 0.1, seed)
    torch.testing.assert_close(kernel_backend.module.dropout(x, 0.1, seed), want, rtol=0, atol=0)
    kept = want != 0
    assert torch.equal(want[kept], (x[kept].float() * (1 / 0.9)).to(dtype))  # x / (1 - p), rounded once
    torch.testing.assert_close(kernel_backend.module.dropout(x.mT, 0.1, seed), torch_ops.dropout(x.mT, 0.1, seed))


def test_a_seeds_first_counter_continues_its_keys_stream(kernel_backend):
    """``[key, first]`` draws the mask the key alone draws for elements ``4 * first`` on (a GPU's generator hands one
    key and consecutive counters to each draw, as to ATen's own kernels); 2^40 + 1 counters: past 32 bits."""
    ones = torch.ones(4096 + 30, device=kernel_backend.device)
    key = torch.tensor([2**40 + 5], device=kernel_backend.device)
    whole = kernel_backend.module.dropout(ones, 0.3, key)
    for first in (1, 256):
        part = kernel_backend.module.dropout(
            ones[4 * first :], 0.3, torch.tensor([2**40 + 5, first], device=key.device)
        )
        assert torch.equal(part, whole[4 * first :])
    far = torch.tensor([7, 2**40 + 1], device=key.device)
    torch.testing.assert_close(kernel_backend.module.dropout(ones, 0.3, far), torch_ops.dropout(ones, 0.3, far))


@pytest.mark.parametrize("affine", ["none", "scale", "scale and shift"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_backend_gives_a_folded_dropouts_input_and_gradient_in_one_pass(kernel_backend, dtype, affine):
    """``dropout_input_and_grad``: the input a LoRA adapter read (rebuilt from a norm's ``z`` by its affine, rounded to
    ``z``'s bf16 as the norm rounded its output, then to the compute dtype) and the gradient of what it read, one mask
    on both: the reference's (two ``dropout`` calls); the masks and the gradient exactly, the input but where one
    rounding of the affine (a backend may fuse its multiply-add) moved a bf16 rounding: rare, and one bf16 ulp."""
    device = kernel_backend.device
    z = torch.randn(5, 37, 24, device=device).to(torch.bfloat16)  # a bf16 norm output, read by fp32 or half adapters
    grad = torch.randn(5, 37, 24, device=device).to(dtype)
    scale = torch.rand(24, device=device) + 0.5 if affine != "none" else None
    shift = torch.randn(24, device=device) if affine == "scale and shift" else None
    for seed in (torch.tensor([2**40 + 5], device=device), torch.tensor([7, 2**33 + 1], device=device)):
        read, masked = kernel_backend.module.dropout_input_and_grad(z, scale, shift, dtype, grad, 0.1, seed)
        want_read, want_masked = torch_ops.dropout_input_and_grad(z, scale, shift, dtype, grad, 0.1, seed)
        assert read.dtype == masked.dtype == dtype and torch.equal((read != 0), (want_read != 0))
        torch.testing.assert_close(masked, want_masked, rtol=0, atol=0)
        assert torch.equal(masked != 0, want_read != 0)  # one mask on both
        if affine == "none":
            assert torch.equal(read, want_read)
        else:
            assert (read != want_read).double().mean() < 0.01
            torch.testing.assert_close(read, want_read, rtol=8e-3, atol=1e-6)  # a bf16 ulp


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_the_keep_rate_is_one_minus_p_within_five_sigma(p):
    n = 1 << 20
    y = kernels.implementation(CPU).dropout(torch.ones(n), p, torch.tensor([12345]))
    rate = (y != 0).double().mean().item()
    assert abs(rate - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n), rate
    assert set(y.unique().tolist()) == {0.0, torch.tensor(1 / (1 - p), dtype=torch.float32).item()}


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return ((a * b).mean() / (a.std() * b.std())).item()


def test_masks_of_two_seeds_and_of_neighbouring_elements_are_uncorrelated():
    n, ones = 1 << 20, torch.ones(1 << 20)
    first, second = (kernels.implementation(CPU).dropout(ones, 0.5, torch.tensor([s])) != 0 for s in (1, 2))
    bound = 5 / math.sqrt(n // 4)
    assert abs(_correlation(first, second)) <= bound
    assert abs(_correlation(first[:-1], first[1:])) <= bound  # neighbours, most of them words of one counter
    assert abs(_correlation(first[0:-4:4], first[4::4])) <= bound  # one word of neighbouring counters


def test_bad_arguments_are_refused_by_every_kernel():
    x = torch.ones(8)
    for backend in (torch_ops, kernels.library.OPS):
        with pytest.raises((ValueError, RuntimeError), match="dropout: p must be in \\[0, 1\\)"):
            backend.dropout(x, 1.0, torch.tensor([1]))
        for seed in (torch.tensor([1.0]), torch.tensor([1, 2, 3])):
            with pytest.raises((ValueError, RuntimeError), match="dropout: seed must be one or two int64 values"):
                backend.dropout(x, 0.5, seed)


# -- the op ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_is_stocks_given_the_mask_on_every_backend(kernel_backend, dtype, monkeypatch):
    run_on(monkeypatch, kernel_backend)
    x = (torch.rand(16, 50, device=kernel_backend.device) + 0.5).to(dtype).requires_grad_()  # no zeros
    grad = torch.randn_like(x)
    y = seeded_dropout(x, 0.2)
    y.backward(grad)
    mask = (y != 0).to(torch.float32)
    torch.testing.assert_close(x.grad, (grad.float() * mask * (1 / 0.8)).to(dtype), rtol=0, atol=0)
    assert 0.7 < mask.mean() < 0.9


def test_a_forward_saves_its_seed_alone():
    """On the CPU the seed is two integers kept by the C++ function (no tensor); the Python function, which runs on
    Triton and under torch.compile, saves one int64."""
    x = torch.randn(64, 128, requires_grad=True)
    assert kernels.backend("cpu") == "cpp"
    with SavedTensorMeter() as meter:
        y = seeded_dropout(x, 0.1)
    assert meter.total_bytes == 0 and y.grad_fn.name().startswith("torch::autograd::CppNode")
    with SavedTensorMeter() as meter:
        seeded_dropout(x, 0.1, seed=torch.tensor([5]))
    assert meter.total_bytes == 8  # one int64
    with SavedTensorMeter() as meter:
        F.dropout(x, 0.1)
    assert meter.total_bytes == x.numel()  # stock as a GPU keeps it: a bool mask
    with SavedTensorMeter(gpu_dropout=False) as meter:
        y = F.dropout(x, 0.1)
    assert meter.total_bytes == x.numel() * 4  # stock on CPU: an fp32 noise tensor
    with SavedTensorMeter():
        torch.manual_seed(0)
        z = F.dropout(x, 0.1)
    kept = z != 0  # the same distribution and scaling; the gradient is the mask, scaled
    assert F.dropout is not None and 0.85 < kept.float().mean() < 0.95 and y.shape == z.shape
    torch.testing.assert_close(z[kept], x[kept] / 0.9)
    z.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.9)


def test_the_seed_comes_from_torchs_generator():
    x = torch.randn(64, 33)
    torch.manual_seed(3)
    first = seeded_dropout(x, 0.3)
    torch.manual_seed(3)
    again = seeded_dropout(x, 0.3)
    assert torch.equal(first, again) and not torch.equal(again, seeded_dropout(x, 0.3))


def test_a_checkpointed_recompute_regenerates_the_mask():
    block = nn.Sequential(nn.Linear(32, 64), SeededDropout(0.3), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(8, 32, requires_grad=True)
    grads = []
    for wrap in (False, True):
        block.zero_grad()
        x.grad = None
        torch.manual_seed(7)
        out = checkpoint(block, x, use_reentrant=False) if wrap else block(x)
        out.square().sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in block.parameters())])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def test_stock_semantics_at_the_edges():
    x = torch.randn(4, 8, requires_grad=True)
    assert seeded_dropout(x, 0.5, training=False) is x and seeded_dropout(x, 0.0) is x
    zeros = seeded_dropout(x, 1.0)
    zeros.sum().backward()
    assert torch.equal(zeros, torch.zeros_like(x)) and torch.equal(x.grad, torch.zeros_like(x))
    y = torch.randn(4, 8)
    before = y.clone()
    out = seeded_dropout(y, 0.5, inplace=True)
    assert out is y and torch.equal(y == 0, out == 0) and not torch.equal(y, before)
    for bad in (-0.1, 1.5, "0.5"):
        with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1"):
            seeded_dropout(x, bad)
    with pytest.raises(RuntimeError, match="seeded_dropout does not support double backward"):
        out = seeded_dropout(x, 0.5)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        g.sum().backward()


def test_the_module_is_an_nn_dropout_that_follows_train_and_eval():
    stock = nn.Dropout(0.25, inplace=False).eval()
    seeded = SeededDropout.from_module(stock)
    assert isinstance(seeded, nn.Dropout) and seeded.p == 0.25 and not seeded.training
    x = torch.randn(32, 32)
    assert seeded(x) is x
    seeded.train()
    assert 0.6 < (seeded(x) != 0).float().mean() < 0.9
    with pytest.raises(TypeError, match="expects nn.Dropout"):
        SeededDropout.from_module(nn.Identity())


def test_compiled_fullgraph_without_graph_breaks_applies_one_mask_forward_and_backward():
    layer = nn.Sequential(nn.Linear(16, 16), SeededDropout(0.5))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(32, 16, requires_grad=True)
    out = compiled(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    mask = (out != 0).float()
    torch.testing.assert_close(x.grad, (grad * mask * 2) @ layer[0].weight)


@pytest.mark.parametrize("autograd", ["cpp", "python"])
@pytest.mark.parametrize("where", ["folded", "before"])
@pytest.mark.parametrize("linear_dtype", [torch.bfloat16, torch.float32], ids=["bf16 linear", "fp32 adapter"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input grad", "weight grad alone"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_a_weight_gradient_takes_the_very_input_the_layer_read(
    kernel_backend, autograd, where, linear_dtype, input_grad, offset, monkeypatch
):
    """A bf16 norm shares its z with a linear behind a dropout, the layer's own (LoRA's, folded) or one before it
    (BERT's, of the norm's output): the weight gradient is ``grad^T @`` what the layer read, bit for bit (its weight
    the identity, its output is what it read). The input rebuilt from z was the norm's affine in bf16 arithmetic
    (two roundings where the norm rounds once) and, for fp32 adapters, never rounded to the norm's bf16 output; a
    dropout before the layer had its mask taken in fp32 where the forward took it in bf16."""
    if autograd == "cpp" and kernel_backend.name != "cpp":
        pytest.skip("the C++ autograd functions run over the C++ kernels")
    run_on(monkeypatch, kernel_backend)
    if autograd == "python":
        monkeypatch.setattr(kernels, "autograd_in_cpp", lambda x: False)
    dim, p, device = 64, 0.2, kernel_backend.device
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 33, dim, generator=generator).bfloat16().to(device).requires_grad_()
    gamma = (torch.rand(dim, generator=generator) + 0.5).bfloat16().to(device).requires_grad_()  # z shared
    beta = (torch.randn(dim, generator=generator) / 4).bfloat16().to(device).requires_grad_()
    weight = torch.eye(dim, dtype=linear_dtype, device=device, requires_grad=True)
    y, z = memory_sharing_norm(x, dim, 1e-5, True, gamma, beta, weight_offset=offset)
    shared = (z, gamma, beta, offset)
    if where == "folded":
        x_in = y if input_grad else y.detach()
        out = affine_linear(x_in, weight, None, linear_dtype, *shared, dropout=p)
    else:
        read, seed = dropout_and_seed(y, p)
        x_in = read if input_grad else read.detach()
        out = affine_linear(x_in, weight, None, linear_dtype, *shared, dropped=(p, seed))
    grad = torch.randn(out.shape, generator=generator).to(device, linear_dtype)
    (grad_weight,) = torch.autograd.grad(out, weight, grad)
    read = out.detach().reshape(-1, dim)
    assert (read == 0).any() and (read != 0).any()  # dropped, not all
    assert torch.equal(grad_weight, grad.reshape(-1, dim).t() @ read)


# -- the surgery: LoRA dropouts folded in, model dropouts seeded --------------------------------
def lora_llama(dropout: float, r: int = 8, base_dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = zoo.llama(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=4)
    return zoo.lora(model.to(base_dtype), zoo.LLAMA_LINEARS, random_b=True, r=r, lora_alpha=2 * r, lora_dropout=dropout)


def converted_bytes(model: nn.Module, x: torch.Tensor, autocast: bool) -> int:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return apply_lowmem(model, example_input=x).activation_bytes_after


@pytest.mark.parametrize(
    ("dropout", "r", "recipe"),
    [(0.05, 8, "bf16 autocast"), (0.1, 64, "bf16 autocast"), (0.05, 8, "bf16-true"), (0.1, 64, "bf16-true")],
)
def test_lora_with_dropout_saves_what_it_saves_without(dropout, r, recipe):
    autocast, base_dtype = (True, torch.float32) if recipe == "bf16 autocast" else (False, torch.bfloat16)
    x = torch.randint(0, 128, (2, 32))
    without = converted_bytes(lora_llama(0.0, r, base_dtype), x, autocast)
    model = lora_llama(dropout, r, base_dtype)
    with_dropout = converted_bytes(model, x, autocast)
    assert with_dropout <= 1.03 * without, (with_dropout, without)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.lora_dropout["default"], nn.Identity) and q_proj.lora_A["default"].dropout == dropout


class Masked(nn.Module):
    """A dropout with a given mask (already scaled)."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask


def test_a_folded_lora_dropout_computes_lora_on_the_regenerated_mask():
    model = lora_llama(0.1)
    reference = copy.deepcopy(model)
    x = torch.randint(0, 128, (2, 16))
    apply_lowmem(model, example_input=x)
    layer, stock = (m.base_model.model.model.layers[0].mlp.down_proj for m in (model, reference))
    h = torch.randn(2, 16, 160, requires_grad=True)
    torch.manual_seed(11)
    out = layer(h)
    torch.manual_seed(11)  # the very seed the folded dropout drew: the mask, rebuilt
    mask = kernels.implementation(CPU).dropout(torch.ones_like(h), 0.1, torch.randint(2**62, (1,)))
    stock.lora_dropout["default"] = Masked(mask)
    h_stock = h.detach().clone().requires_grad_()
    want = stock(h_stock)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(h.grad, h_stock.grad)
    for name in ("lora_A", "lora_B"):
        torch.testing.assert_close(
            getattr(layer, name)["default"].weight.grad, getattr(stock, name)["default"].weight.grad
        )


def test_a_converted_lora_model_with_dropout_compiles_whole():
    model = lora_llama(0.1)
    x = torch.randint(0, 128, (2, 16))
    apply_lowmem(model, example_input=x)
    explanation = torch._dynamo.explain(model)(input_ids=x, labels=x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(input_ids=x, labels=x).loss
    loss.backward()
    lora_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    assert torch.isfinite(loss) and lora_a.weight.grad is not None and lora_a.weight.grad.abs().sum() > 0


def test_the_norm_under_a_folded_lora_dropout_stays_shared():
    model = lora_llama(0.05)
    x = torch.randint(0, 128, (2, 16))
    report = apply_lowmem(model, example_input=x)
    base = "base_model.model.model.layers.0."
    assert report.status(base + "input_layernorm") == "converted"
    q_a = model.get_submodule(base + "self_attn.q_proj.lora_A.default")
    assert isinstance(q_a, LowMemLinear) and isinstance(q_a.norm, MemorySharingNorm) and q_a.dropout == 0.05
    detail = next(e.detail for e in report.entries if e.name == base + "self_attn.q_proj.lora_dropout.default")
    assert detail == "folded into lora_A.default (p=0.05): it saves its input and a seed, not a dropped copy"


@pytest.mark.parametrize("family", ["bert", "gpt2", "t5"])
def test_hidden_dropout_costs_at_most_three_percent_over_none(family):
    figures = {}
    for p in (0.0, 0.1):
        model, example = zoo.hidden_dropout(family, p)
        report = apply_lowmem(model, example_input=example)
        figures[p] = report.activation_bytes_before, report.activation_bytes_after
        if p:
            seeded = [m for m in model.modules() if isinstance(m, SeededDropout)]
            assert seeded and not any(type(m) is nn.Dropout and m.p > 0 for m in model.modules())
    assert figures[0.1][1] <= 1.03 * figures[0.0][1], figures
    assert figures[0.1][0] > 1.01 * figures[0.0][0]  # stock pays for its masks (a byte an element, as on a GPU)


def test_bert_embedding_dropout_keeps_its_norm_shared():
    model, example = zoo.hidden_dropout("bert", 0.1)
    report = apply_lowmem(model, example_input=example)
    assert report.status("bert.embeddings.LayerNorm") == "converted"
    query = model.bert.encoder.layer[0].attention.self.query
    assert query.norm is model.bert.embeddings.LayerNorm
    model.train()
    with SavedTensorMeter(model) as meter:
        model(**example)
    by_module = meter.by_module
    assert by_module.get("bert.encoder.layer.0.attention.self.query", 0) < 2 * 16 * 64 * 4  # no copy: the norm's z


def test_dropouts_are_reported_and_can_be_left_stock():
    model, example = zoo.hidden_dropout("bert", 0.1)
    report = apply_lowmem(copy.deepcopy(model), example_input=example)
    entry = next(e for e in report.entries if e.name == "bert.encoder.layer.0.output.dropout")
    assert (entry.kind, entry.status, entry.detail) == (
        "dropout", "converted", "seeded (p=0.1): saves its seed, not its mask"
    )  # fmt: skip
    assert "dropouts converted" in report.summary()
    kept = apply_lowmem(model, example_input=example, dropout=False)
    assert not [e for e in kept.entries if e.kind == "dropout"]
    assert not any(isinstance(m, SeededDropout) for m in model.modules())


def test_functional_dropouts_are_reported():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(F.dropout(x, 0.1, self.training))

    model = nn.Sequential(Functional())
    report = apply_lowmem(model, example_input=torch.randn(2, 8))
    (entry,) = [e for e in report.entries if e.kind == "functional"]
    assert (entry.name, entry.was) == ("0", "F.dropout")


class LoraLlama(pl.LightningModule):
    """A LightningModule as users write it: a peft LLaMA with ``lora_dropout=0.05``, no example input."""

    def __init__(self) -> None:
        super().__init__()
        self.model = lora_llama(0.05)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def token_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(0, 128, (8, 16))), batch_size=2)


DDP_SCRIPT = """
import json, torch
import lightning.pytorch as pl
import torch.nn.functional as F
from test_dropout import LoraLlama, token_loader
from lightning_lowmem.lightning import LowMemBP
from lightning_lowmem.ops.dropout import seeded_dropout

pl.seed_everything({seed} + {per_rank} * int(__import__("os").environ.get("LOCAL_RANK", 0)))
callback = LowMemBP()
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=2, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     callbacks=[callback], default_root_dir={root!r})
module = LoraLlama()
trainer.fit(module, token_loader())
ones = torch.ones(4096)
state = torch.get_rng_state()
stock = F.dropout(ones, 0.5) != 0
torch.set_rng_state(state)
ours = seeded_dropout(ones, 0.5) != 0
gathered = [trainer.strategy.all_gather(mask.float()) for mask in (stock, ours)]
if trainer.global_rank == 0:
    json.dump({{"dropouts": sum(e.kind == "dropout" for e in callback.report.converted), "steps": trainer.global_step,
               "stock_ranks_equal": bool(torch.equal(*gathered[0])), "ours_ranks_equal": bool(torch.equal(*gathered[1]))}},
              open({out!r}, "w"))
"""


@pytest.mark.parametrize("per_rank", [0, 1], ids=["one seed", "a seed per rank"])
def test_lowmem_bp_folds_lora_dropouts_and_ddp_ranks_draw_as_stock_does(tmp_path, per_rank):
    """Under DDP each rank draws its seeds from its own generator: the ranks' masks agree exactly when stock
    dropout's would (Lightning seeds every rank alike unless told otherwise)."""
    result = run_ddp_script(tmp_path, DDP_SCRIPT, seed=3, per_rank=per_rank)
    assert result["dropouts"] == 14 and result["steps"] == 2
    assert result["stock_ranks_equal"] == result["ours_ranks_equal"] == (per_rank == 0)
