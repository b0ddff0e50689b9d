"""The fused linear + cross-entropy: stock's loss and gradients without the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem import kernels
from lightning_lowmem.functional import linear_cross_entropy
from lightning_lowmem.kernels import torch_ops
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.ops import cross_entropy


def stock_loss(hidden, weight, target, bias=None, softcap=None, **options):
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1), **options).view(
        target.shape if options.get("reduction") == "none" else ()
    )


def inputs(rows: int, features: int, vocab: int, dtype: torch.dtype, ignored: float = 0.2, bias: bool = False):
    hidden = (torch.randn(rows, features) / 2).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, features) / features**0.5).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,))
    target[torch.rand(rows) < ignored] = -100
    return hidden, weight, target, (torch.randn(vocab).to(dtype).requires_grad_() if bias else None)


def grads(fn, tensors, upstream=None):
    for t in tensors:
        t.grad = None
    loss = fn()
    loss.backward(upstream)
    return loss.detach(), [t.grad.clone() for t in tensors]


def errors(got, want, reference):
    """The largest error of ``got`` and of ``want`` against the fp64 ``reference``, each relative to the
    reference's magnitude."""

    def error(tensors):
        return max(
            (t.double() - r).abs().max().item() / max(r.abs().max().item(), 1.0) for t, r in zip(tensors, reference)
        )

    return error(got), error(want)


CASES = [
    pytest.param({"reduction": "mean"}, {}, id="mean"),
    pytest.param({"reduction": "sum"}, {}, id="sum"),
    pytest.param({"reduction": "none"}, {}, id="none"),
    pytest.param({"reduction": "mean", "label_smoothing": 0.1}, {}, id="label-smoothing"),
    pytest.param({"reduction": "mean"}, {"softcap": 30.0}, id="softcap"),
    pytest.param({"reduction": "none", "label_smoothing": 0.2}, {"softcap": 5.0}, id="none-smoothing-softcap"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("options", "head"), CASES)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_loss_and_gradients_are_no_worse_than_stocks_against_float64(dtype, options, head, bias, monkeypatch):
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda *_: 9)  # several chunks of 9 rows, a short last one
    hidden, weight, target, b = inputs(40, 24, 97, dtype, bias=bias)
    tensors = [t for t in (hidden, weight, b) if t is not None]
    upstream = torch.randn(40) if options["reduction"] == "none" else None
    softcap = head.get("softcap")
    ours = grads(lambda: linear_cross_entropy(hidden, weight, target, b, softcap=softcap, **options), tensors, upstream)
    stock = grads(lambda: stock_loss(hidden, weight, target, b, softcap, **options), tensors, upstream)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    reference = grads(lambda: stock_loss(*exact[:2], target, exact[2] if bias else None, softcap, **options), exact,
                      None if upstream is None else upstream.double())  # fmt: skip
    ours_error, stock_error = errors([ours[0], *ours[1]], [stock[0], *stock[1]], [reference[0], *reference[1]])
    slack = 1e-6 if dtype == torch.float32 else 1e-3  # a few ulps
    assert ours_error <= 2 * stock_error + slack, (ours_error, stock_error)


def test_tied_weights_get_both_gradients():
    """One Parameter read as the input embedding and as the head: its gradient sums both."""
    _, weight, target, _ = inputs(16, 8, 33, torch.float32)
    tokens = torch.randint(0, 33, (16,))
    results = [
        grads(lambda fn=fn: fn(torch.tanh(F.embedding(tokens, weight)), weight, target), [weight])[1][0]
        for fn in (linear_cross_entropy, stock_loss)
    ]
    torch.testing.assert_close(*results)


