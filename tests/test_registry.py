"""The public extension API: users' own activation and norm classes become candidates, still verified."""

from __future__ import annotations

import copy
import runpy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem import apply_lowmem, register_activation, register_norm
from lightning_lowmem.approx import __main__ as generator
from lightning_lowmem.lightning.precision import is_norm
from lightning_lowmem.nn import MemorySharingNorm, ReSiLU2
from lightning_lowmem.registry import activations, norms
from lightning_lowmem.registry.activations import ACTIVATIONS, Activation


class Squash(nn.Module):
    """A hand-written SiLU whose class name says nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class Bell(nn.Module):
    """A hand-written erf-GELU, for a wrong registration."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.erf(x / 2**0.5))


class ScaledRMSNorm(nn.Module):
    """A hand-written RMSNorm as research code writes it: ``scale`` and ``epsilon``."""

    def __init__(self, dim: int, epsilon: float = 1e-6) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.epsilon = epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.epsilon) * self.scale


class CenteredNorm(nn.Module):
    """A hand-written LayerNorm without a bias (``gain``, eps hard-coded), for wrong registrations."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.gain, None, 1e-5)


class Block(nn.Module):
    """A pre-norm MLP block: the norm feeds two linears, the activation sits between."""

    def __init__(self, norm: nn.Module, act: nn.Module, dim: int = 32) -> None:
        super().__init__()
        self.norm, self.up, self.gate, self.act, self.down = (
            norm,
            nn.Linear(dim, 64),
            nn.Linear(dim, 64),
            act,
            nn.Linear(64, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(self.act(self.up(h)) + self.gate(h))


@pytest.fixture(autouse=True)
def registrations(monkeypatch):
    """Each test starts with no user registrations and leaves none behind."""
    monkeypatch.setattr(activations, "REGISTERED", {})
    monkeypatch.setattr(norms, "REGISTERED", {})


def model_and_input(norm: nn.Module, act: nn.Module) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Block(norm, act), torch.randn(4, 7, 32)


def test_unregistered_look_alikes_are_left_alone_with_a_reason():
    model, x = model_and_input(ScaledRMSNorm(32), Squash())
    report = apply_lowmem(model, example_input=x)
    assert report.status("act") == report.status("norm") == "left alone"
    reasons = {e.name: e.detail for e in report.left_alone}
    assert "computes SiLU" in reasons["act"] and "register_activation(Squash, like='silu')" in reasons["act"]
    assert "unexpected parameters/buffers ['scale']" in reasons["norm"] and "register_norm" in reasons["norm"]
    assert type(model.act) is Squash and type(model.norm) is ScaledRMSNorm


def test_registered_classes_convert_exactly_and_keep_their_checkpoint():
    register_activation(Squash, like="silu")
    register_norm(ScaledRMSNorm, "rms", weight="scale", bias=None, eps="epsilon")
    stock, x = model_and_input(ScaledRMSNorm(32), Squash())
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input=x)
    assert report.status("act") == report.status("norm") == "converted"
    assert isinstance(model.act, ReSiLU2) and isinstance(model.norm, MemorySharingNorm)
    assert model.norm.scale is model.norm.affine()[0] and model.norm.eps == 1e-6
    assert model.up.norm is model.norm and model.gate.norm is model.norm  # shared with both linears
    # outputs as stock's; the norm's gradients exact (the activation's are the 2-bit approximation)
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)
    xs = [x.double().requires_grad_() for _ in range(2)]
    for m, xi in zip((model, stock), xs):  # in float64: the gradients agree to its rounding
        m.double().norm(xi).pow(2).mul(torch.arange(32.0)).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.norm.scale.grad, stock.norm.scale.grad, rtol=1e-12, atol=1e-12)
    # parameter names kept: the converted state_dict loads strictly into the stock model, and back
    assert list(model.state_dict()) == list(stock.state_dict())
    fresh = model_and_input(ScaledRMSNorm(32), Squash())[0].double()
    fresh.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(stock.state_dict(), strict=True)
    assert report.reduction is not None and report.reduction > 0


def test_a_wrong_registration_is_refused_with_the_measured_difference():
    register_activation(Bell, like="silu")  # a GELU
    register_norm(CenteredNorm, "rms", weight="gain", bias=None, eps=1e-5)  # a LayerNorm
    model, x = model_and_input(CenteredNorm(32), Bell())
    report = apply_lowmem(model, example_input=x)
    reasons = {e.name: e.detail for e in report.left_alone}
    assert reasons["act"].startswith("registered as SiLU (register_activation), but differs from it by up to ")
    assert reasons["norm"].startswith("registered as RMSNorm (register_norm), but differs from it by up to ")
    assert type(model.act) is Bell and type(model.norm) is CenteredNorm
    register_norm(CenteredNorm, "layer", weight="gain", bias=None, eps=0.5)  # the right kind, a wrong eps
    assert apply_lowmem(model, example_input=x).status("norm") == "left alone"
    register_norm(CenteredNorm, "layer", weight="gain", bias=None, eps=1e-5)
    assert apply_lowmem(model, example_input=x).status("norm") == "converted"


def test_registration_arguments_are_checked():
    with pytest.raises(TypeError, match="expected an nn.Module subclass"):
        register_activation(Squash(), like="silu")
    with pytest.raises(ValueError, match="register_activation: activation must be one of"):
        register_activation(Squash, like="relu")
    with pytest.raises(ValueError, match="kind must be one of \\('layer', 'rms'\\)"):
        register_norm(ScaledRMSNorm, "batch")
    with pytest.raises(ValueError, match="an RMSNorm has no bias"):
        register_norm(ScaledRMSNorm, "rms", weight="scale")
    with pytest.raises(ValueError, match="eps must be an attribute name or a positive number"):
        register_norm(ScaledRMSNorm, "rms", bias=None, eps=0)
    with pytest.raises(ValueError, match="weight must be a parameter name or None"):
        register_norm(ScaledRMSNorm, "rms", weight="a.b", bias=None)
    assert activations.REGISTERED == {} and norms.REGISTERED == {}


def test_a_registered_norm_is_kept_in_fp32_by_the_precision_plugin():
    class Odd(nn.Module):
        pass

    assert not is_norm(Odd())
    register_norm(Odd, "rms", bias=None)
    assert is_norm(Odd())


def test_an_activation_without_fitted_tables_is_an_error_at_fit_time_not_at_import():
    entry = Activation("softsign", "Softsign", F.softsign, pattern="softsign")
    assert entry.steps == {}
    with pytest.raises(
        ValueError,
        match="no 2-bit step derivative of Softsign has been fitted; run "
        "`python -m lightning_lowmem.approx --write --activations softsign`",
    ):
        entry.step_derivative(2)
    with pytest.raises(ValueError, match="a gated MLP needs the kernels' formulas"):
        Activation("softsign", "Softsign", F.softsign, gated="SoftGLU")


def test_the_generator_fits_a_new_entry_and_keeps_every_committed_table(monkeypatch, tmp_path):
    committed = list(ACTIVATIONS)
    monkeypatch.setitem(ACTIVATIONS, "softsign", Activation("softsign", "Softsign", F.softsign, pattern="softsign"))
    monkeypatch.setattr(generator, "TABLE_PATH", tmp_path / "step_tables.py")
    monkeypatch.setattr(sys, "argv", ["approx", "--write", "--bits", "1", "--activations", "softsign"])
    generator.main()
    tables = runpy.run_path(str(tmp_path / "step_tables.py"))["TABLES"]
    assert list(tables) == [*committed, "softsign"] and list(tables["softsign"]) == [1]
    for name in committed:
        assert tables[name] == generator.step_tables.TABLES[name]


def test_the_generator_refuses_an_unknown_activation():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_lowmem.approx", "--activations", "relu"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "unknown activations ['relu']" in result.stderr
