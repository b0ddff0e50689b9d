"""Gated MLPs: the fused ``act(gate) * up`` op, its kernels, the module, surgery, and the bytes it saves."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem import apply_lowmem, kernels
from lightning_lowmem.functional import gated_activation
from lightning_lowmem.kernels import torch_ops
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import GatedMLP, TimmGluMlp
from lightning_lowmem.ops.gated import exception_bytes, exception_slots, forward_activation

KINDS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
MODES = ("gate_up", "gate")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(0, 4), (1,), (3, 5), (2, 7, 33), (4097,)]
# Per compiled backend: odd tails, both sides of its block (C++: 2048-element tasks; Triton: 1024), many blocks.
SIZES = {
    "cpp": [0, 1, 7, 2047, 2049, 3 * 2048 + 5, 100_003],
    "cuda": [0, 1, 7, 255, 257, 100_003],
    "triton": [0, 1, 7, 1023, 1025, 2 * 1024 + 5],
}


def stock_grads(kind, gate, up, grad, dtype=None):
    """Gradients of the unfused stock computation (in ``dtype``, default the inputs')."""
    g = gate.detach().to(dtype or gate.dtype).requires_grad_()
    u = up.detach().to(dtype or up.dtype).requires_grad_()
    (KINDS[kind](g) * u).backward(grad.to(g.dtype))
    return g.grad, u.grad


def fused_grads(kind, mode, gate, up, grad):
    g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    gated_activation(g, u, kind, mode).backward(grad)
    return g.grad, u.grad


def inputs(shape, dtype, device="cpu"):
    gate = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype=dtype, device=device)
    up = torch.randn(shape, dtype=torch.float64).to(dtype=dtype, device=device)
    grad = torch.randn(shape, dtype=torch.float64).to(dtype=dtype, device=device)
    return gate, up, grad


# -- the op -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_bitwise_stock(kind, mode, dtype):
    for shape in SHAPES:
        gate, up, _ = inputs(shape, dtype)
        out = gated_activation(gate.requires_grad_(), up, kind, mode)
        assert out.dtype == dtype and torch.equal(out, KINDS[kind](gate) * up)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_fp64(kind, mode):
    gate = (torch.randn(3, 17, dtype=torch.float64) * 3).requires_grad_()
    up = torch.randn(3, 17, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda g, u: gated_activation(g, u, kind, mode), (gate, up))