def test_reduction_none_is_right_for_any_upstream_gradient_with_and_without_a_trainable_weight():
    hidden, weight, target, _ = inputs(30, 16, 50, torch.float32)
    upstream = torch.randn(30)
    for trainable in (True, False):
        weight.requires_grad_(trainable)
        tensors = [hidden, weight] if trainable else [hidden]
        ours = grads(lambda: linear_cross_entropy(hidden, weight, target, reduction="none"), tensors, upstream)
        stock = grads(lambda: stock_loss(hidden, weight, target, reduction="none"), tensors, upstream)
        torch.testing.assert_close(ours[0], stock[0])
        for got, want in zip(ours[1], stock[1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("base", ["frozen", "trained"])
def test_a_lora_term_gets_stocks_loss_and_gradients(reduction, base, monkeypatch):
    """``lora=(a, b)``: the logits of a LoRA-adapted head, ``hidden @ weight.T + a @ b.T``, with ``a``, ``b`` and
    ``hidden`` trained; over several chunks, for any upstream gradient."""
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda *_: 7)
    hidden, weight, target, bias = inputs(30, 16, 61, torch.float32, bias=True)
    weight.requires_grad_(base == "trained")
    a, b = torch.randn(30, 4, requires_grad=True), torch.randn(61, 4, requires_grad=True)
    tensors = [t for t in (hidden, weight, bias, a, b) if t.requires_grad]
    upstream = torch.randn(30) if reduction == "none" else None

    def stock():
        logits = (F.linear(hidden, weight, bias) + F.linear(a, b)).float()
        return F.cross_entropy(logits, target, reduction=reduction)

    def ours():
        return linear_cross_entropy(hidden, weight, target, bias, reduction=reduction, lora=(a, b))

    got, want = grads(ours, tensors, upstream), grads(stock, tensors, upstream)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="lora .* does not match"):
        linear_cross_entropy(hidden, weight, target, lora=(a, b.t()))


def test_every_kernel_computes_the_reference_step(kernel_backend):
    logits = torch.randn(13, 301, device=kernel_backend.device) * 4
    target = torch.randint(0, 301, (13,), device=kernel_backend.device)
    target[3] = -100
    for smoothing, cap in ((0.0, 0.0), (0.1, 0.0), (0.0, 7.0), (0.3, 2.0)):
        want = logits.clone()
        want_loss = torch_ops.cross_entropy_grad_(want, target, -100, smoothing, cap)
        got = logits.clone()
        got_loss = kernel_backend.module.cross_entropy_grad_(got, target, -100, smoothing, cap)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(got[3], torch.zeros(301, device=got.device)) and got_loss[3] == 0


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen head", "trained head"])
def test_what_it_saves_per_token_is_a_sliver_of_stocks(trainable):
    """Activation bytes (what grows with the tokens) at a 32,000 vocabulary: <= 2% of stock's."""
    weight = torch.randn(32_000, 256, requires_grad=trainable)

    def saved(fn, rows: int) -> int:
        hidden = torch.randn(rows, 256, requires_grad=True)
        target = torch.randint(0, 32_000, (rows,))
        with SavedTensorMeter() as meter:
            fn(hidden, weight, target)
        return meter.total_bytes

    slope = {fn: saved(fn, 128) - saved(fn, 64) for fn in (linear_cross_entropy, stock_loss)}
    assert slope[linear_cross_entropy] <= 0.02 * slope[stock_loss], slope


def test_bad_input_is_refused_clearly():
    hidden, weight, target, _ = inputs(8, 4, 10, torch.float32)
    with pytest.raises(ValueError, match="reduction must be one of"):
        linear_cross_entropy(hidden, weight, target, reduction="avg")
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(hidden, weight.t(), target)
    with pytest.raises(ValueError, match="target must be int64 of shape \\(8,\\)"):
        linear_cross_entropy(hidden, weight, target.float())
    with pytest.raises(ValueError, match="softcap must be positive"):
        linear_cross_entropy(hidden, weight, target, softcap=0.0)
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        linear_cross_entropy(hidden, weight, torch.full((8,), 10))
    with pytest.raises(RuntimeError, match="linear_cross_entropy does not support double backward"):
        loss = linear_cross_entropy(hidden, weight, target)
        (g,) = torch.autograd.grad(loss, hidden, create_graph=True)
        g.sum().backward()


def test_compiled_fullgraph_matches_eager():
    hidden, weight, target, _ = inputs(24, 16, 70, torch.float32)
    compiled = torch.compile(linear_cross_entropy, fullgraph=True, backend="aot_eager")
    ours = grads(lambda: compiled(hidden, weight, target), [hidden, weight])
    eager = grads(lambda: linear_cross_entropy(hidden, weight, target), [hidden, weight])
    torch.testing.assert_close(ours[0], eager[0])
    for got, want in zip(ours[1], eager[1]):
        torch.testing.assert_close(got, want)


def test_the_cpu_step_runs_in_the_compiled_kernel():
    assert kernels.backend("cpu") == "cpp"
    logits = torch.randn(4, 50)
    assert torch.ops.lowmem.cross_entropy_grad_(logits, torch.tensor([1, 2, -100, 4]), -100, 0.0, 0.0).shape == (4,)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("lowmem::cross_entropy_grad_", "CPU")


