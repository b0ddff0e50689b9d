"""The activation-memory gate: the committed baseline holds, an injected regression fails readably."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from lightning_lowmem import apply_lowmem
from lightning_lowmem.memcheck import BASELINE, Case, ConfigError, check, compare, load_baseline, measure
from lightning_lowmem.memcheck.__main__ import main
from lightning_lowmem.memcheck.cases import CASES, llama

USER_CASES = """
import torch
from torch import nn
from lightning_lowmem.memcheck import Case

def toy():
    return nn.Sequential(nn.Linear(16, {width}), nn.GELU(), nn.Linear({width}, 4)), torch.randn(8, 16)

CASES = [Case("toy/fp32", toy), Case("toy/lowmem-bf16", toy, "bf16-mixed", lowmem=True)]
"""


def test_reference_llama_matches_the_committed_baseline():
    result = check([case for case in CASES if case.name.startswith("llama/")])
    assert result.ok, result.text


def test_baseline_shows_the_method_and_the_plugin_at_work():
    figures = load_baseline(BASELINE)
    assert {case.name for case in CASES} == set(figures)
    for model in ("vit", "llama"):
        for precision in ("32-true", "bf16-mixed", "bf16-true"):
            assert figures[f"{model}/lowmem/{precision}"] < 0.75 * figures[f"{model}/stock/{precision}"]
    # one cast output shared by q, k, v, gate and up instead of a copy each
    assert figures["llama/lowmem-precision/bf16-mixed"] < figures["llama/stock/bf16-mixed"]
    # labels: stock adds its fp32 logits (4 x 128 tokens x 512 classes); the fused head adds one bf16 gradient of
    # its input (4 x 128 x 128), no logits
    added = {m: figures[f"llama_lora_labels/{m}/bf16-mixed"] - figures[f"llama_lora_dropout/{m}/bf16-mixed"]
             for m in ("stock", "lowmem")}  # fmt: skip
    assert added["stock"] >= 4 * 128 * 512 * 4 and added["lowmem"] == 4 * 128 * 128 * 2


def test_injected_regression_fails_with_a_readable_diff():
    """LowMemBP silently not converting the model: the case grows and the gate names it."""
    regressed = Case("llama/lowmem/32-true", llama, "32-true", lowmem=False)
    result = check([regressed])
    assert not result.ok
    row = next(line for line in result.text.splitlines() if line.startswith("llama/lowmem/32-true"))
    figures = load_baseline(BASELINE)
    growth = 100 * (figures["llama/stock/32-true"] / figures["llama/lowmem/32-true"] - 1)  # the stock model's size
    assert "REGRESSION" in row and f"{growth:+.1f}%" in row
    assert "grew beyond 1% of the baseline" in result.text and "--update" in result.text


def test_compare_tolerance_and_missing_entries():
    assert compare({"a": 1010}, {"a": 1000}, tolerance=0.01).ok
    assert not compare({"a": 1011}, {"a": 1000}, tolerance=0.01).ok
    smaller = compare({"a": 500}, {"a": 1000})
    assert smaller.ok and "smaller" in smaller.text
    missing = compare({"new": 1}, {})
    assert not missing.ok and "NOT IN BASELINE" in missing.text


def test_user_wiring_from_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cases_v1.py").write_text(textwrap.dedent(USER_CASES.format(width=32)))
    (tmp_path / "cases_v2.py").write_text(textwrap.dedent(USER_CASES.format(width=64)))
    baseline = tmp_path / "baseline.json"
    common = ["--baseline", str(baseline)]

    assert main(["--cases", "cases_v1:CASES", *common]) == 2  # no baseline yet: a configuration error
    assert "does not exist; write it with --update" in capsys.readouterr().err
    assert main(["--cases", "cases_v1:CASES", "--update", *common]) == 0
    assert set(json.loads(baseline.read_text())["cases"]) == {"toy/fp32", "toy/lowmem-bf16"}
    assert main(["--cases", "cases_v1:CASES", *common]) == 0
    capsys.readouterr()

    assert main(["--cases", "cases_v2:CASES", *common]) == 1  # the hidden layer doubled
    out = capsys.readouterr().out
    assert "toy/fp32" in out and "REGRESSION" in out


def test_measure_matches_the_report_of_apply_lowmem():
    case = Case("toy", _toy, "32-true", lowmem=True)
    torch.manual_seed(0)
    model, example = _toy()
    report = apply_lowmem(model, example_input=example)
    assert measure(case) == report.saved_bytes_after == 8 * 16 * 4 + 8 * 32 // 4 + 8 * 32 * 4  # input, codes, fc2 in


def _toy():
    import torch
    from torch import nn

    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)), torch.randn(8, 16)


def test_configuration_errors_exit_2_naming_the_file_and_the_fix(tmp_path, capsys):
    """Not a regression (exit 1): CI must tell a broken set-up from a memory growth."""
    baseline = tmp_path / "baseline.json"
    cases = "lightning_lowmem.memcheck.cases:CASES"
    for content, says in [
        ("{not json", "is not a memcheck baseline (JSONDecodeError"),
        ('{"cases": {"a": {"bytes": 1}}}', "is not a memcheck baseline (KeyError"),
        ('{"cases": []}', "is not a memcheck baseline (AttributeError"),
    ]:
        baseline.write_text(content)
        assert main(["--cases", cases, "--baseline", str(baseline), "--only", "vit/stock/32-true"]) == 2
        err = capsys.readouterr().err
        assert str(baseline) in err and says in err and "--update" in err
    for spec, says in [
        ("no_colon", "must look like 'package.module:CASES'"),
        ("no_such_module_xyz:CASES", "cannot load the cases (ModuleNotFoundError"),
        ("lightning_lowmem.memcheck.cases:NOPE", "cannot load the cases (AttributeError"),
        ("lightning_lowmem.memcheck:BASELINE", "cannot load the cases (TypeError"),
    ]:
        assert main(["--cases", spec]) == 2
        assert says in capsys.readouterr().err


def test_a_baseline_is_read_before_anything_is_measured(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        check([Case("never/measured", lambda: 1 / 0)], tmp_path / "missing.json")
