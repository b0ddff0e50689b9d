"""What the GPU's path does with the generator and with devices, where the CPU cannot show it: a drawn mask takes
exactly the Philox values it reserves, a captured CUDA graph draws a new mask per replay and its backward reuses it,
ops past 2^31 elements index them all, and a tensor on another device is refused by name (the meta/CPU cases run
here too). ``python -m benchmarks.gpu`` runs this file first."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_GPU
from torch import nn

from lightning_lowmem import kernels
from lightning_lowmem.kernels import library, torch_ops
from lightning_lowmem.nn import LowMemLinear

GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no GPU")]
GPU_BACKENDS = [pytest.param(name, marks=GPU) for name in ("cuda", "triton")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


def use(backend: str, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    monkeypatch.setenv(kernels.ENV_VAR, backend)
    device = torch.device("cuda", torch.cuda.current_device())
    assert kernels.backend(device) == backend
    return device


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU")
@pytest.mark.parametrize("numel", [1, 4003, 4 << 20])
def test_a_drawn_mask_reserves_the_philox_values_it_takes(numel, monkeypatch):
    """ATen's offset counts 32-bit values of each thread's subsequence; the mask takes subsequence 0's counters (four
    values each) from offset / 4 on. It must reserve all of them: the next ATen kernel's thread 0 starts at the new
    offset / 4, and a counter both used would correlate its numbers with the mask."""
    device = use("cuda", monkeypatch)
    generator = torch.cuda.default_generators[device.index]
    counters = -(-numel // 4)
    torch.cuda.manual_seed(0)
    generator.set_offset(8)  # as after an earlier draw
    _, seed = library.OPS.seeded_dropout(torch.ones(numel, device=device), 0.5)
    key, first = seed.tolist()
    assert key == generator.initial_seed() and first == 8 // 4
    assert generator.get_offset() == 8 + 4 * counters  # what the counters [first, first + counters) hold
    _, second = library.OPS.seeded_dropout(torch.ones(3, device=device), 0.5)
    assert second.tolist() == [key, first + counters]  # the next draw's counters follow, none shared


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_a_captured_lora_step_draws_a_mask_per_replay_that_its_backward_reuses(backend, monkeypatch):
    """A LoRA adapter's folded dropout, forward and backward captured in one CUDA graph and replayed three times:
    each replay a new mask (the generator's offset advances per replay, not baked into the graph), and each replay's
    gradients are those of its own forward's mask."""
    device = use(backend, monkeypatch)
    torch.manual_seed(0)
    p = 0.25
    layer = LowMemLinear.from_linear(nn.Linear(256, 16, device=device), dropout=p)
    x = torch.randn(64, 256, device=device, requires_grad=True)
    grad_out = torch.randn(64, 16, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture stream: the gradients' buffers exist before capture
        for _ in range(3):
            layer(x).backward(grad_out)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
        out.backward(grad_out)
    masks = []
    for _ in range(3):
        for tensor in (x.grad, layer.weight.grad, layer.bias.grad):
            tensor.zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        mask = x.grad != 0  # grad_out @ weight is nowhere exactly 0: the mask shows where the gradient is
        dropped = x.detach() * mask / (1 - p)
        torch.testing.assert_close(out, F.linear(dropped, layer.weight, layer.bias))  # the forward's mask
        torch.testing.assert_close(x.grad, (grad_out @ layer.weight.detach()) * mask / (1 - p))
        torch.testing.assert_close(layer.weight.grad, grad_out.T @ dropped)
        masks.append(mask)
    assert 0.6 < masks[0].float().mean().item() < 0.9
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_ops_past_two_to_the_31_elements_index_every_element(backend, monkeypatch):
    """bf16 tensors of 2^31 + 8,192 elements (4 GiB): the last elements of each op's output are what the op gives
    on them alone (the dropout's: the reference's for their counters), so no index wrapped at 32 bits."""
    device = use(backend, monkeypatch)
    if torch.cuda.mem_get_info(device)[0] < 24 << 30:
        pytest.skip("needs 24 GiB of free GPU memory")
    ops = kernels.implementation(device)
    dim = 4096
    x = torch.randn(2**31 // dim + 2, dim, device=device, dtype=torch.bfloat16)
    tail = x[-2:].clone()  # the last two rows: past 2^31 elements
    thresholds, levels = [-0.5, 0.5, 1.5], [0.0, 0.5, 1.0, 1.1]

    y, packed = ops.act_forward(x, "gelu", thresholds)
    y_tail, packed_tail = ops.act_forward(tail, "gelu", thresholds)
    assert torch.equal(y[-2:], y_tail) and torch.equal(packed[-packed_tail.numel() :], packed_tail)
    del y
    grad = ops.act_backward(x, packed, levels)
    assert torch.equal(grad[-2:], ops.act_backward(tail, packed_tail, levels))
    del grad, packed
    z, rstd = ops.norm_forward(x, dim, 1e-5, True, torch.bfloat16)
    z_tail, rstd_tail = ops.norm_forward(tail, dim, 1e-5, True, torch.bfloat16)
    assert torch.equal(z[-2:], z_tail) and torch.equal(rstd[-2:], rstd_tail)
    del z, rstd
    seed = torch.tensor([12345, 7], device=device)
    dropped = ops.dropout(x, 0.5, seed)
    first_counter = 7 + (x.numel() - tail.numel()) // 4
    tail_seed = torch.tensor([12345, first_counter], device=device)
    assert torch.equal(dropped[-2:], torch_ops.dropout(tail, 0.5, tail_seed))


@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_on_another_device_is_refused_by_name(device):
    """A seed, scale or weight on another device than the input: a clear error naming the op, never a kernel reading
    another device's memory, never an empty tensor returned (a meta tensor sends the call to the fake kernel)."""
    if device == "cuda":
        assert kernels.backend("cuda") == "cuda"
    x = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match="dropout: every tensor must be on .* got one on meta"):
        library.OPS.dropout(x, 0.5, torch.tensor([1, 2], device="meta"))
    with pytest.raises(RuntimeError, match="norm_affine_forward: every tensor must be on"):
        library.OPS.norm_affine_forward(x, 8, 1e-5, True, x.dtype, torch.ones(8, device="meta"), None)
    if device == "cuda":  # a CPU tensor beside GPU ones: the kernels' own check, and the C++ autograd's
        with pytest.raises(RuntimeError, match="dropout: seed must be on cuda"):
            library.OPS.dropout(x, 0.5, torch.tensor([1, 2]))
        weight = torch.randn(3, 8, requires_grad=True)
        with pytest.raises(RuntimeError, match="affine_linear: weight must be on cuda:0 with the input, got cpu"):
            library.OPS.affine_linear(x, None, weight, None, None, None, torch.float32, 0.0, 0.1, None)