@pytest.fixture(params=["torch", "cpp", "triton"])
def cpu_backend(request, monkeypatch) -> str:
    """The ops run on each backend that runs CPU tensors (Triton in its interpreter)."""
    if request.param == "triton":
        module = kernels._triton_module()
        if isinstance(module, ImportError) or not module.INTERPRETED:
            pytest.skip("Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setenv(kernels.ENV_VAR, request.param)
    return request.param


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradients_as_close_to_exact_as_stock(cpu_backend, kind, mode, dtype):
    """Against fp64 truth, the fused op errs no more than the stock unfused op in ``dtype`` does."""
    gate, up, grad = inputs((8, 1000), dtype)
    truth = stock_grads(kind, gate, up, grad, torch.float64)
    stock = stock_grads(kind, gate, up, grad)
    fused = fused_grads(kind, mode, gate, up, grad)
    for t, s, f in zip(truth, stock, fused):
        assert f.dtype == dtype
        stock_error = (s.double() - t).abs().max().item()
        fused_error = (f.double() - t).abs().max().item()
        assert fused_error <= 2 * stock_error + 1e-6, (fused_error, stock_error)
        assert F.cosine_similarity(f.double().flatten(), t.flatten(), dim=0) > 0.9999


@pytest.mark.parametrize("mode", MODES)
def test_saves_gate_and_up_or_gate_and_output(mode, recorder):
    gate = torch.randn(4, 64, requires_grad=True)
    up = torch.randn(4, 64, requires_grad=True)
    with recorder() as saved:
        out = gated_activation(gate, up, "silu", mode)
    second = out if mode == "gate" else up
    assert [t.untyped_storage().data_ptr() for t in saved.saved[:2]] == [
        gate.untyped_storage().data_ptr(),
        second.untyped_storage().data_ptr(),
    ]
    exceptions = [(t.dtype, t.shape) for t in saved.saved[2:]]  # gate mode: where act is 0, up kept (a slot a row)
    assert exceptions == ([(torch.int32, (4, 1)), (torch.float32, (4, 1))] if mode == "gate" else [])


def test_gate_mode_shares_the_output_with_a_trainable_consumer(recorder):
    gate, up = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    down = nn.Linear(64, 8)
    with recorder() as saved:
        down(gated_activation(gate, up, "silu", "gate"))
    activations = saved.storages() - {down.weight.untyped_storage().data_ptr()}
    assert len(activations) == 2 + 2  # gate, the product both the op and the linear saved, and the exceptions
    with SavedTensorMeter() as meter:
        down(gated_activation(gate, up, "silu", "gate"))
    assert meter.total_bytes == 2 * 4 * 64 * 4 + exception_bytes((4, 64), torch.float32) == 2 * 4 * 64 * 4 + 4 * 8


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_the_activation_is_zero_gate_mode_keeps_up(kind, dtype):
    """``gate == 0`` (act = 0, act' = 0.5) with ``up != 0``: ``h`` holds nothing of ``up`` there, so gate mode keeps
    ``up * act'`` at such elements (up to one in 512) and its gradients are stock's (as close as everywhere else:
    stock rounds ``grad * up`` to the dtype first); past that many, the rest take ``up = 0`` (the documented bound),
    and nothing is read back to the host either way."""
    n = 1024  # two slots
    gate = torch.randn(n, dtype=dtype)
    gate[[5, 700]] = 0.0
    gate[[800, 801]] = -200.0  # act underflows to 0 there too (act' ~ 0): they take the slots past the two
    up, grad = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)

    def grads(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = g.clone().requires_grad_(), up.clone().requires_grad_()
        gated_activation(g, u, kind, "gate").backward(grad)
        return g.grad, u.grad

    exact_gate, exact_up = stock_grads(kind, gate, up, grad, torch.float64)
    got_gate, got_up = grads(gate)
    tolerance = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got_up.double(), exact_up, **tolerance)
    torch.testing.assert_close(got_gate.double(), exact_gate, **tolerance)
    assert got_gate[5] != 0 and got_gate[700] != 0
    gate[[3, 900]] = 0.0  # four zeros now: the first two (3 and 5) are kept, 700 and 900 take up = 0
    exact_gate, _ = stock_grads(kind, gate, up, grad, torch.float64)
    got_gate, _ = grads(gate)
    assert got_gate[700] == 0 and got_gate[900] == 0 and exact_gate[700] != 0
    keep = torch.ones(n, dtype=torch.bool)
    keep[[700, 900]] = False
    torch.testing.assert_close(got_gate[keep].double(), exact_gate[keep], **tolerance)


def test_gate_mode_keeps_a_fixed_number_of_exception_slots():
    """An int32 column and ``up`` per slot (8 bytes in fp32, 6 in bf16), one slot per row's 512 elements (at least one
    a row): at LLaMA-2-7B's width 11,008, 22 a row, 0.012 bytes an element in bf16."""
    gate, up = (torch.randn(4, 512, 64, requires_grad=True) for _ in range(2))
    assert exception_slots((3, 11008)) == 3 * 22
    with SavedTensorMeter() as meter:
        gated_activation(gate, up, "silu", "gate")
    assert (
        meter.total_bytes
        == 2 * gate.numel() * 4 + exception_bytes(gate.shape, torch.float32)
        == 2 * 512 * 256 * 4 + 8 * 4 * 512
    )
    assert exception_bytes((3, 11008), torch.bfloat16) == 6 * 3 * 22


def test_mixed_dtypes_promote_and_no_grad_saves_nothing(recorder):
    gate = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(3, 5, requires_grad=True)
    out = gated_activation(gate, up)
    assert out.dtype == torch.float32 and torch.equal(out, F.silu(gate.float()) * up)
    out.sum().backward()
    assert gate.grad.dtype == torch.bfloat16 and up.grad.dtype == torch.float32
    with recorder() as saved, torch.no_grad():
        gated_activation(gate, up)
    assert saved.saved == []


def test_non_contiguous_inputs():
    packed = torch.randn(6, 40, requires_grad=True)
    gate, up = packed.chunk(2, dim=-1)
    gated_activation(gate, up, "gelu", "gate").sum().backward()
    expected = packed.detach().clone().requires_grad_()
    g, u = expected.chunk(2, dim=-1)
    (F.gelu(g) * u).sum().backward()
    torch.testing.assert_close(packed.grad, expected.grad)


