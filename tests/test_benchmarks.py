"""Every benchmark script runs end to end in its smoke mode and leaves RESULTS.md alone."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SMOKE = {
    "saved_bytes.py": ["--smoke"],
    "op_speed.py": ["--quick", "--repeats", "1"],
    "paper_tables.py": ["--smoke"],
    "parity.py": ["--smoke"],
    "gated_mlp.py": ["--smoke"],
    "budget.py": ["--smoke"],
    "qlora.py": ["--smoke"],
    "surgery.py": ["--smoke"],
    "dropout.py": ["--smoke"],
    "litgpt_vs_hf.py": ["--smoke"],
    "cross_entropy.py": ["--smoke"],
    "long_context.py": ["--smoke"],
    "long_context.py --timing": ["--timing", "--smoke"],
    "launches.py": ["--smoke"],
    "log_probs.py": ["--smoke"],
}


@pytest.mark.parametrize("script", SMOKE)
def test_benchmark_smoke(script, monkeypatch, capsys):
    results = BENCHMARKS / "RESULTS.md"
    before = results.read_text()
    path = script.split()[0]
    monkeypatch.setattr(sys, "argv", [path, *SMOKE[script]])
    runpy.run_path(str(BENCHMARKS / path), run_name="__main__")
    assert "|---" in capsys.readouterr().out  # printed a table
    assert results.read_text() == before


@pytest.fixture(autouse=True)
def _a_run_of_its_own(monkeypatch):
    """Each test is a benchmark run of its own: no spread or section remembered from another."""
    from benchmarks import common

    monkeypatch.setattr(common, "_worst_spread", 0.0)
    monkeypatch.setattr(common, "_found", {})


def _results(tmp_path: Path) -> Path:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n")
    return path


def _timed_run(monkeypatch, load: float, spread: float):
    """``benchmarks.common`` as a CPU benchmark run that took timings sees it: at this load, with this reference
    spread, on the native CPU code (its sections keep their keys; GPU timings are not checked)."""
    from benchmarks import common

    if common.torch.cuda.is_available():
        pytest.skip("GPU timings are not checked for CPU load")
    monkeypatch.setattr(common, "_timed", True)
    monkeypatch.setattr(common, "LOAD_AT_START", load)
    monkeypatch.setattr(common, "reference_spread", lambda: spread)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    return common


def test_timings_taken_on_a_busy_machine_are_not_written(tmp_path, monkeypatch, capsys):
    common = _timed_run(monkeypatch, load=1.7, spread=0.05)
    path = _results(tmp_path)
    assert not common.write_section("kernels", "| table |", "python -m benchmarks.op_speed", path)
    assert path.read_text() == "# Benchmark results\n"
    assert "1-minute load average was 1.70" in capsys.readouterr().err
    monkeypatch.setattr(common, "LOAD_AT_START", 0.1)
    monkeypatch.setattr(common, "reference_spread", lambda: 1.2)  # another process came and went
    assert not common.write_section("kernels", "| table |", "python -m benchmarks.op_speed", path)
    assert "spread is 120%" in capsys.readouterr().err


def test_a_run_that_turns_busy_takes_back_the_rows_it_wrote(tmp_path, monkeypatch, capsys):
    """A benchmark writing its section after every row: once a check finds the machine busy, the section is
    what the run found, and stays so when the machine is quiet again (the run's rows are no better)."""
    common = _timed_run(monkeypatch, load=0.1, spread=0.1)
    path = _results(tmp_path)
    path.write_text(path.read_text() + "\n<!-- surgery:begin -->\nlast quiet run\n<!-- surgery:end -->\n")
    found = path.read_text()
    for spread, written in ((0.1, True), (4.3, False), (0.1, False)):
        monkeypatch.setattr(common, "reference_spread", lambda spread=spread: spread)
        assert common.write_section("surgery", "| row |", "python benchmarks/surgery.py", path) == written
        assert ("| row |" in path.read_text()) == written
    assert path.read_text() == found and "spread is 430%" in capsys.readouterr().err


def test_quiet_timings_are_stamped_with_capability_and_load(tmp_path, monkeypatch):
    common = _timed_run(monkeypatch, load=0.12, spread=0.021)
    path = _results(tmp_path)
    assert common.write_section("kernels", "| table |", "python -m benchmarks.op_speed", path)
    capability = common.torch.backends.cpu.get_cpu_capability()
    assert f"ATen CPU capability {capability}" in path.read_text()
    assert f"CPU ({common.os.cpu_count()} cores), {common.cpu_model()}, " in path.read_text()
    assert "load 0.12 at start, reference spread 2.1%" in path.read_text()


def test_a_forced_capability_writes_a_section_of_its_own(tmp_path, monkeypatch):
    """Timings under ATEN_CPU_CAPABILITY=avx2 sit beside the native code's, never over them."""
    common = _timed_run(monkeypatch, load=0.1, spread=0.05)
    path = _results(tmp_path)
    assert common.write_section("kernels", "### Kernels\n\n| native |", "python -m benchmarks.op_speed", path)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert common.write_section("kernels", "### Kernels\n\n| avx2 |", "python -m benchmarks.op_speed", path)
    text = path.read_text()
    native = text[text.index("<!-- kernels:begin -->") : text.index("<!-- kernels:end -->")]
    forced = text[text.index("<!-- kernels-avx2:begin -->") : text.index("<!-- kernels-avx2:end -->")]
    assert "| native |" in native and "| avx2 |" not in native and "ATEN_CPU_CAPABILITY" not in native
    assert forced.splitlines()[1] == "### Kernels (ATEN_CPU_CAPABILITY=avx2)" and "| avx2 |" in forced
    assert "Command: `ATEN_CPU_CAPABILITY=avx2 python -m benchmarks.op_speed`" in forced


def test_a_busy_worker_process_taints_the_run_and_its_heap_setting_is_stamped(tmp_path, monkeypatch, capsys):
    """op_speed times in fresh worker processes: their reference spreads count in the busy check of the process
    writing the section, and its machine line says whether their glibc heap was kept."""
    from benchmarks import common

    if common.torch.cuda.is_available():
        pytest.skip("GPU timings are not checked for CPU load")
    path = _results(tmp_path)
    monkeypatch.setattr(common, "_timed", False)
    monkeypatch.setattr(common, "_steady_heap", None)
    monkeypatch.setattr(common, "LOAD_AT_START", 0.1)
    monkeypatch.setattr(common, "reference_spread", lambda: 0.05)  # quiet when the section is written
    common.record_worker_run(0.08, True)
    assert common.write_section("kernels", "| table |", "python -m benchmarks.op_speed", path)
    assert "reference spread 8.0%, glibc heap kept" in path.read_text()
    common.record_worker_run(0.9, True)  # busy while the second worker timed
    assert not common.write_section("kernels", "| table 2 |", "python -m benchmarks.op_speed", path)
    assert "spread is 90%" in capsys.readouterr().err and "| table" not in path.read_text()  # as the run found it


def test_op_speed_times_the_backward_alone_on_a_graph_of_its_own_input():
    """The retained graph of the "bwd" phase reads a copy of the input that no other timed function reads (so
    stock's saved input is as cold as the low-memory op's saved output), and gives the gradient of fwd+bwd."""
    import torch

    from benchmarks import op_speed

    x, g = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    inputs = []
    fns = op_speed.phases(lambda t: inputs.append(t) or torch.nn.functional.gelu(t), x, g)
    assert inputs[0] is not x and inputs[0].data_ptr() != x.data_ptr() and inputs[0].requires_grad
    torch.testing.assert_close(fns["bwd"]()[0], fns["fwd+bwd"]()[0], rtol=0, atol=0)
    assert inputs[-1] is x  # fwd+bwd runs on the input itself


def test_the_glibc_heap_is_kept_once_a_process_times_something(monkeypatch):
    from benchmarks import common

    monkeypatch.setattr(common, "_steady_heap", None)
    kept = []
    monkeypatch.setattr(common, "keep_freed_heap", lambda: kept.append(True) or True)
    common.interleaved_median({"a": lambda: None}, repeats=1, warmup=0)
    common.interleaved_median({"a": lambda: None}, repeats=1, warmup=0)
    assert kept == [True] and common.steady_heap() is True


def test_cpu_model_names_the_cpu_not_the_architecture(tmp_path):
    from benchmarks import common

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    assert common.cpu_model(cpuinfo) == "AMD EPYC 9654 96-Core Processor"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # e.g. an ARM machine: no model name
    assert common.cpu_model(cpuinfo) == (common.platform.processor() or common.platform.machine())
    assert common.cpu_model(tmp_path / "missing") == (common.platform.processor() or common.platform.machine())


def test_memory_numbers_need_no_quiet_machine(tmp_path, monkeypatch):
    from benchmarks import common

    path = _results(tmp_path)
    monkeypatch.setattr(common, "_timed", False)
    monkeypatch.setattr(common, "LOAD_AT_START", 5.0)
    assert common.write_section("saved_bytes", "| table |", "python benchmarks/saved_bytes.py", path)
    assert "| table |" in path.read_text() and "load" not in path.read_text()


def test_interleaved_rounds_alternate_which_function_runs_first():
    from benchmarks import common

    calls: list[str] = []
    common.interleaved_median({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=4, warmup=0)
    assert calls == ["a", "b", "b", "a", "b", "a", "a", "b"]


def test_interleaved_rounds_of_nine_functions_put_each_first_in_turn():
    """Cycling through permutations would run the same function first for 40320 rounds."""
    from benchmarks import common

    calls: list[str] = []
    common.interleaved_times({name: lambda name=name: calls.append(name) for name in "abcdefghi"}, 18, warmup=0)
    firsts = [calls[i] for i in range(0, len(calls), 9)]
    assert sorted(firsts) == sorted("abcdefghi" * 2)


def test_interleaved_rounds_of_three_functions_take_every_order_in_turn():
    from benchmarks import common

    calls: list[str] = []
    times = common.interleaved_times({name: lambda name=name: calls.append(name) for name in "abc"}, 6, warmup=0)
    rounds = {"".join(calls[i : i + 3]) for i in range(0, 18, 3)}
    assert rounds == {"abc", "acb", "bac", "bca", "cab", "cba"}
    assert {name: len(samples) for name, samples in times.items()} == {"a": 6, "b": 6, "c": 6}


def test_paired_ratio_is_the_median_of_the_per_round_ratios_within_its_interval():
    from benchmarks import common

    reference = [1.0, 2.0, 4.0, 1.0, 3.0, 2.0, 5.0]
    times = [1.1 * r for r in reference]
    assert common.paired_ratio(times, reference) == pytest.approx((1.1, 1.1, 1.1))  # drift cancels out round by round
    noisy = [r * f for r, f in zip(reference, (0.9, 1.3, 1.0, 1.1, 0.8, 1.2, 1.05))]
    median, low, high = common.paired_ratio(noisy, reference)
    assert median == pytest.approx(1.05)
    assert 0.8 <= low < median < high <= 1.3
    with pytest.raises(ValueError):  # samples of different rounds cannot be paired
        common.paired_ratio(noisy[:-1], reference)


def test_the_gpu_benchmark_forces_a_backend_for_the_ops_of_a_device_and_gives_it_back(monkeypatch):
    """benchmarks.gpu's ops stage times each backend in one process: the ops follow the forced variable inside the
    block and the default after it, also when the forced backend cannot run (shown on the CPU: no GPU needed)."""
    import torch

    from benchmarks import gpu
    from lightning_lowmem import kernels
    from lightning_lowmem.kernels import library, torch_ops

    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    cpu = torch.device("cpu")
    with gpu.forced_backend("torch", cpu):
        assert kernels.implementation(cpu) is torch_ops and not kernels.autograd_in_cpp(torch.empty(0, device=cpu))
    assert kernels.implementation(cpu) is library.OPS and kernels.autograd_in_cpp(torch.empty(0, device=cpu))
    monkeypatch.setattr(kernels, "_triton_unusable", lambda device: "no Triton here")
    assert gpu.usable_backends(cpu) == ["cpp"]  # triton refused with its reason, the choice given back
    assert kernels.implementation(cpu) is library.OPS


def test_a_slow_converted_step_is_explained_by_the_ops_whose_time_grew_most():
    from benchmarks.gpu.models import profile_table

    stock = {"aten::mm": (10, 0.010), "aten::gelu": (2, 0.002), "aten::native_dropout": (4, 0.001)}
    converted = {"aten::mm": (10, 0.010), "lowmem::act_codes": (2, 0.003), "aten::native_dropout": (4, 0.0005)}
    table = profile_table({"stock": stock, "converted": converted}, rows=2).splitlines()
    assert table[2] == "| `lowmem::act_codes` | 0 | 0.00 | 2 | 3.00 | +3.00 |"  # grew most: first
    assert table[3].startswith("| `aten::mm` |") and table[-1] == "| all |  | 13.00 |  | 13.50 | +0.50 |"
    assert len(table) == 2 + 2 + 1


def test_the_gpu_command_rehearses_on_the_cpu_writing_each_stage_as_it_goes(tmp_path, capsys, monkeypatch):
    """``python -m benchmarks.gpu --smoke``: every stage but the slow ones (tests only collected, ops timed) runs on
    tiny shapes and leaves its file; a stage that fails is written down and the next one runs."""
    from benchmarks import gpu

    results = BENCHMARKS / "RESULTS.md"
    before = results.read_text()
    stages = ["environment", "kernels", "overhead", "models", "long_context", "graphs"]
    gpu.main(["--smoke", "--out", str(tmp_path), "--stages", *stages])
    written = {path.name: path.read_text() for path in tmp_path.glob("*.md")}
    assert set(written) == {f"{gpu.STAGES.index(stage):02d}-{stage}.md" for stage in stages}
    assert {path.name for path in tmp_path.iterdir()} == {*written, "progress.log"}  # nothing the device would drop
    assert len(gpu.SHORT) + 1 <= gpu.FILES_RETURNED  # a run of more stages is refused
    assert all("done in" in text for text in written.values()), capsys.readouterr().out
    kernels = written["02-kernels.md"]
    assert "(in the background):" in kernels and "backend: cpu tensors -> " in kernels  # the prebuild's output
    assert "| cpp | norm_backward | float32 |" in kernels and "| triton | cross_entropy_grad_ | bfloat16 |" in kernels
    overhead = written["03-overhead.md"]  # host time per call, on each backend the CPU runs
    assert "| LoRA A with dropout 0.05 | cpp |" in overhead and "| SwiGLU product | triton |" in overhead
    models = written["04-models.md"]  # a smoke run always profiles: the path a slow converted step takes
    assert models.count("Where the time went in") == 4 and models.count("\n| all |") == 4, models
    assert "| converted, compiled / eager |" in models and "not on a CPU" in written["06-graphs.md"]  # CUDA graphs
    assert "predicted **" in written["05-long_context.md"] and results.read_text() == before
    logged = [line.split(" ", 1)[1] for line in (tmp_path / "progress.log").read_text().splitlines()]
    assert logged[:2] == ["extensions: building in the background", "environment: started"]
    assert logged[2].startswith("environment: done in")

    def broken(run, emit):
        raise RuntimeError("broken on purpose")

    monkeypatch.setitem(gpu.RUNNERS, "environment", broken)
    gpu.main(["--smoke", "--out", str(tmp_path / "again"), "--stages", "environment", "kernels"])
    assert "FAILED" in (tmp_path / "again" / "00-environment.md").read_text()
    assert "broken on purpose" in (tmp_path / "again" / "00-environment.md").read_text()
    assert "done in" in (tmp_path / "again" / "02-kernels.md").read_text()


def test_a_forced_cpu_capability_gets_its_own_inductor_cache_and_onednn_cap(monkeypatch):
    """A default run's compiled graphs served to an ``ATEN_CPU_CAPABILITY=avx2`` run segfault (the FX graph cache
    key leaves out the vector ISA): a forced capability compiles into a cache of its own."""
    from benchmarks.forced_capability import emulate

    for name in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    emulate()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and "ONEDNN_MAX_CPU_ISA" not in os.environ
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    emulate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("_avx2") and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/chosen")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    emulate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/chosen" and "ONEDNN_MAX_CPU_ISA" not in os.environ


def test_a_busy_machine_is_named_before_the_timings_start(monkeypatch, capsys):
    """A full op benchmark runs 25 minutes: the warning that its timings will not be written comes first."""
    common = _timed_run(monkeypatch, load=1.7, spread=0.05)
    common.warn_if_busy()
    assert "1-minute load average was 1.70" in capsys.readouterr().err
    monkeypatch.setattr(common, "LOAD_AT_START", 0.1)
    common.warn_if_busy()
    assert capsys.readouterr().err == ""
