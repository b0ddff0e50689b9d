"""The documentation site (``mkdocs.yml``, ``docs/``): it builds with ``mkdocs build --strict``, documents every public
name, its picture shows what the code measures, and every page loads in a browser with its images and no script
error. Its Python examples run under ``pytest --markdown-docs docs`` (the README's test command)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("transformers", reason="the API page documents lightning_lowmem.hf")

import lightning_lowmem
import lightning_lowmem.hf

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _script(name: str):
    """``docs/<name>.py``, imported (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built strictly (warnings are errors: broken links and anchors, missing references)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert run.returncode == 0, run.stderr[-6000:]
    return out


def pages(site: Path) -> list[str]:
    return sorted(str(p.relative_to(site).parent) + "/" for p in site.rglob("index.html"))


def test_the_site_builds_strictly_with_every_page_and_the_results(site):
    built = {page.replace("./", "") for page in pages(site)}
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    expected = {"" if md == "index.md" else md.removesuffix(".md") + "/" for md in nav}
    assert expected <= built, expected - built
    assert {md.removeprefix("docs/") for md in map(str, (p.relative_to(ROOT) for p in DOCS.rglob("*.md")))} == set(nav)
    results = (site / "results" / "index.html").read_text()
    for line in ("Command: <code>python benchmarks/real_scale.py</code>", "Benchmark results"):
        assert line in results  # RESULTS.md itself, included at build time with its machine and command lines


def test_every_public_name_has_an_api_entry_and_a_docstring(site):
    html = (site / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="([^"]+)"', html))
    names = [("lightning_lowmem", n, getattr(lightning_lowmem, n)) for n in lightning_lowmem.__all__]
    names += [("lightning_lowmem.hf", n, getattr(lightning_lowmem.hf, n)) for n in lightning_lowmem.hf.__all__]
    for module, name, obj in names:
        assert f"{module}.{name}" in anchors, f"{module}.{name} has no entry in docs/api.md"
        assert (inspect.getdoc(obj) or "").strip(), f"{module}.{name} has no docstring"
    for module in ("lightning_lowmem.functional", "lightning_lowmem.nn", "lightning_lowmem.memory"):
        for name in importlib.import_module(module).__all__:
            assert f"{module}.{name}" in anchors, f"{module}.{name} is not rendered"


def test_the_figure_shows_what_the_code_measures():
    figures = _script("figures")
    committed = figures.read(figures.SVG.read_text())
    fresh = figures.read(figures.draw(figures.measure()))
    assert committed and committed == fresh, "docs/img/block.svg is stale: run python docs/figures.py"
    stock, converted = committed[("whole block", "stock")], committed[("whole block", "converted")]
    assert converted < stock
    assert "img/block.svg" in (DOCS / "how-it-works.md").read_text()


def test_every_page_loads_in_chromium_with_its_images_and_no_script_error(site):
    shots = _script("screenshots")
    if shots.chromium() is None:
        pytest.skip("no chromium binary")
    with shots.serve(site) as server:
        for page in pages(site):
            page = page.removeprefix("./")
            report, log = shots.load(server, page)
            assert report.startswith("title="), (page, report, log[-3000:])
            assert "broken=[]" in report, (page, report)
            assert not shots.console_errors(log), (page, shots.console_errors(log))
        failures = [f for f in server.failures if not f.endswith("/favicon.ico")]
        assert not failures, failures  # every stylesheet, script, image and page linked was found
    if os.environ.get("LOWMEM_DOCS_SCREENSHOTS"):  # the pictures for a review: LOWMEM_DOCS_SCREENSHOTS=/work/notes
        with shots.serve(site) as server:
            for name, page in shots.PAGES.items():
                shots.screenshot(server, page, Path(os.environ["LOWMEM_DOCS_SCREENSHOTS"]) / f"docs-{name}.png")