def test_bad_input_raises():
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="same shape"):
        gated_activation(x, torch.randn(4))
    with pytest.raises(ValueError, match="activation must be"):
        gated_activation(x, x, "relu")
    with pytest.raises(ValueError, match="mode must be"):
        gated_activation(x, x, mode="exact")
    with pytest.raises(TypeError, match="unsupported dtype"):
        gated_activation(torch.ones(3, 4, dtype=torch.int64), x)
    out = gated_activation(x, torch.randn(3, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


# -- compiled kernels -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recover_up", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_backward_matches_reference(kernel_backend, kind, recover_up, dtype):
    tolerance = (
        {"atol": 2e-2, "rtol": 2e-2} if dtype in (torch.float16, torch.bfloat16) else {"atol": 1e-5, "rtol": 1e-5}
    )
    for n in SIZES[kernel_backend.name]:
        gate, up, grad = inputs((n,), dtype, kernel_backend.device)
        act = torch_ops.stock_activation(gate, kind) if recover_up else None
        second = act * up if recover_up else up
        got = kernel_backend.module.gated_backward(grad, gate, second, kind, act)
        expected = torch_ops.gated_backward(grad, gate, second, kind, act)
        for g, e in zip(got, expected):
            assert g.dtype == dtype and g.device == gate.device
            torch.testing.assert_close(g, e, **tolerance)


def zeros_at(gate: torch.Tensor, every: int) -> torch.Tensor:
    """``gate`` with a zero at every ``every``-th element and a run of them in its first row: rows past their slots,
    rows with none, and ``act == 0`` where ``act'`` is not (``gate == 0``)."""
    gate = gate.clone()
    gate.view(-1)[::every] = 0.0
    gate.view(-1)[: min(40, gate.numel())] = 0.0
    return gate


@pytest.mark.parametrize("shape", [(), (5,), (3, 1100), (2, 3, 40), (4, 0), (0, 8), (6, 4097)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_exceptions_match_reference(kernel_backend, shape, dtype):
    """Each row's first ``slots`` zeros of ``act`` (by column, int32, -1 after) and ``up`` at them, bit for bit; ``up``
    a packed half (a row stride of two rows) as timm's fc1 gives it."""
    gate, _, _ = inputs(shape, dtype, kernel_backend.device)
    gate = zeros_at(gate, 97) if gate.numel() else gate
    act = torch_ops.stock_activation(gate, "silu")
    packed = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=gate.device) if shape else None
    ups = [torch.randn_like(act)] + ([packed[..., shape[-1] :]] if shape else [])
    for up in ups:
        for slots in (0, 1, 3, 64):
            got = kernel_backend.module.gated_exceptions(act, up, slots)
            expected = torch_ops.gated_exceptions(act, up, slots)
            assert [(t.dtype, t.shape) for t in got] == [(torch.int32, expected[0].shape), (dtype, expected[1].shape)]
            assert all(torch.equal(g.cpu(), e.cpu()) for g, e in zip(got, expected)), (shape, slots)
    if act.numel() > 40:  # a full row and unused slots both seen
        full, roomy = (torch_ops.gated_exceptions(act, up, slots)[0] for slots in (3, 64))
        assert (full[0] >= 0).all() and (roomy == -1).any()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_backward_with_exceptions_matches_reference(kernel_backend, kind, dtype):
    """Where ``act == 0`` the gate gradient takes ``up`` from the forward's slots (the rest past them: ``up = 0``)."""
    tolerance = (
        {"atol": 2e-2, "rtol": 2e-2} if dtype in (torch.float16, torch.bfloat16) else {"atol": 1e-5, "rtol": 1e-5}
    )
    for shape in [(3, 1100), (2, 3, 40), (5,), (0, 8)]:
        gate, up, grad = inputs(shape, dtype, kernel_backend.device)
        gate = zeros_at(gate, 53) if gate.numel() else gate
        act = torch_ops.stock_activation(gate, kind)
        exceptions = torch_ops.gated_exceptions(act, up, 2)
        got = kernel_backend.module.gated_backward(grad, gate, act * up, kind, act, *exceptions)
        expected = torch_ops.gated_backward(grad, gate, act * up, kind, act, *exceptions)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, **tolerance)
        columns = exceptions[0].long().cpu()
        kept = torch.zeros(columns.shape[0], shape[-1] + 1, dtype=torch.bool)
        kept = kept.scatter_(1, columns.where(columns >= 0, shape[-1]), True)[:, :-1].reshape(shape)
        without = kernel_backend.module.gated_backward(grad, gate, act * up, kind, act)[0]
        changed = (got[0] != without).cpu()  # the slots changed the gate gradient at them only
        assert not (changed & ~kept).any()
        assert changed[kept & (gate == 0).cpu() & (up != 0).cpu() & (grad != 0).cpu()].all()  # grad * up / 2 there


def test_compiled_backward_rejects_bad_arguments(kernel_backend):
    x = torch.randn(8, device=kernel_backend.device)
    for ext in (kernel_backend.module, torch_ops):
        with pytest.raises(ValueError, match="gated_backward: unknown activation kind"):
            ext.gated_backward(x, x, x, "relu", None)
        with pytest.raises(ValueError, match="gated_backward: .*shape"):
            ext.gated_backward(x, torch.randn(9, device=x.device), x, "silu", None)
        with pytest.raises((TypeError, ValueError), match="gated_backward: .*dtype"):
            ext.gated_backward(x, x.double(), x, "silu", None)
        with pytest.raises((TypeError, ValueError), match="gated_backward: .*dtype"):
            ext.gated_backward(x, x, x, "silu", x.half())
        columns, up_at = torch_ops.gated_exceptions(x.cpu(), x.cpu(), 1)
        columns, up_at = columns.to(x.device), up_at.to(x.device)
        with pytest.raises(ValueError, match="gated_backward: columns and up_at come together"):
            ext.gated_backward(x, x, x, "silu", None, columns, up_at)
        with pytest.raises(ValueError, match="gated_backward: expected int32 columns"):
            ext.gated_backward(x, x, x, "silu", x, columns.long(), up_at)
        with pytest.raises(ValueError, match="gated_exceptions: act and up must be"):
            ext.gated_exceptions(x, x[:4], 1)
        with pytest.raises(ValueError, match="gated_exceptions: slots must be >= 0"):
            ext.gated_exceptions(x, x, -1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "packed, gate first", "packed, gate last"])
def test_gate_mode_divides_by_the_forwards_own_activation(cpu_backend, kind, dtype, layout):
    """The backward's act(gate) has the forward's bits on every backend, also for a strided gate (timm's
    packed fc1, where ATen's CPU kernels round differently than on a contiguous copy): up = h / act is then
    exact to h's rounding, and the up gradient, grad * act, equals the stock one bit for bit."""
    fc1 = (torch.randn(6, 7, 2 * 333, dtype=torch.float64) * 3).to(dtype)
    gate, up = fc1.chunk(2, dim=-1)
    if layout == "contiguous":
        gate, up = gate.contiguous(), up.contiguous()
    elif layout == "packed, gate last":
        up, gate = gate, up
    act = torch_ops.stock_activation(gate, kind)
    assert torch.equal(forward_activation(gate.contiguous(), (gate.size(), gate.stride()), kind), act)
    grad = torch.randn(gate.shape, dtype=torch.float64).to(dtype)
    _, stock_up_grad = stock_grads(kind, gate, up, grad)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    if layout != "contiguous":  # the op sees the strided halves of one tensor, as in timm
        leaf = fc1.clone().requires_grad_()
        halves = leaf.chunk(2, dim=-1)
        g, u = halves if layout == "packed, gate first" else halves[::-1]
    out = gated_activation(g, u, kind, "gate")
    assert torch.equal(out, act * up)
    (up_grad,) = torch.autograd.grad(out, u, grad)
    assert torch.equal(up_grad, stock_up_grad)


# -- the module and its automatic mode ---------------------------------------------------------
def lora(model: nn.Module, targets: list[str], dropout: float = 0.0) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets))