@pytest.fixture(params=["torch", "cpp", "triton"])
def backend(request, monkeypatch) -> str:
    """Every backend on CPU tensors (Triton's in its interpreter), forced for the whole op."""
    if request.param != "torch":
        from conftest import _load_backend

        _load_backend(request.param, "cpu")  # skips where it cannot run
    monkeypatch.setenv(kernels.ENV_VAR, request.param)
    return request.param


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("extra", [{}, {"z_loss": 1e-3}, {"class_weight": True}], ids=["", "z-loss", "weights"])
def test_nothing_to_learn_gives_stocks_zero_gradients(backend, reduction, extra, monkeypatch):
    """Every target ignored: stock's loss (NaN for the mean) and zero gradients, not NaN ones; several chunks."""
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda *_: 3)
    hidden, weight, target, bias = inputs(8, 6, 11, torch.float32, ignored=1.0, bias=True)
    options = {**extra, "class_weight": torch.rand(11)} if "class_weight" in extra else extra
    upstream = torch.ones(8) if reduction == "none" else None
    loss, got = grads(lambda: linear_cross_entropy(hidden, weight, target, bias, reduction=reduction, **options),
                      [hidden, weight, bias], upstream)  # fmt: skip
    want = stock_loss(hidden, weight, target, bias, reduction=reduction)
    torch.testing.assert_close(loss, want.detach(), equal_nan=True)
    for g in got:
        assert torch.equal(g, torch.zeros_like(g)), g


def test_zero_class_weights_give_zero_gradients_too():
    hidden, weight, target, _ = inputs(8, 6, 11, torch.float32, ignored=0.0)
    loss, got = grads(lambda: linear_cross_entropy(hidden, weight, target, class_weight=torch.zeros(11)),
                      [hidden, weight])  # fmt: skip
    assert loss.isnan() and all(torch.equal(g, torch.zeros_like(g)) for g in got)


def reference_loss(hidden, weight, target, bias=None, softcap=None, class_weight=None, z_loss=0.0, reduction="mean"):
    """The fp64 truth: F.cross_entropy with ``weight``, plus ``z_loss * logsumexp^2`` averaged over the kept rows."""
    logits = F.linear(hidden, weight, bias).double()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    weights = None if class_weight is None else class_weight.double()
    ce = F.cross_entropy(logits, target, weight=weights, reduction=reduction)
    kept = (target != -100).double()
    z = z_loss * torch.logsumexp(logits, -1).square() * kept
    if reduction == "none":
        return ce + z
    return ce + (z.sum() / kept.sum() if reduction == "mean" else z.sum())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "options",
    [{"z_loss": 1e-2}, {"class_weight": True}, {"class_weight": True, "z_loss": 0.1, "softcap": 4.0}],
    ids=["z-loss", "weights", "weights-z-loss-softcap"],
)
def test_class_weights_and_z_loss_match_the_float64_reference(backend, reduction, options, monkeypatch):
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda *_: 7)  # chunks of 7 rows, a short last one
    hidden, weight, target, bias = inputs(30, 12, 37, torch.float32, bias=True)
    options = {**options, "class_weight": torch.rand(37) + 0.1} if "class_weight" in options else options
    tensors = [hidden, weight, bias]
    upstream = torch.randn(30) if reduction == "none" else None
    ours = grads(lambda: linear_cross_entropy(hidden, weight, target, bias, reduction=reduction, **options),
                 tensors, upstream)  # fmt: skip
    exact = [t.detach().double().requires_grad_() for t in tensors]
    want = grads(lambda: reference_loss(*exact[:2], target, exact[2], reduction=reduction, **options), exact,
                 None if upstream is None else upstream.double())  # fmt: skip
    torch.testing.assert_close(ours[0].double(), want[0], rtol=1e-5, atol=1e-6)
    for got, w in zip(ours[1], want[1]):
        torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-6)


def test_token_accuracy_is_the_share_of_kept_rows_predicted():
    hidden, weight, target, _ = inputs(40, 8, 5, torch.float32)
    loss, accuracy = linear_cross_entropy(hidden, weight, target, return_accuracy=True)
    kept = target != -100
    predicted = F.linear(hidden, weight).argmax(-1)
    assert accuracy.item() == pytest.approx((predicted == target)[kept].float().mean().item())
    assert not accuracy.requires_grad and loss.requires_grad
    torch.testing.assert_close(loss, stock_loss(hidden, weight, target))


def test_a_chunk_holds_128_mib_of_logits_or_the_weights_values_if_more():
    assert cross_entropy.chunk_rows(32_000, 512, 2) == (128 << 20) // (2 * 32_000)
    assert cross_entropy.chunk_rows(131_072, 1024, 4) == 1024  # a 512 MiB fp32 weight: 512 MiB of logits
    assert cross_entropy.chunk_rows(1 << 30, 4, 4) == 8


