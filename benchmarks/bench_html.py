"""Benchmark the HTML report (issue 23): its size and its time to first render in Chromium.

Two `compare --json` documents of made-up models, built by the real document code
(`tests/synthetic_reports.py`): a LLaMA-shaped model of 1,002 weights (111 layers), and a
mixture of 40 layers x 500 experts (60,000 expert weights, 60,283 in all). Each is rendered by
`qtool.html_report.render_compare` (timed, median of --repeats) and opened --repeats times in
Debian's headless Chromium through playwright, each time in a fresh page:

  report    the report file; time to first render = the page's `qtool-table-drawn` mark (the
            header, the SVG charts and the first screenful of the table drawn), from
            navigation start
  baseline  a page of the same byte size holding the same payload as an inert data block and a
            heading (what the browser costs to read that many bytes), to its load event

Targets (the issue's): under 5 MB, and under 2 s to first render, for both. The ratio
report / baseline says what the page's own work adds on top of reading its bytes.

    python benchmarks/bench_html.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.synthetic_reports import synthetic_comparison  # noqa: E402

FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SIZE_LIMIT = 5_000_000
TIME_LIMIT_S = 2.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chromium", default=os.environ.get("QTOOL_CHROMIUM") or shutil.which("chromium"))
    args = p.parse_args(argv)
    if not args.chromium:
        print("no chromium: apt-get install chromium", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    from qtool.html_report import render_compare

    cases = {"1,002 weights (111 layers)": (111, 0), "60,283 weights (40 layers x 500 experts)": (40, 500)}
    work = Path(tempfile.mkdtemp(prefix="bench-html-"))
    rows = []
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=args.chromium, args=FLAGS, headless=True)
        for label, (layers, experts) in cases.items():
            document = synthetic_comparison(layers, experts)
            renders = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                page_text = render_compare([document])
                renders.append(time.perf_counter() - started)
            report = work / f"report-{layers}-{experts}.html"
            report.write_text(page_text, encoding="utf-8")
            size = report.stat().st_size
            payload = page_text[page_text.index('<script type="application/octet-stream"') :]
            filler = "x" * max(0, size - len(payload.encode()) - 200)
            baseline = work / f"baseline-{layers}-{experts}.html"
            baseline.write_text(
                f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>baseline</title></head><body><h1>baseline</h1><!--{filler}-->{payload.split('</script>')[0]}</script></body></html>"
            )
            report_times, baseline_times = [], []
            for _ in range(args.repeats):  # interleaved, each in a fresh page
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(baseline.as_uri(), wait_until="load")
                baseline_times.append(
                    page.evaluate("() => performance.getEntriesByType('navigation')[0].loadEventEnd") / 1000
                )
                page.close()
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(report.as_uri())
                page.wait_for_function("() => document.documentElement.dataset.ready === '1'", timeout=60_000)
                report_times.append(
                    page.evaluate("() => performance.getEntriesByName('qtool-table-drawn')[0].startTime") / 1000
                )
                page.close()
            rows.append(
                (
                    label,
                    size,
                    statistics.median(renders),
                    statistics.median(report_times),
                    statistics.median(baseline_times),
                )
            )
        browser.close()
    shutil.rmtree(work, ignore_errors=True)
    print(f"Chromium {args.chromium}, median of {args.repeats}")
    print("| model | file size | Python render | first render in Chromium | same-size baseline | report / baseline |")
    print("|---|---|---|---|---|---|")
    for label, size, render, first, base in rows:
        print(
            f"| {label} | {size / 1e6:.2f} MB | {render:.2f} s | {first:.3f} s | {base:.3f} s | {first / base:.1f}× |"
        )
    print()
    for label, size, _, first, _ in rows:
        print(
            f"{label}: size {'PASS' if size < SIZE_LIMIT else 'FAIL'} (< 5 MB), first render {'PASS' if first < TIME_LIMIT_S else 'FAIL'} (< 2 s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