class Wrapper(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def test_auto_mode_follows_the_down_projection():
    mlp = GatedMLP(16, 40)
    assert mlp.resolved_mode() == "gate"  # down_proj trains and saves the product
    mlp.down_proj.weight.requires_grad_(False)
    assert mlp.resolved_mode() == "gate_up"
    with_lora = lora(Wrapper(GatedMLP(16, 40)), ["gate_proj", "up_proj", "down_proj"]).base_model.model.mlp
    assert with_lora.resolved_mode() == "gate"
    for name, p in with_lora.named_parameters():
        if "down_proj.lora_A" in name:
            p.requires_grad_(False)  # LoRA-FA: lora_A frozen, so nothing saves the product
    assert with_lora.resolved_mode() == "gate_up"
    dropped = lora(Wrapper(GatedMLP(16, 40)), ["down_proj"], dropout=0.1).base_model.model.mlp
    assert dropped.resolved_mode() == "gate_up"  # lora_A reads a dropped-out copy


def test_module_matches_the_stock_llama_mlp_and_loads_its_checkpoint():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    stock = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=4))
    fused = GatedMLP(16, 40)
    fused.load_state_dict(stock.state_dict())
    assert fused.state_dict().keys() == stock.state_dict().keys()
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(fused(x), stock(x), rtol=0, atol=0)
    fused(x).square().sum().backward()
    stock(x).square().sum().backward()
    for (name, a), b in zip(fused.named_parameters(), stock.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def llama_mlp_with_lora(hidden: int, intermediate: int) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=4))
    return lora(Wrapper(mlp), ["gate_proj", "up_proj", "down_proj"])


