"""The autograd functions in C++ (``lowmem::ms_norm``, ``affine_linear``, ``step_activation``, ``gated_activation``,
``seeded_dropout``: the eager path of
the compiled backends) against the Python functions they replace (the path of torch.compile, Triton and the
pure-PyTorch backend), both over the same C++ kernels: the same outputs and gradients bit for bit, the very
same tensors saved (dtypes, shapes, the norm's output shared by pointer with its consumers), the same errors."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_GPU
from torch import nn

from lightning_lowmem import kernels
from lightning_lowmem.kernels import library
from lightning_lowmem.nn import LowMemActivation, LowMemLinear, MSLayerNorm, MSRMSNorm, SeededDropout
from lightning_lowmem.ops import affine, dropout
from lightning_lowmem.ops.activation import step_activation
from lightning_lowmem.ops.gated import gated_activation
from lightning_lowmem.ops.norm import memory_sharing_norm

PATHS = ["cpp", "python"]
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no GPU")]


@pytest.fixture(autouse=True, params=["cpu", pytest.param("cuda", marks=GPU)])
def device(request) -> str:
    """Each test on the CPU (the C++ extension) and, where there is one, a GPU (the CUDA extension's C++ autograd,
    the default path of every CUDA tensor): its tensors and modules made there."""
    assert kernels.backend(request.param) == ("cpp" if request.param == "cpu" else "cuda")  # both paths: its kernels
    torch.set_default_device(request.param)
    yield request.param
    torch.set_default_device(None)


def run(path: str, monkeypatch: pytest.MonkeyPatch, recorder, fn, *tensors: torch.Tensor):
    """``fn(*tensors)`` forward and backward on fresh leaf copies, by ``path``: outputs, gradients, the grad_fn
    names and the recorder of what autograd saved."""
    with monkeypatch.context() as patch:
        if path == "python":
            patch.setattr(kernels, "autograd_in_cpp", lambda x: False)
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        with recorder() as rec:
            out = fn(*leaves)
        names = _grad_fn_names(out.grad_fn)
        out.float().pow(2).sum().backward()
    return out, [t.grad for t in leaves], names, rec


def _grad_fn_names(node, seen=None) -> set[str]:
    seen = set() if seen is None else seen
    if node is not None and node not in seen:
        seen.add(node)
        for child, _ in node.next_functions:
            _grad_fn_names(child, seen)
    return {n.name() for n in seen}


def assert_same_runs(cpp, python) -> None:
    (out_c, grads_c, names_c, rec_c), (out_p, grads_p, names_p, rec_p) = cpp, python
    assert torch.equal(out_c, out_p)
    for grad_c, grad_p in zip(grads_c, grads_p, strict=True):
        assert (grad_c is None) == (grad_p is None)
        if grad_c is not None:
            assert grad_c.dtype == grad_p.dtype and torch.equal(grad_c, grad_p)
    assert [(t.dtype, t.shape) for t in rec_c.saved] == [(t.dtype, t.shape) for t in rec_p.saved]
    assert len(rec_c.storages()) == len(rec_p.storages())
    assert any("lowmem::" in name for name in names_c), names_c  # the C++ functions ran
    assert not any("lowmem::" in name for name in names_p), names_p


def block(
    norm_cls: type, dim: int, weight_offset: float, bias: bool, frozen_linear: bool, frozen_norm: bool = False
) -> nn.Module:
    """A memory-sharing norm read by two linears (its z saved once for both; its output, with a frozen affine),
    then an activation."""
    stock = nn.LayerNorm(dim) if norm_cls is MSLayerNorm else nn.RMSNorm(dim)
    norm = norm_cls.from_module(stock)
    norm.weight_offset = weight_offset
    with torch.no_grad():
        norm.weight.normal_()
        if norm.bias is not None:
            norm.bias.normal_()
        if frozen_norm:  # as pretrained: |bias| < |weight| but for one column (weight 0): y and one z column saved
            norm.weight.uniform_(1, 2)[0] = -weight_offset
            if norm.bias is not None:
                norm.bias.uniform_(-0.5, 0.5)
    first = LowMemLinear.from_linear(nn.Linear(dim, 2 * dim, bias=bias), norm=norm)
    second = LowMemLinear.from_linear(nn.Linear(dim, dim), norm=norm)
    first.weight.requires_grad_(not frozen_linear)
    norm.requires_grad_(not frozen_norm)
    act = LowMemActivation("gelu")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.first, self.second, self.act = norm, first, second, act

        def forward(self, x):
            y = self.norm(x)
            return self.act(self.first(y)).sum(-1, keepdim=True) * self.second(y)

    return Block()


@pytest.mark.parametrize("norm_cls", [MSLayerNorm, MSRMSNorm])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen_linear", [False, True])
@pytest.mark.parametrize("frozen_input", [False, True])
@pytest.mark.parametrize("frozen_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"])
def test_norm_linears_and_activation_match(
    norm_cls, weight_offset, bias, frozen_linear, frozen_input, frozen_norm, dtype, monkeypatch, recorder, device
):
    if frozen_input and frozen_norm:
        pytest.skip("nothing before the linears needs a gradient: the norm saves nothing")
    module = block(norm_cls, 32, weight_offset, bias, frozen_linear, frozen_norm)
    if dtype == torch.bfloat16:
        module = module.to(dtype)
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    x.requires_grad_(not frozen_input)
    params = [p for p in module.parameters() if p.requires_grad]

    def forward(x, *_):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "autocast"):
            return module(x)

    runs = {}
    for path in PATHS:
        module.zero_grad(set_to_none=True)
        out, grads, names, rec = run(path, monkeypatch, recorder, forward, x)
        runs[path] = (out, grads + [p.grad.clone() for p in params], names, rec)
    assert_same_runs(runs["cpp"], runs["python"])
    # the norm's output is what both linears saved: one storage for the three
    saved_c = runs["cpp"][3].saved
    assert saved_c[0].shape == x.shape and sum(t.data_ptr() == saved_c[0].data_ptr() for t in saved_c) >= 2
    if frozen_norm and device == "cpu":  # the norm saved its output, and z at column 0 (a GPU's saves z whole)
        (columns,) = [t for t in saved_c if t.dtype == torch.long]
        assert saved_c[0].grad_fn is not None and columns.tolist() == [0]
        assert [t.shape for t in saved_c if t.shape == (21, 1)] == [(21, 1)]


@pytest.mark.parametrize("center", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"])
def test_a_norm_without_an_affine_matches_and_saves_its_output(center, dtype, monkeypatch, recorder, device):
    """A norm with no weight or bias (OLMo's) returns ``z`` and saves it: the very tensor returned, by pointer."""
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)

    def norm(x):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "autocast"):
            y, z = memory_sharing_norm(x, 32, 1e-5, center)
        assert y is z
        return y

    runs = {path: run(path, monkeypatch, recorder, norm, x.requires_grad_()) for path in PATHS}
    assert_same_runs(runs["cpp"], runs["python"])
    assert "torch::autograd::CppNode<lowmem::(anonymous namespace)::MemorySharingNormFunction>" in runs["cpp"][2]
    out, _, _, rec = runs["cpp"]
    assert [(t.dtype, t.shape) for t in rec.saved] == [(out.dtype, out.shape), (torch.float32, (21,))]
    assert rec.saved[0].data_ptr() == out.data_ptr()


