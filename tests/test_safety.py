"""No silent wrong answer, no half-converted model, no crash: the set-ups and mistakes users hit.

Elsewhere: readers the example call never exercised (hidden states, kwarg branches, hooks) in
test_surgery.py; the kernel cache (damaged, read-only, killed builds) in test_kernels.py;
memcheck's exit codes in test_memcheck.py; several LowMemBP and validate-only runs in
test_callback_lowmem_bp.py.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from test_surgery import Custom, logits, plain_bert, tiny_llama
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import zoo
from lightning_lowmem import LowMemBP, apply_lowmem
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import LowMemLinear, MemorySharingNorm
from lightning_lowmem.surgery import ExampleInputError
from lightning_lowmem.surgery import apply as apply_module
from lightning_lowmem.surgery import verify as verify_module

timm = pytest.importorskip("timm")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


# -- half-precision models ------------------------------------------------------------------
def half_model(family: str) -> tuple[nn.Module, torch.Tensor]:
    if family == "vit":
        return zoo.vit(num_classes=4), zoo.images()
    if family == "bert":
        return plain_bert(mlm=True), zoo.tokens()
    config = transformers.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(config), zoo.tokens()


def outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return logits(model.eval()(x)).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["vit", "bert", "gpt_neox"])
def test_half_precision_models_convert_norms_included(family, dtype):
    """``model.to(bfloat16)``: the output check allows the rounding of the dtype computed in, and the
    converted model is as close to an fp32 run of the same weights as the stock half model is."""
    torch.manual_seed(0)
    full, x = half_model(family)
    stock = copy.deepcopy(full).to(dtype)
    model = copy.deepcopy(stock)
    x_half = x.to(dtype) if x.is_floating_point() else x
    report = apply_lowmem(model, example_input=x_half)
    assert sum(e.kind == "norm" for e in report.converted) >= 4 and report.reduction > 0.2
    reference = outputs(full, x)
    stock_error = (outputs(stock, x_half) - reference).abs().max()
    our_error = (outputs(model, x_half) - reference).abs().max()
    assert our_error <= 2 * stock_error, (our_error, stock_error)


# -- peft LoRA on a half-precision base ------------------------------------------------------
def bf16_llama_lora(adapters_fp32: bool) -> nn.Module:
    """peft's default keeps the adapters in fp32 on a bf16 base model (``autocast_adapter_dtype=True``)."""
    torch.manual_seed(0)
    base = tiny_llama(lora=False).to(torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    model = peft.get_peft_model(base, config, autocast_adapter_dtype=adapters_fp32)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    return model


def step(model: nn.Module, x: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, dict, int]:
    """Output, LoRA gradients and saved bytes of one training step."""
    model.train().zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter(model) as meter:
        out = logits(model(x)).float()
    (out * torch.linspace(-1, 1, out.shape[-1])).square().mean().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads, meter.total_bytes


@pytest.mark.parametrize("autocast", [False, True], ids=["no autocast", "bf16 autocast"])
@pytest.mark.parametrize("adapters_fp32", [True, False], ids=["fp32 adapters", "bf16 adapters"])
def test_lora_on_a_bf16_base_works_as_stock_and_shares_the_norm_output(adapters_fp32, autocast):
    stock, x = bf16_llama_lora(adapters_fp32), zoo.tokens()
    model = copy.deepcopy(stock)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        report = apply_lowmem(model, example_input=x)
    assert sum(e.kind == "norm" for e in report.converted) == 5  # two per layer and the final one
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.lora_A.default, LowMemLinear) and q_proj.lora_A.default.norm is not None
    ours, our_grads, our_bytes = step(model, x, autocast)
    theirs, their_grads, their_bytes = step(stock, x, autocast)
    torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-2 * theirs.abs().max().item())
    for name, grad in their_grads.items():  # both round in bf16, in different orders
        assert torch.nn.functional.cosine_similarity(our_grads[name].flatten(), grad.flatten(), dim=0) > 0.999, name
    assert our_bytes <= 0.7 * their_bytes, (our_bytes, their_bytes)


class LoraLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = bf16_llama_lora(adapters_fp32=True)

    def training_step(self, batch, batch_idx):
        return logits(self.model(batch[0])).float().square().mean()

    def configure_optimizers(self):  # plain SGD: AdamW's eps underflows in fp16 weights, stock NaNs then too
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def losses_of_a_run(tmp_path, precision: str, callbacks: list) -> list[float]:
    losses = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, precision=precision, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[*callbacks, Record()],
    )  # fmt: skip
    trainer.fit(LoraLlama(), DataLoader(TensorDataset(torch.randint(0, 128, (12, 16))), batch_size=4))
    return losses


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_lora_trains_under_lightnings_true_half_precision(tmp_path, precision):
    callback = LowMemBP()
    torch.manual_seed(0)
    ours = losses_of_a_run(tmp_path, precision, [callback])
    torch.manual_seed(0)
    theirs = losses_of_a_run(tmp_path, precision, [])
    assert sum(e.kind == "norm" for e in callback.report.converted) == 5
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-2, atol=1e-4)


# -- all or nothing --------------------------------------------------------------------------
def test_an_example_the_model_cannot_run_raises_its_own_error_and_changes_nothing():
    model = Custom()
    structure = repr(model)
    with pytest.raises(ExampleInputError, match="cannot run the example input.*nothing was changed") as info:
        apply_lowmem(model, example_input=torch.randn(2, 4, 31))
    assert "expected input with shape [*, 32]" in str(info.value.__cause__)  # the model's own error, attached
    assert repr(model) == structure


def modules_of(model: nn.Module) -> dict[str, int]:
    return {name: id(module) for name, module in model.named_modules()}


@pytest.mark.parametrize(
    ("failing", "verify"),
    [("replace", True), ("replace", False), ("verify", True), ("measure", True), ("measure", False)],
)
def test_any_failure_after_the_first_change_restores_every_module(monkeypatch, failing, verify):
    model = peft.get_peft_model(Custom(), peft.LoraConfig(r=4, target_modules=["up", "proj"]))
    before, casts = modules_of(model), [m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "lora_A")]
    calls = []

    def fail_on_call(real, n: int):
        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise RuntimeError("injected failure")
            return real(*args, **kwargs)

        return wrapper

    if failing == "replace":  # the second replacement, after the first changed the model
        monkeypatch.setattr(apply_module.Surgery, "replace", fail_on_call(apply_module.Surgery.replace, 2))
    elif failing == "verify":  # the converted model's outputs (the stock ones come from the probe)
        monkeypatch.setattr(verify_module, "eval_outputs", fail_on_call(verify_module.eval_outputs, 1))
    else:  # the measurement after conversion
        monkeypatch.setattr(apply_module, "measure_saved", fail_on_call(apply_module.measure_saved, 2))
    with pytest.raises(RuntimeError, match="injected failure"):
        apply_lowmem(model, example_input=torch.randn(2, 4, 32), verify=verify)
    assert modules_of(model) == before
    assert [m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "lora_A")] == casts


def test_a_norm_the_ops_cannot_take_is_left_alone_with_its_reason():
    model = nn.Sequential(nn.LayerNorm(8, eps=0.0), nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    report = apply_lowmem(model, example_input=x, verify=False)
    assert report.status("0") == "left alone" and "eps=0.0" in next(e.detail for e in report.entries if e.name == "0")
    assert report.status("3") == "converted" and isinstance(model[3], MemorySharingNorm)
    model(x).sum().backward()  # the model keeps working


@pytest.mark.parametrize("root", ["GELU", "LayerNorm", "LlamaMLP"])
def test_a_model_that_is_itself_a_candidate_is_reported_left_alone(root):
    """Modules are replaced in their parent: the root has none, so it must not be reported converted."""
    if root == "LlamaMLP":
        from transformers.models.llama.modeling_llama import LlamaMLP

        model = LlamaMLP(transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2))
    else:
        model = getattr(nn, root)(8) if root == "LayerNorm" else nn.GELU()
    kind = type(model)
    report = apply_lowmem(model, example_input=torch.randn(3, 8))
    assert report.status("") == "left alone" and "the model itself" in next(e.detail for e in report.entries)
    assert type(model) is kind
    # inside a gated MLP left alone, its activation module still converts like any other
    assert [e.name for e in report.converted] == (["act_fn"] if root == "LlamaMLP" else [])