def bytes_per_token(model: nn.Module, hidden: int, x_dtype: torch.dtype) -> float:
    """Marginal saved bytes per token: the slope between two sequence lengths (constants drop out)."""
    totals = []
    for tokens in (16, 48):
        x = torch.randn(1, tokens, hidden, dtype=x_dtype, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensorMeter(model) as meter:
            model(x)
        totals.append(meter.total_bytes)
    return (totals[1] - totals[0]) / 32


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_llama_mlp_with_lora_saves_the_formula(x_dtype):
    """bf16 autocast, LoRA r=4 on gate, up and down: per token the gate (2I) and the product (2I,
    shared with down's lora_A), one bf16 copy of x (2d, shared by the gate and up adapters) and
    the three rank-r adapter activations (3 * 2r); 4.7 bytes per intermediate element at the
    7B ratio I/d = 2.69, against about 8.8 stock."""
    hidden, intermediate, rank = 32, 86, 4
    stock = llama_mlp_with_lora(hidden, intermediate)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, norm=False)
    assert report.status("base_model.model.mlp") == "converted"
    exceptions = (
        exception_bytes((48, intermediate), torch.bfloat16) - exception_bytes((16, intermediate), torch.bfloat16)
    ) / 32
    assert bytes_per_token(model, hidden, x_dtype) == 4 * intermediate + 2 * hidden + 3 * 2 * rank + exceptions
    assert bytes_per_token(stock, hidden, x_dtype) >= 8 * intermediate


# -- surgery on timm's gated MLPs -------------------------------------------------------------
def timm_mlp(layer_name: str) -> nn.Module:
    pytest.importorskip("timm")
    from timm.layers import GluMlp, LayerNorm, SwiGLU, SwiGLUPacked

    return {
        "SwiGLU": lambda: SwiGLU(32, 64),
        "SwiGLUPacked": lambda: SwiGLUPacked(32, 128),
        "GluMlp-gelu": lambda: GluMlp(32, 128, act_layer=nn.GELU),  # gate in the second half
        "SwiGLU-norm": lambda: SwiGLU(32, 64, norm_layer=LayerNorm),  # EVA-02 style: a norm reads the product
        "GluMlp": lambda: GluMlp(32, 128),  # timm's default GLU gate: a sigmoid
    }[layer_name]()


