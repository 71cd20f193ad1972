"""The HTML report in a real headless Chromium (Debian's `chromium`, driven by the `playwright`
package with `executable_path`, never a browser download of its own): no console errors, one
chart mark per weight kind per layer, sorting by SQNR puts the worst weight first, filtering
keeps only matches, a finding's link finds its row, and 1280x800 screenshots kept for CI (the
paths are printed; `$QTOOL_ARTIFACTS` chooses the folder). Skipped, with the reason, where
Chromium or playwright is missing (`.ci/run` installs both).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from urllib.parse import unquote

import pytest

from qtool.comparison import Gates
from qtool.html_report import render_check, render_compare
from tests.conftest import SAMPLES
from tests.synthetic_reports import synthetic_comparison

CHROMIUM = os.environ.get("QTOOL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# as the issue asks: no sandbox (root in CI), no GPU, and nothing that tries the network
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (apt-get install chromium; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (pip install -e '.[test]')")
    with sync_api.sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("QTOOL_ARTIFACTS") or tmp_path_factory.mktemp("artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Opened:
    def __init__(self, browser, path: Path, scheme: str = "light") -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 800}, color_scheme=scheme)
        self.problems: list[str] = []
        self.page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.problems.append(f"request: {r.url}") if not r.url.startswith("file:") else None)
        self.page.goto(path.as_uri())
        self.page.wait_for_function("() => document.documentElement.dataset.ready", timeout=20_000)
        assert self.page.evaluate("document.documentElement.dataset.ready") == "1"

    def rows(self) -> list[dict]:
        """The table rows drawn now: name and each cell's exact value (data-value) or text."""
        return self.page.evaluate(
            """() => [...document.querySelectorAll('#weights-table tbody tr:not(.spacer)')].map(tr => ({
                name: tr.dataset.name,
                cells: [...tr.cells].map(td => td.dataset.value !== undefined ? Number(td.dataset.value) : td.textContent)}))"""
        )

    def column(self, key: str) -> int:
        return self.page.evaluate("(key) => [...document.querySelectorAll('#weights-table thead th')].findIndex(th => th.dataset.key === key)", key)

    def marks(self) -> list[tuple[str, str, str]]:
        return [tuple(m) for m in self.page.evaluate("() => [...document.querySelectorAll('svg.depth .mark')].map(g => [g.dataset.series, g.dataset.layer, g.dataset.kind])")]

    def shot(self, artifacts: Path, name: str) -> Path:
        path = artifacts / name
        self.page.screenshot(path=str(path))
        print(f"screenshot: {path}")
        return path


@pytest.fixture(scope="module")
def tiny_compare(tmp_path_factory) -> tuple[Path, dict]:
    """tiny-llama against its W4A16 version, with a gate one weight breaks."""
    from qtool import api

    folder = tmp_path_factory.mktemp("browser")
    api.quantize(SAMPLES / "tiny-llama", folder / "w4", "W4A16")
    document = api.compare(SAMPLES / "tiny-llama", folder / "w4").to_json(Gates(min_sqnr=19.05))
    path = folder / "compare.html"
    path.write_text(render_compare([document]))
    return path, document