def test_bad_class_weights_and_z_loss_are_refused():
    hidden, weight, target, _ = inputs(8, 4, 10, torch.float32)
    with pytest.raises(ValueError, match="one weight per class \\(10,\\)"):
        linear_cross_entropy(hidden, weight, target, class_weight=torch.ones(9))
    with pytest.raises(ValueError, match="class_weight with label_smoothing is not supported"):
        linear_cross_entropy(hidden, weight, target, class_weight=torch.ones(10), label_smoothing=0.1)
    with pytest.raises(ValueError, match="z_loss must be >= 0"):
        linear_cross_entropy(hidden, weight, target, z_loss=-1.0)


def test_the_weight_gradient_keeps_stocks_precision_over_many_chunks(monkeypatch):
    """bf16, 256 chunks: the head's weight gradient, accumulated in fp32, within 1.5x stock's error against fp64
    (accumulated in bf16 it grows with the chunks: benchmarks/cross_entropy.py --precision)."""
    rows, vocab = 4096, 256
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda *_: rows // 256)
    hidden, weight, target, _ = inputs(rows, 64, vocab, torch.bfloat16, ignored=0.0)
    exact = weight.detach().double().requires_grad_()
    want = grads(lambda: reference_loss(hidden.detach().double(), exact, target), [exact])[1][0]
    ours = grads(lambda: linear_cross_entropy(hidden, weight, target), [weight])[1][0]
    stock = grads(lambda: stock_loss(hidden, weight, target), [weight])[1][0]
    error = lambda g: ((g.double() - want).norm() / want.norm()).item()
    assert error(ours) <= 1.5 * error(stock), (error(ours), error(stock))


def test_the_cuda_backend_runs_its_heads_on_triton(monkeypatch):
    """The CUDA C++ extension has no cross-entropy kernel: where it is the backend, the head's step is Triton's."""
    from conftest import _load_backend

    triton = _load_backend("triton", "cpu").module  # skips where Triton cannot run CPU tensors
    monkeypatch.setitem(kernels._CHOSEN, "cpu", "cuda")
    assert kernels.head_implementation(torch.device("cpu")) is triton
    monkeypatch.setitem(kernels._CHOSEN, "cpu", "cpp")
    assert kernels.head_implementation(torch.device("cpu")) is kernels.library.OPS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_kernel_takes_half_precision_rows_and_a_row_scale(kernel_backend, dtype):
    """The step on bf16/fp16 logits computes in fp32 and rounds the scaled gradient once, as the reference does
    (the gradient stock's ``.float()`` backward casts back); the loss is fp32 and unscaled."""
    device = kernel_backend.device
    logits = (torch.randn(9, 517, device=device) * 4).to(dtype)
    target = torch.randint(0, 517, (9,), device=device)
    target[2] = -100
    scale = torch.rand(9, device=device) + 0.5
    for smoothing, cap in ((0.0, 0.0), (0.1, 0.0), (0.0, 7.0)):
        want, got = logits.clone(), logits.clone()
        want_loss = torch_ops.cross_entropy_grad_(want, target, -100, smoothing, cap, scale)
        got_loss = kernel_backend.module.cross_entropy_grad_(got, target, -100, smoothing, cap, scale)
        assert got.dtype == dtype and got_loss.dtype == torch.float32
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        ulp = max(torch.finfo(dtype).eps, 1e-5)  # the fp32 values agree to ~1e-6; rounded once, one unit apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-7)
        torch.testing.assert_close(
            want_loss, torch_ops.cross_entropy_grad_(logits.clone(), target, -100, smoothing, cap)
        )
        assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_a_bf16_step_rounds_its_gradient_once_as_stock_does():
    """A bf16 head: the logits' gradient is rounded to bf16 once before the matmuls, as stock's ``.float()``
    backward rounds it, so the hidden-state gradient is stock's to a bf16 rounding of the matmul."""
    hidden, weight, target, _ = inputs(64, 32, 300, torch.bfloat16)
    ours = grads(lambda: linear_cross_entropy(hidden, weight, target, reduction="sum"), [hidden])[1][0]
    stock = grads(lambda: stock_loss(hidden, weight, target, reduction="sum"), [hidden])[1][0]
    torch.testing.assert_close(ours, stock, rtol=2**-7, atol=1e-3 * stock.abs().max().item())
