"""Compiled kernels against the pure-PyTorch reference, the stock modules, and the loader's guarantees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem import functional, kernels
from lightning_lowmem.kernels import build, torch_ops
from lightning_lowmem.ops.constants import GELU_2BIT, SILU_2BIT

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
STEPS = {"gelu": GELU_2BIT, "gelu_tanh": GELU_2BIT, "silu": SILU_2BIT}
# Empty, shorter than a byte, odd tails, around the 4096-element staging block, several parallel chunks.
SIZES = [0, 1, 3, 4, 5, 4095, 4097, 3 * 4096 + 7, 200_003]
NORM_SHAPES = [(0, 8), (1, 1), (3, 7), (5, 768), (2, 3, 1001), (64, 33)]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]),
]


def compiled(device: str) -> ModuleType:
    loaded = build.load("cpu" if device == "cpu" else "cuda")
    if isinstance(loaded, build.BuildError):
        pytest.fail(f"the {device} extension must build here: {loaded}")
    return loaded


def spread(shape, dtype, device) -> torch.Tensor:
    """Values over all four code segments, with the thresholds themselves in it."""
    x = torch.randn(shape, dtype=torch.float64) * 5
    flat = x.view(-1)
    thresholds = torch.tensor(GELU_2BIT.thresholds + SILU_2BIT.thresholds, dtype=torch.float64)
    k = min(flat.numel(), thresholds.numel())
    flat[:k] = thresholds[:k]
    return x.to(dtype=dtype, device=device)


def half_tolerance(dtype: torch.dtype) -> dict:
    """Results rounded to a 16-bit type may differ by one unit in the last place."""
    return {"atol": 1e-2, "rtol": 1e-2} if dtype in (torch.float16, torch.bfloat16) else {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", STEPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_matches_reference_bit_for_bit(device, kind, dtype):
    ext, step = compiled(device), STEPS[kind]
    for n in SIZES:
        x = spread((n,), dtype, device)
        y, packed = ext.act_forward(x, kind, step.thresholds)
        ref_y, ref_packed = torch_ops.act_forward(x, kind, step.thresholds)
        assert torch.equal(y, ref_y) and torch.equal(y, torch_ops.stock_activation(x, kind)), n
        assert packed.dtype == torch.uint8 and torch.equal(packed, ref_packed), n
        g = torch.randn(n, dtype=dtype, device=device)
        assert torch.equal(ext.act_backward(g, packed, step.levels), torch_ops.act_backward(g, ref_packed, step.levels))


@pytest.mark.parametrize("device", DEVICES)
def test_activation_non_contiguous_inputs(device):
    ext, step = compiled(device), GELU_2BIT
    base = spread((37, 64), torch.float32, device)
    for x in (base.t(), base[:, ::3], base.unsqueeze(0).expand(2, -1, -1)):
        y, packed = ext.act_forward(x, "gelu", step.thresholds)
        assert torch.equal(y, F.gelu(x))
        assert torch.equal(packed, torch_ops.act_forward(x, "gelu", step.thresholds)[1])
        grad = torch.randn(x.shape[-1], device=device).expand(x.shape)  # stride 0, as from a broadcast
        got = ext.act_backward(grad, packed, step.levels)
        assert got.shape == x.shape and torch.equal(got, torch_ops.act_backward(grad, packed, step.levels))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("center", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize(
    "dtype,out_dtype",
    [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_norm_matches_reference(device, center, dtype, out_dtype):
    ext = compiled(device)
    for shape in NORM_SHAPES:
        x = (torch.randn(shape, dtype=torch.float64) * 3 + 2).to(dtype=dtype, device=device)
        dim = shape[-1]
        z, rstd = ext.norm_forward(x, dim, 1e-5, center, out_dtype)
        ref_z, ref_rstd = torch_ops.norm_forward(x, dim, 1e-5, center, out_dtype)
        assert z.dtype == out_dtype and rstd.dtype == ref_rstd.dtype and rstd.shape == ref_rstd.shape
        torch.testing.assert_close(z, ref_z, **half_tolerance(out_dtype))
        torch.testing.assert_close(rstd, ref_rstd)
        g = torch.randn(shape, dtype=torch.float64).to(dtype=out_dtype, device=device)
        got = ext.norm_backward(g, ref_z, ref_rstd, dim, center, dtype)
        want = torch_ops.norm_backward(g, ref_z, ref_rstd, dim, center, dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **half_tolerance(out_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_norm_non_contiguous_inputs(device):
    ext = compiled(device)
    x = torch.randn(48, 40, device=device).t()  # rows of 48, strided
    z, rstd = ext.norm_forward(x, 48, 1e-5, True, x.dtype)
    torch.testing.assert_close(z, F.layer_norm(x, (48,)))
    grad = torch.randn(48, device=device).expand(40, 48)
    ref_z, ref_rstd = torch_ops.norm_forward(x.contiguous(), 48, 1e-5, True, x.dtype)
    torch.testing.assert_close(
        ext.norm_backward(grad, z, rstd, 48, True, x.dtype),
        torch_ops.norm_backward(grad, ref_z, ref_rstd, 48, True, x.dtype),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_ops_on_compiled_backend_match_stock_modules(device, monkeypatch):
    """The public ops on the compiled backend: exact forward, norm gradients of the stock norms."""
    monkeypatch.setenv(kernels.ENV_VAR, "cpp" if device == "cpu" else "cuda")
    x = torch.randn(6, 2, 33, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.equal(functional.regelu2(x), F.gelu(x)) and torch.equal(functional.resilu2(x), F.silu(x))
    for ours, stock in (
        (lambda t: functional.ms_layer_norm(t, (33,)), lambda t: F.layer_norm(t, (33,))),
        (lambda t: functional.ms_rms_norm(t, (33,)), lambda t: F.rms_norm(t, (33,), eps=1e-6)),
    ):
        torch.testing.assert_close(ours(x), stock(x))
        g = torch.randn_like(x)
        torch.testing.assert_close(torch.autograd.grad(ours(x), x, g)[0], torch.autograd.grad(stock(x), x, g)[0])
        assert torch.autograd.gradcheck(ours, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise_naming_the_op(device):
    ext = compiled(device)
    ints = torch.arange(8, device=device)
    with pytest.raises(TypeError, match="act_forward: unsupported dtype"):
        ext.act_forward(ints, "gelu", GELU_2BIT.thresholds)
    with pytest.raises(ValueError, match="unknown activation kind"):
        ext.act_forward(ints.float(), "relu", GELU_2BIT.thresholds)
    with pytest.raises(ValueError, match="act_backward: 1 packed bytes do not hold 8 codes"):
        ext.act_backward(ints.float(), torch.zeros(1, dtype=torch.uint8, device=device), GELU_2BIT.levels)
    with pytest.raises(TypeError, match="norm_forward: unsupported dtype"):
        ext.norm_forward(ints, 8, 1e-5, True, torch.float32)
    with pytest.raises(ValueError, match="norm_forward: cannot normalize 8 elements over trailing size 3"):
        ext.norm_forward(ints.float(), 3, 1e-5, True, torch.float32)
    if device == "cpu" and torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="must be on cpu"):
            ext.act_forward(ints.float().cuda(), "gelu", GELU_2BIT.thresholds)


def test_backend_reports_what_runs(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.backend("cpu") == "cpp" and kernels.implementation(torch.device("cpu")) is build.load("cpu")
    assert kernels.backend("meta") == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert kernels.backend("cpu") == "torch" and kernels.implementation(torch.device("cpu")) is torch_ops
    monkeypatch.setenv(kernels.ENV_VAR, "fortran")
    with pytest.raises(ValueError, match="is not one of"):
        kernels.backend("cpu")


def test_failed_build_falls_back_once_or_raises_when_forced(monkeypatch):
    monkeypatch.setattr(build, "load", lambda kind: build.BuildError("no C++ compiler"))
    kernels._warn_fallback.cache_clear()
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler.*pure-PyTorch"):
        assert kernels.backend("cpu") == "torch"
    assert kernels.implementation(torch.device("cpu")) is torch_ops  # no second warning: cached
    monkeypatch.setenv(kernels.ENV_VAR, "cpp")
    with pytest.raises(RuntimeError, match="LIGHTNING_LOWMEM_BACKEND=cpp.*no C\\+\\+ compiler"):
        kernels.backend("cpu")
    kernels._warn_fallback.cache_clear()


def test_no_compiler_or_sources_is_a_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-lowmem")
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
        build.build("cpu")
    monkeypatch.setattr(build, "CSRC", tmp_path / "missing")
    with pytest.raises(build.BuildError, match="sources are not installed"):
        build.build("cpu")


def test_loaded_module_is_cached_per_process():
    assert build.load("cpu") is build.load("cpu")


def test_build_dir_is_keyed_by_versions_and_sources():
    name = build.build_dir("cpu").name
    assert torch.__version__.replace("+", "_") in name and build.source_hash("cpu") in name
    assert build.source_hash("cpu") != build.source_hash("cuda")


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("owner", ["dead", "old"])
def test_stale_lock_is_taken_over(tmp_path, owner):
    lock = tmp_path / "lowmem.lock"
    pid = dead_pid() if owner == "dead" else os.getpid()
    lock.write_text(f"{pid} {build.socket.gethostname()}")
    if owner == "old":
        past = time.time() - build.STALE_LOCK_SECONDS - 60
        os.utime(lock, (past, past))
    (tmp_path / "lock").touch()  # an old torch FileBaton left by the killed build
    start = time.monotonic()
    with build.build_lock(tmp_path):
        assert lock.read_text().split()[0] == str(os.getpid())
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - start < 5 and not lock.exists()


def test_live_lock_is_respected(tmp_path):
    lock = tmp_path / "lowmem.lock"
    lock.write_text(f"{os.getpid()} {build.socket.gethostname()}")
    assert not build._lock_is_stale(lock)


def test_ninja_found_from_the_interpreter_environment(monkeypatch):
    if not any(shutil.which("ninja", path=str(d)) for d in build._ninja_dirs()):
        pytest.skip("no ninja installed next to this interpreter")
    monkeypatch.setenv("PATH", "/nonexistent")
    with build.ninja_on_path():
        assert shutil.which("ninja")
    assert os.environ["PATH"] == "/nonexistent"


def test_cli_prebuilds_and_reports():
    compiled("cpu")  # built (or cached) in-process first, so the CLI only loads
    out = subprocess.run(
        [sys.executable, "-m", "lightning_lowmem.kernels", "build"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    assert "cpu: built" in out and "cpu tensors -> cpp" in out