def test_compare_report_in_chromium(browser, tiny_compare, artifacts):
    path, document = tiny_compare
    opened = Opened(browser, path)
    page = opened.page
    measured = [w for w in document["weights"] if w["sqnr_db"] is not None]
    marks = opened.marks()
    assert len(marks) == len(set(marks))  # one mark per kind per layer
    assert {(int(layer), kind) for _, layer, kind in marks} == {(w["layer"], w["kind"]) for w in measured}
    # the drawn rows carry the JSON's figures
    sqnr, max_abs = opened.column("sqnr_db@0"), opened.column("max_abs_err@0")
    by_name = {w["name"]: w for w in document["weights"]}
    rows = opened.rows()
    assert len(rows) == len(document["weights"])
    for row in rows:
        weight = by_name[row["name"]]
        if weight["sqnr_db"] is not None:
            assert row["cells"][sqnr] == weight["sqnr_db"] and row["cells"][max_abs] == weight["max_abs_err"]
    # sorting by SQNR: the worst first; again: the exact copies first
    worst = min(measured, key=lambda w: w["sqnr_db"])
    page.click("#weights-table th[data-key='sqnr_db@0'] button")
    assert opened.rows()[0]["name"] == worst["name"]
    assert page.get_attribute("#weights-table th[data-key='sqnr_db@0']", "aria-sort") == "ascending"
    page.click("#weights-table th[data-key='sqnr_db@0'] button")
    assert by_name[opened.rows()[0]["name"]]["exact"]
    page.click("#weights-table th[data-key='sqnr_db@0'] button")
    # filtering by name keeps only the matches
    page.fill("#filter", "down_proj")
    page.wait_for_function("() => document.querySelectorAll('#weights-table tbody tr:not(.spacer)').length === 2")
    assert [r["name"] for r in opened.rows()] == sorted((w["name"] for w in measured if "down_proj" in w["name"]), key=lambda n: by_name[n]["sqnr_db"])
    assert page.text_content("#row-count") == "2 of 21 weights match"
    page.fill("#filter", "")
    page.wait_for_function("() => document.querySelectorAll('#weights-table tbody tr:not(.spacer)').length === 21")
    # a mark in the chart finds its row
    page.click("svg.depth .mark[data-kind='o'][data-layer='0']")
    assert page.evaluate("document.querySelector('#weights-table tr.target').dataset.name") == "model.layers.0.self_attn.o_proj.weight"
    page.evaluate("window.scrollTo(0, 0)")
    opened.shot(artifacts, "compare-1280x800.png")
    assert not opened.problems
    page.close()


def test_overlay_with_experts_in_dark_mode(browser, tmp_path, artifacts):
    """Two candidates over one base, a mixture of 40 experts a layer: experts are one mark per
    layer and series, the table keeps every row but draws a screenful."""
    documents = [synthetic_comparison(24, 40, b="rtn/"), synthetic_comparison(24, 40, seed=1, b="gptq/")]
    path = tmp_path / "overlay.html"
    path.write_text(render_compare(documents))
    opened = Opened(browser, path, scheme="dark")
    page = opened.page
    marks = opened.marks()
    assert len(marks) == len(set(marks))
    for series, document in enumerate(documents):
        expected = {(str(series), str(w["layer"]), w["kind"]) for w in document["weights"] if w["sqnr_db"] is not None}
        assert {m for m in marks if m[0] == str(series)} == expected
    assert sum(1 for m in marks if m[2] == "experts") == 2 * 24
    total = len(documents[0]["weights"])
    assert page.text_content("#row-count") == f"{total:,} weights"
    drawn = len(opened.rows())
    assert 10 < drawn < 200  # a screenful, not 3,000 rows
    page.click("#weights-table th[data-key='sqnr_db@1'] button")
    worst = min((w for w in documents[1]["weights"] if w["sqnr_db"] is not None), key=lambda w: w["sqnr_db"])
    assert opened.rows()[0]["name"] == worst["name"]
    page.evaluate("document.getElementById('table-scroll').scrollTop = 1e9")  # to the end: the last rows are drawn
    page.wait_for_timeout(200)
    last = sorted((w for w in documents[1]["weights"]), key=lambda w: (w["finding"] is None, 1 if w["exact"] else 0, w["sqnr_db"] or 0))[-1]
    assert by_status(documents[1], opened.rows()[-1]["name"]) == by_status(documents[1], last["name"])
    page.evaluate("window.scrollTo(0, 0)")
    opened.shot(artifacts, "overlay-experts-dark-1280x800.png")
    assert not opened.problems
    page.close()


def by_status(document: dict, name: str) -> str:
    weight = next(w for w in document["weights"] if w["name"] == name)
    return "exact" if weight["exact"] else "measured"


def test_check_finding_links_to_its_row(browser, tmp_path, artifacts):
    from qtool import api
    from qtool.audit import CheckRules

    document = api.check(SAMPLES / "tiny-llama-w4a16", CheckRules(expect_scheme="W8A16")).to_json()
    path = tmp_path / "check.html"
    path.write_text(render_check(document))
    opened = Opened(browser, path)
    page = opened.page
    last = document["findings"][-1]
    page.fill("#filter", "embed")  # the link still finds a row the filter hides
    page.click(f"#problems li:nth-child({len(document['findings'])}) a")
    page.wait_for_function("() => document.querySelector('#weights-table tr.target')")
    assert page.evaluate("document.querySelector('#weights-table tr.target').dataset.name") == last["weight"]
    assert unquote(page.evaluate("location.hash")) == f"#weight={last['weight']}"
    opened.shot(artifacts, "check-1280x800.png")
    assert not opened.problems
    json.dumps(document)
    page.close()