def grads_of(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.train()
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layer_name", ["SwiGLU", "SwiGLUPacked", "GluMlp-gelu", "SwiGLU-norm"])
def test_timm_gated_mlps_convert_exactly(layer_name):
    stock, x = Wrapper(timm_mlp(layer_name)), torch.randn(2, 5, 32)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, activation=False, norm=False, linear=False, example_input=x)
    assert isinstance(model.mlp, TimmGluMlp) and report.status("mlp") == "converted"
    assert model.mlp.resolved_mode() == ("gate_up" if layer_name == "SwiGLU-norm" else "gate")
    assert model.state_dict().keys() == stock.state_dict().keys()
    stock.eval(), model.eval()
    torch.testing.assert_close(model(x), stock(x), rtol=0, atol=0)
    expected, got = grads_of(stock, x), grads_of(model, x)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_timm_vit_with_geglu_converts_fully():
    timm = pytest.importorskip("timm")
    from timm.layers import SwiGLU

    stock = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=32,
        num_heads=2,
        mlp_layer=SwiGLU,
        num_classes=5,
    )  # fmt: skip  (the ViT block passes its GELU: a GeGLU)
    x = torch.randn(2, 3, 32, 32)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input=x)
    assert all(report.status(f"blocks.{i}.mlp") == "converted" for i in range(2))
    assert "GeGLU" in next(e.detail for e in report.entries if e.name == "blocks.0.mlp")
    assert report.reduction > 0.3
    assert apply_lowmem(model, example_input=x).status("blocks.0.mlp") == "already converted"
    stock.eval(), model.eval()
    torch.testing.assert_close(model(x), stock(x), rtol=1e-4, atol=1e-5)


def test_unsupported_gated_mlps_are_left_alone_with_a_reason():
    stock = Wrapper(timm_mlp("GluMlp"))
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input=torch.randn(2, 5, 32))
    assert report.status("mlp") == "left alone"
    assert "computes none of GELU" in next(e.detail for e in report.entries if e.name == "mlp")
    assert type(model.mlp) is type(stock.mlp)


def test_gated_false_leaves_the_mlp_and_converts_its_activation():
    model = Wrapper(timm_mlp("SwiGLU"))
    report = apply_lowmem(model, gated=False, example_input=torch.randn(2, 5, 32))
    assert report.status("mlp.act") == "converted"
    assert not any(isinstance(m, TimmGluMlp) for m in model.modules())


@pytest.mark.parametrize(
    ("family", "config_name", "activation"),
    [("mistral", "MistralConfig", "silu"), ("qwen2", "Qwen2Config", "silu"), ("gemma", "GemmaConfig", "gelu_tanh")],
)
def test_hugging_face_llama_family_mlps_convert(family, config_name, activation):
    import importlib

    import transformers

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    mlp_class = next(getattr(modeling, n) for n in dir(modeling) if n.lower() == f"{family}mlp")
    config = getattr(transformers, config_name)(
        hidden_size=32, intermediate_size=80, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        hidden_act="gelu_pytorch_tanh" if activation == "gelu_tanh" else "silu",
    )  # fmt: skip
    stock, x = Wrapper(mlp_class(config)), torch.randn(2, 5, 32)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input=x)
    assert report.status("mlp") == "converted" and model.mlp.activation == activation
    model.eval(), stock.eval()
    torch.testing.assert_close(model(x), stock(x), rtol=0, atol=0)


def test_packed_glu_saves_a_copy_of_the_gate_not_both_halves():
    """fp32 full fine-tuning of timm's SwiGLUPacked, per token: stock saves x (4d), fc1's whole
    output behind the gate and up views (8I), act(gate) (4I) and the product fc2 reads (4I);
    fused: x, a contiguous copy of the gate (4I) and the shared product (4I)."""
    hidden, intermediate = 32, 64
    stock = Wrapper(timm_mlp("SwiGLUPacked"))
    model = copy.deepcopy(stock)
    apply_lowmem(model, linear=False)

    def per_token(m: nn.Module) -> float:
        totals = []
        for tokens in (8, 24):
            with SavedTensorMeter(m) as meter:
                m(torch.randn(1, tokens, hidden, requires_grad=True))
            totals.append(meter.total_bytes)
        return (totals[1] - totals[0]) / 16

    assert per_token(stock) == 4 * hidden + 16 * intermediate
    exceptions = (
        exception_bytes((24, intermediate), torch.float32) - exception_bytes((8, intermediate), torch.float32)
    ) / 16
    assert per_token(model) == 4 * hidden + 8 * intermediate + exceptions


def test_plain_timm_mlp_is_no_gated_candidate():
    """timm's ``Mlp`` shares the packed GLU's child names; it must not even appear as a gated MLP."""
    pytest.importorskip("timm")
    from timm.layers import Mlp

    model = Wrapper(Mlp(32, 64))
    report = apply_lowmem(model, example_input=torch.randn(2, 5, 32))
    assert report.status("mlp.act") == "converted"
    with pytest.raises(KeyError):
        report.status("mlp")