# -- compiled models -------------------------------------------------------------------------
def test_a_compiled_model_is_converted_through_the_module_it_compiles():
    model, x = Custom(), torch.randn(2, 4, 32)
    report = apply_lowmem(torch.compile(model, backend="eager"), example_input=x)
    assert report.status("norm_a") == "converted" and isinstance(model.norm_a, MemorySharingNorm)
    with pytest.raises(ValueError, match="pass example_input, or call apply_lowmem before torch.compile"):
        apply_lowmem(torch.compile(Custom(), backend="eager"))


def test_the_training_check_touches_no_gradient_and_fires_no_gradient_hook():
    """The verify stage's step takes its gradients with ``autograd.grad``: ``.grad`` stays as it was, and hooks on a
    parameter's accumulated gradient (DeepSpeed's reductions, an optimizer in backward) never fire."""
    model = peft.get_peft_model(Custom(), peft.LoraConfig(r=4, target_modules=["up", "proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    kept = torch.ones_like(trained[0])
    trained[0].grad = kept
    fired = []
    for p in trained:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    step = verify_module.training_step(model, torch.randn(2, 4, 32))
    assert step.norms and set(step.norms) == set(step.projections) | set(step.kept)
    assert step.outputs and step.loss is None
    assert trained[0].grad is kept and all(p.grad is None for p in trained[1:]) and not fired


@pytest.mark.parametrize("when", ["example_input", "first forward"])
def test_a_conversion_leaves_the_random_number_generator_as_it_found_it(when):
    """The probing steps draw (dropout masks, seeds): the training after a conversion draws what it would have drawn
    without one (found on TRL's GRPO: its next completions were sampled from a moved generator)."""
    dropout = 0.1 if when == "example_input" else 0.0  # converted, a dropout draws its masks otherwise than stock's
    lora = peft.LoraConfig(r=4, lora_dropout=dropout, target_modules=["q_proj", "up_proj"])
    model = peft.get_peft_model(tiny_llama(lora=False), lora)
    ids = torch.randint(0, zoo.VOCAB, (2, 8))
    torch.manual_seed(1)
    expected = torch.rand(3) if when == "example_input" else None
    torch.manual_seed(1)
    if when == "example_input":
        report = apply_lowmem(model, example_input={"input_ids": ids, "labels": ids})
        assert torch.equal(torch.rand(3), expected)
    else:  # converted inside the first training forward: after it, the generator is where stock's forward leaves it
        stock = copy.deepcopy(model).train()
        report = apply_lowmem(model)
        model.train()(input_ids=ids, labels=ids)
        after = torch.rand(3)
        torch.manual_seed(1)
        stock(input_ids=ids, labels=ids)
        assert torch.equal(after, torch.rand(3))
    assert report.converted


class CachedPositions(nn.Module):
    """A block that makes a buffer for its input's length in its forward, replacing the one it had (as timm's ConViT
    makes ``rel_indices``), and normalizes with a BatchNorm (whose statistics its forward updates in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.bn = nn.LayerNorm(8), nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("positions", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.positions.shape[0] != x.shape[1]:
            self.positions = torch.arange(x.shape[1], dtype=x.dtype)
        return self.bn(self.fc(self.norm(x + self.positions[:, None])).transpose(1, 2))


def test_a_conversion_leaves_every_buffer_as_it_found_it():
    """The probing forwards' buffers are restored as the objects they were, values included: a buffer the forward
    replaced is not overwritten by its old values broadcast (ConViT's outputs differed after a conversion: found by
    the breadth sweep), and BatchNorm's statistics are not moved."""
    torch.manual_seed(0)
    model, x = CachedPositions(), torch.randn(4, 6, 8)
    stock = copy.deepcopy(model)
    positions, mean = model.positions, model.bn.running_mean.clone()
    report = apply_lowmem(model, example_input=x)
    assert report.status("norm") == "converted"
    assert model.positions is positions and torch.equal(model.bn.running_mean, mean)
    torch.testing.assert_close(model.eval()(x), stock.eval()(x))


def test_a_converted_model_is_freed_with_its_tensors():
    """The probing forwards make no reference cycle Python's collector cannot see (a saved-tensor hook returning a
    saved output itself ties it to its graph node): a converted model, once dropped, frees its parameters and the
    example (the breadth sweep's process grew by each model's size, to the machine's 24 GiB)."""
    import gc
    import weakref

    model, x = zoo.vit(), zoo.images()
    weight, example = weakref.ref(model.blocks[0].mlp.fc1.weight), weakref.ref(x)
    assert apply_lowmem(model, example_input=x).converted
    del model, x
    gc.collect()
    assert weight() is None and example() is None


def test_a_conversion_leaves_the_generators_of_the_models_gpus_alone():
    """The GPU side of the generators a conversion restores: every CUDA device the model's parameters are on."""
    from types import SimpleNamespace

    class OnTwoGpus(nn.Module):
        def parameters(self, recurse: bool = True):
            devices = ("cuda:1", "cpu", "cuda:0", "cuda:1")
            return iter([SimpleNamespace(device=torch.device(device)) for device in devices])

    assert apply_module.gpus_of(OnTwoGpus()) == [0, 1]
    assert apply_module.gpus_of(tiny_llama()) == []


@pytest.mark.parametrize("figures", ["kept whole", "projected"])
def test_the_training_check_turns_every_dropout_off_and_compares_to_rounding(monkeypatch, figures):
    """Stock dropouts (modules, ``F.dropout``, SDPA's ``dropout_p``) and the seeded ones are the identity in the check's
    step, so a model with dropout everywhere compares with its converted self exactly; a gradient changed by 1% is
    found, kept whole (a small one) or by its projections (a large one)."""
    if figures == "projected":
        monkeypatch.setattr(verify_module, "_KEPT", 0)
    stock, x = zoo.hidden_dropout("bert", 0.3)
    first = verify_module.training_step(stock, x)
    assert verify_module.compare(first, verify_module.training_step(stock, x), 1e-4) is None
    converted = copy.deepcopy(stock)
    report = apply_lowmem(converted, example_input=x)
    assert any(e.kind == "dropout" and e.status == "converted" for e in report.entries)
    assert verify_module.compare(first, verify_module.training_step(converted, x), 1e-4) is None
    nudged = verify_module.training_step(converted, x)
    held = nudged.kept if figures == "kept whole" else nudged.projections
    assert set(held) == set(nudged.norms)
    name = next(iter(held))
    held[name] = held[name] * 1.01 + 0.01 * nudged.norms[name]
    assert "gradient of" in verify_module.compare(first, nudged, 1e-4)


def test_a_wrong_backward_is_rolled_back_alone_with_its_figures(monkeypatch):
    """A family whose forward is stock's but whose backward is not (a gated MLP's, made to drop its up projection's
    gradient here) passes the eval check; the training check finds it, rolls it back alone and says why."""
    from lightning_lowmem.nn import gated

    real = gated.GatedMLPBase.forward

    def wrong(self, x):
        y = real(self, x)
        return y.detach() + (y - y.detach()) * 0.5  # stock values, half the gradient

    monkeypatch.setattr(gated.GatedMLPBase, "forward", wrong)
    model = tiny_llama()
    ids = torch.randint(3, 100, (2, 8))
    report = apply_lowmem(model, example_input={"input_ids": ids, "labels": ids})
    entries = [e for e in report.entries if e.kind == "gated MLP"]
    assert entries and all(e.status == "left alone" and "off stock's" in e.detail for e in entries), entries
    assert any(e.kind == "norm" and e.status == "converted" for e in report.entries)