@pytest.mark.parametrize("frozen_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"])
def test_dropouts_match_on_the_seeds_the_cpp_functions_draw(frozen_norm, dtype, monkeypatch, recorder, device):
    """A linear with a folded dropout (LoRA's) and a seeded dropout of the norm's output read by another linear
    (BERT's, its seed kept by it and, with a norm that saves z, by its reader): the C++ functions draw their seeds from the CPU generator in C++ and keep them as integers (no tensor
    saved); the Python functions, given those seeds, compute the same bits and save the rest alike."""
    module = block(MSLayerNorm, 32, 0.0, True, False, frozen_norm)
    module.first.dropout, module.dropout = 0.2, SeededDropout(0.1)
    if dtype == torch.bfloat16:
        module = module.to(dtype)
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)

    def forward(x):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "autocast"):
            y = module.norm(x)
            read = module.first(y)  # draws first
            return module.act(read).sum(-1, keepdim=True) * module.second(module.dropout(y))

    torch.manual_seed(0)
    # the C++ draws, in order; of x's size, as a GPU's generator hands each draw the counters after the last one's
    seeds = [library.OPS.seeded_dropout(torch.ones(x.shape), 0.5)[1] for _ in range(2)]
    runs = {}
    for path in PATHS:
        drawn = iter(seeds)
        monkeypatch.setattr(affine, "draw_seed", lambda device, drawn=drawn: next(drawn))
        monkeypatch.setattr(dropout, "draw_seed", lambda device, drawn=drawn: next(drawn))
        module.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out, grads, names, rec = run(path, monkeypatch, recorder, forward, x.requires_grad_())
        runs[path] = (out, grads + [p.grad for p in module.parameters() if p.requires_grad], names, rec)
    (out_c, grads_c, names_c, rec_c), (out_p, grads_p, _, rec_p) = runs["cpp"], runs["python"]
    assert torch.equal(out_c, out_p) and next(drawn, None) is None  # the Python path took both seeds
    for grad_c, grad_p in zip(grads_c, grads_p, strict=True):
        assert torch.equal(grad_c, grad_p)
    seeds_saved = [t for t in rec_p.saved if t.dtype == torch.long and t.numel() == 2]
    # the reader of the dropout's output keeps its seed too where the norm saves z: always on a GPU
    assert len(seeds_saved) == (2 if frozen_norm and device == "cpu" else 3)
    if device == "cpu":  # the CPU's seeds kept as integers: no tensor
        assert not [t for t in rec_c.saved if t.dtype == torch.long and t.numel() == 2]
        assert [(t.dtype, t.shape) for t in rec_c.saved] == [
            (t.dtype, t.shape) for t in rec_p.saved if not any(t is s for s in seeds_saved)
        ]
    else:  # a GPU's seeds are tensors there, written by the kernel that drew the mask (no host read): kept alike
        assert sorted((str(t.dtype), t.shape) for t in rec_c.saved) == sorted(
            (str(t.dtype), t.shape) for t in rec_p.saved
        )
    assert {"torch::autograd::CppNode<lowmem::(anonymous namespace)::AffineLinearFunction>"} <= names_c


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_activation_matches(activation, bits, dtype, monkeypatch, recorder):
    x = torch.randn(5, 33, 17, dtype=dtype, requires_grad=True) * 3
    runs = [run(path, monkeypatch, recorder, lambda t: step_activation(t, activation, bits), x) for path in PATHS]
    assert_same_runs(*runs)
    assert [t.dtype for t in runs[0][3].saved] == [torch.uint8]


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("mode", ["gate", "gate_up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "packed", "expanded gate"])
def test_gated_activation_matches(kind, mode, dtype, layout, monkeypatch, recorder):
    """Output, gradients and saved tensors (the exceptions where ``act(gate) == 0`` among them) alike; ``act``
    recomputed on the forward's layout of a packed half, an expanded gate kept as it is."""
    packed = torch.randn(4, 9, 2 * 600, dtype=dtype) * 3
    packed[0, 1, [3, 17, 700]] = 0.0  # act(gate) == 0: two in the gate half, one in up's
    packed.requires_grad_()

    def product(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, dim=-1)
        if layout == "contiguous":
            gate, up = gate.contiguous(), up.contiguous()
        elif layout == "expanded gate":
            gate = gate[:1, :1].expand_as(up)
        return gated_activation(gate, up, kind, mode)

    runs = [run(path, monkeypatch, recorder, product, packed) for path in PATHS]
    assert_same_runs(*runs)
    saved = [t.dtype for t in runs[0][3].saved]
    assert saved == ([dtype, dtype, torch.int32, dtype] if mode == "gate" else [dtype, dtype])


def test_strided_activation_input_takes_the_python_function(recorder, monkeypatch):
    """The stock op's own layout and element order for a strided input: the Python function's."""
    x = torch.randn(8, 40, requires_grad=True)
    _, _, names, _ = run("cpp", monkeypatch, recorder, lambda t: step_activation(t.t(), "silu"), x)
    assert "StepActivationFunctionBackward" in names and not any("lowmem::" in name for name in names)


@pytest.mark.parametrize("path", PATHS)
def test_double_backward_is_refused_alike(path, monkeypatch):
    if path == "python":
        monkeypatch.setattr(kernels, "autograd_in_cpp", lambda x: False)
    x = torch.randn(4, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    for out, name in (
        (memory_sharing_norm(x, 16, 1e-5, True, weight, name="ms_layer_norm")[0], "ms_layer_norm"),
        (memory_sharing_norm(x, 16, 1e-5, False, name="ms_rms_norm")[0], "ms_rms_norm"),  # no affine
        (step_activation(x, "gelu"), "step_activation"),
        (gated_activation(x, x * 2, "silu", "gate"), "gated_activation"),
    ):
        with pytest.raises(RuntimeError, match=f"{name} does not support double backward"):
            torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)


def test_compiled_tracing_takes_the_python_functions():
    """torch.compile traces the Python functions (whose saved tensors test_compile checks), not the C++ ones."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.extend(m.code for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule))
        return graph_module.forward

    norm = MSLayerNorm.from_module(nn.LayerNorm(8))
    linear = LowMemLinear.from_linear(nn.Linear(8, 4), norm=norm)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: step_activation(linear(norm(x)), "silu"), backend=backend, fullgraph=True)
    compiled(torch.randn(2, 8, requires_grad=True)).sum().backward()
    code = "\n".join(graphs)
    assert "lowmem.norm_affine_forward" in code and "lowmem.act_forward" in code
    assert not any(f"lowmem.{name}" in code for name in ("ms_norm", "affine_linear", "step_activation"))
