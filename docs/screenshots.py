"""Serve a built copy of this site locally and look at it with headless Chromium.

    python docs/screenshots.py                 # build the site, photograph three pages into /work/notes/docs-*.png
    python docs/screenshots.py --out DIR --site SITE_DIR   # an already built site, pictures elsewhere

``tests/test_docs.py`` uses :func:`serve` and :func:`load` to open every page: each must load with its images and
styles found and no script error.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"home": "", "guide": "guides/lightning/", "api": "api/"}  # what the screenshots show
CHECK = "__check__.html"  # a page of the server's own: opens a page in a frame and reports its images


class Site:
    """A running local server: its ``url`` and every request it answered with an error (``failures``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.failures: list[str] = []


_CHECK_PAGE = """<!doctype html><html><body><pre id="result">pending</pre>
<iframe id="page" src="{src}" style="width:1280px;height:1600px"></iframe>
<script>
document.getElementById("page").addEventListener("load", function () {{
  var doc = this.contentDocument, broken = [];
  for (var img of doc.images) {{ if (!img.complete || img.naturalWidth === 0) broken.push(img.src); }}
  document.getElementById("result").textContent =
    "title=" + doc.title + "\\nimages=" + doc.images.length + "\\nbroken=" + JSON.stringify(broken);
}});
</script></body></html>"""


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[Site]:
    """``python -m http.server``'s handler over ``directory`` on a free local port, in a thread, for the duration."""
    site: Site

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/" + CHECK):
                src = self.path.partition("?")[2] or "/"
                body = _CHECK_PAGE.format(src=src).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            super().do_GET()

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            if isinstance(code, int) and code >= 400 or str(code).startswith(("4", "5")):
                site.failures.append(f"{code} {self.path}")

        def log_message(self, format: str, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(directory)))
    site = Site(f"http://127.0.0.1:{server.server_address[1]}/")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield site
    finally:
        server.shutdown()
        server.server_close()


def chromium() -> str | None:
    """The Chromium binary on this machine, if any."""
    return next(
        (found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None
    )


def _command(*args: str) -> list[str]:
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("no chromium binary on PATH")
    profile = tempfile.mkdtemp(prefix="chromium-")
    return [
        binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
        f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args,
    ]  # fmt: skip


def load(site: Site, page: str, timeout: float = 120) -> tuple[str, str]:
    """Open ``page`` (a path under the site) in headless Chromium, inside the server's checking frame; returns the
    frame's report (title, number of images, the broken ones) and Chromium's log (console messages included)."""
    url = f"{site.url}{CHECK}?/{page}"
    run = subprocess.run(
        _command("--virtual-time-budget=10000", "--dump-dom", url),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    report = run.stdout.partition('<pre id="result">')[2].partition("</pre>")[0]
    return report, run.stderr


def console_errors(log: str) -> list[str]:
    """The lines of Chromium's log that are script errors or console messages of the page: Chromium logs every
    console message at one level (``INFO:CONSOLE``), ``console.error``'s too, and these pages write none."""
    return [line for line in log.splitlines() if "Uncaught" in line or ":CONSOLE" in line]


def screenshot(site: Site, page: str, path: Path, timeout: float = 120) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        _command(f"--screenshot={path}", "--window-size=1280,1600", "--hide-scrollbars", f"{site.url}{page}"),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def build(directory: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(directory)]
    subprocess.run(command, cwd=ROOT, check=True, env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/work/notes"), help="where docs-<page>.png go")
    parser.add_argument("--site", type=Path, help="an already built site (default: build one now)")
    args = parser.parse_args()
    directory = args.site or Path(tempfile.mkdtemp(prefix="site-"))
    if args.site is None:
        build(directory)
    with serve(directory) as site:
        for name, page in PAGES.items():
            path = args.out / f"docs-{name}.png"
            screenshot(site, page, path)
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
