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
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (apt-get install chromium; .ci/run installs it)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the playwright package is not installed (pip install -e '.[test]')"
    )
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
        self.page.on(
            "console",
            lambda m: self.problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None,
        )
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on(
            "request", lambda r: self.problems.append(f"request: {r.url}") if not r.url.startswith("file:") else None
        )
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
        return self.page.evaluate(
            "(key) => [...document.querySelectorAll('#weights-table thead th')].findIndex(th => th.dataset.key === key)",
            key,
        )

    def marks(self) -> list[tuple[str, str, str]]:
        return [
            tuple(m)
            for m in self.page.evaluate(
                "() => [...document.querySelectorAll('svg.depth .mark')].map(g => [g.dataset.series, g.dataset.layer, g.dataset.kind])"
            )
        ]

    def shot(self, artifacts: Path, name: str) -> Path:
        path = artifacts / name
        self.page.screenshot(path=str(path))
        print(f"screenshot: {path}")
        return path


def outside_cards(opened: Opened) -> list[str]:
    """Every text, chart or box of a card (`main > section`) that reaches past the card's sides,
    described; the weights table scrolls inside its own frame and is left out."""
    return opened.page.evaluate(
        """() => {
          const out = [];
          for (const card of document.querySelectorAll('main > section')) {
            const box = card.getBoundingClientRect();
            for (const el of card.querySelectorAll('text, h2, h3, p, dt, dd, li, span, div, th, td, svg')) {
              if (el.closest('.table-scroll')) continue;  // the table scrolls inside its frame (checked apart)
              const r = el.getBoundingClientRect();
              if (r.width === 0 && r.height === 0) continue;
              if (r.left < box.left - 0.5 || r.right > box.right + 0.5)
                out.push(`${card.id}: ${el.tagName} "${el.textContent.slice(0, 60)}" spans ${Math.round(r.left)}..${Math.round(r.right)}, card ${Math.round(box.left)}..${Math.round(box.right)}`);
            }
          }
          return out;
        }"""
    )


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
    assert [r["name"] for r in opened.rows()] == sorted(
        (w["name"] for w in measured if "down_proj" in w["name"]), key=lambda n: by_name[n]["sqnr_db"]
    )
    assert page.text_content("#row-count") == "2 of 21 weights match"
    page.fill("#filter", "")
    page.wait_for_function("() => document.querySelectorAll('#weights-table tbody tr:not(.spacer)').length === 21")
    # a mark in the chart finds its row
    page.click("svg.depth .mark[data-kind='o'][data-layer='0']")
    assert (
        page.evaluate("document.querySelector('#weights-table tr.target').dataset.name")
        == "model.layers.0.self_attn.o_proj.weight"
    )
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
    last = sorted(
        (w for w in documents[1]["weights"]),
        key=lambda w: (w["finding"] is None, 1 if w["exact"] else 0, w["sqnr_db"] or 0),
    )[-1]
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


# -- issue 42 #23: the report at 1280 px with a real model (all-MiniLM-L6-v2) ----------------------


def _minilm_source() -> Path:
    import sys

    sys.path.insert(0, str(SAMPLES))
    try:
        from real_models import Unavailable, minilm
    finally:
        sys.path.remove(str(SAMPLES))
    try:
        return minilm()
    except Unavailable as exc:
        pytest.skip(str(exc))


def _qtool(*argv) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, argv)], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def minilm_reports(tmp_path_factory) -> dict[str, Path]:
    """The pages the issue saw, written by the CLI: MiniLM against its W4A16 and int8 versions
    (one candidate, then both overlaid), the quantize report and a check report."""
    source = _minilm_source()
    folder = tmp_path_factory.mktemp("minilm")
    pages = {name: folder / f"{name}.html" for name in ("quantize", "one", "two", "check")}
    _qtool("quantize", source, "-o", folder / "w4", "--scheme", "W4A16", "--html", pages["quantize"])
    _qtool("quantize", source, "-o", folder / "w8", "--scheme", "int8")
    _qtool("compare", source, folder / "w4", "--html", pages["one"])
    _qtool("compare", source, folder / "w4", folder / "w8", "--html", pages["two"])
    _qtool("check", folder / "w4", "--expect-scheme", "W4A16", "--html", pages["check"])
    return pages


def _every_row(opened: Opened) -> list[dict]:
    """Every row of the table as drawn, collected by scrolling it from top to bottom (the table
    draws a screenful at a time): each row once, in order, with its cells' text."""
    page = opened.page
    seen: dict[int, dict] = {}
    page.evaluate("document.getElementById('table-scroll').scrollTop = 0")
    for _ in range(1000):
        page.wait_for_timeout(30)
        for row in page.evaluate(
            """() => [...document.querySelectorAll('#weights-table tbody tr:not(.spacer)')].map(tr => ({
                row: Number(tr.dataset.row), name: tr.dataset.name, cells: [...tr.cells].map(td => td.textContent)}))"""
        ):
            seen.setdefault(row["row"], row)
        done = page.evaluate(
            """() => { const s = document.getElementById('table-scroll');
                       if (s.scrollTop + s.clientHeight >= s.scrollHeight - 1) return true;
                       s.scrollTop += s.clientHeight / 2; return false; }"""
        )
        if done:
            page.wait_for_timeout(30)
            for row in page.evaluate(
                "() => [...document.querySelectorAll('#weights-table tbody tr:not(.spacer)')].map(tr => ({row: Number(tr.dataset.row), name: tr.dataset.name, cells: [...tr.cells].map(td => td.textContent)}))"
            ):
                seen.setdefault(row["row"], row)
            break
    count = page.evaluate("document.getElementById('row-count').textContent")
    assert sorted(seen) == list(range(len(seen))), "the table skipped rows while scrolling"
    assert count == f"{len(seen):,} weights"
    return [seen[i] for i in range(len(seen))]


@pytest.mark.parametrize("name", ["quantize", "one", "two", "check"])
def test_minilm_text_stays_inside_its_card(browser, minilm_reports, artifacts, name):
    """Bits-per-weight labels (and every other text of a card) inside the card at 1280 px."""
    opened = Opened(browser, minilm_reports[name])
    outside = outside_cards(opened)
    opened.shot(artifacts, f"minilm-{name}-1280x800.png")
    assert not outside, "\n".join(outside[:10])
    assert not opened.problems


@pytest.mark.parametrize("name", ["quantize", "one", "two", "check"])
def test_minilm_names_headers_and_values_are_whole(browser, minilm_reports, name):
    """No weight name, header or value cut (no ellipsis, nothing wider than its cell): names wrap."""
    opened = Opened(browser, minilm_reports[name])
    page = opened.page
    cut = page.evaluate(
        """() => [...document.querySelectorAll('#weights-table th, #weights-table th button, #weights-table td, table.models td, table.models th')]
             .filter(el => getComputedStyle(el).textOverflow === 'ellipsis' || el.scrollWidth > el.clientWidth + 0.5)
             .map(el => el.textContent)"""
    )
    assert not cut, cut[:10]
    if name != "two":  # one model's columns fit the frame at 1280 px: no value hidden to the right
        assert page.evaluate(
            "(() => { const s = document.getElementById('table-scroll'); return s.scrollWidth <= s.clientWidth; })()"
        )
    # every name whole, on every row (the rows differ in height where a name wraps)
    rows = _every_row(opened)
    names = {r["name"] for r in rows}
    assert "encoder.layer.4.attention.self.value.weight" in names
    assert all(r["cells"][0] == r["name"] for r in rows)
    # and a wrapped row's height is what the table's spacers account for: scrolled to the end,
    # the last row's bottom is the table's
    assert (
        page.evaluate(
            """() => { const rows = document.querySelectorAll('#weights-table tbody tr');
                   const last = rows[rows.length - 1];
                   return last.classList.contains('spacer') ? last.getBoundingClientRect().height : 0; }"""
        )
        < 1
    )
    assert not opened.problems


def test_minilm_one_colour_per_candidate(browser, minilm_reports):
    """Two candidates: each has one colour in the depth chart, the histogram and the bits chart."""
    opened = Opened(browser, minilm_reports["two"])
    colours = opened.page.evaluate(
        """() => {
          const seen = {};
          const add = (who, where, colour) => ((seen[who] ??= {})[where] ??= new Set()).add(colour);
          for (const s of [0, 1]) {
            for (const line of document.querySelectorAll(`svg.depth .line.s-${s}`)) add(`B${s + 1}`, 'depth line', getComputedStyle(line).stroke);
            for (const use of document.querySelectorAll(`svg.depth .mark.s-${s} use`)) {
              const style = getComputedStyle(use);
              add(`B${s + 1}`, 'depth mark', s % 2 ? style.stroke : style.fill);
            }
            for (const bar of document.querySelectorAll(`svg.histogram .bar.s-${s}`)) add(`B${s + 1}`, 'histogram', getComputedStyle(bar).fill);
          }
          for (const bar of document.querySelectorAll('.bits .bar')) {
            const who = bar.querySelector('title').textContent.split(':')[0];
            add(who, 'bits', getComputedStyle(bar).fill);
          }
          return Object.fromEntries(Object.entries(seen).map(([who, where]) => [who, Object.fromEntries(Object.entries(where).map(([k, v]) => [k, [...v]]))]));
        }"""
    )
    per_candidate = {}
    for who in ("B1", "B2"):
        assert set(colours[who]) == {"depth line", "depth mark", "histogram", "bits"}, colours[who]
        found = {c for where in colours[who].values() for c in where}
        assert len(found) == 1, f"{who} is drawn in {colours[who]}"
        per_candidate[who] = found.pop()
    assert per_candidate["B1"] != per_candidate["B2"]
    assert per_candidate["B1"] not in colours["A"]["bits"] and per_candidate["B2"] not in colours["A"]["bits"]
    assert not opened.problems


@pytest.mark.parametrize("name", ["one", "two"])
def test_minilm_counts_add_up(browser, minilm_reports, name):
    """The summary's counts are the histogram's and the table's, and each label says what it counts:
    exact copies are not findings."""
    import re

    opened = Opened(browser, minilm_reports[name])
    page = opened.page
    facts = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('dl.facts dt')].map(dt => [dt.textContent, dt.nextElementSibling.textContent]))"
    )
    histogram = page.evaluate(
        """() => [...document.querySelectorAll('svg.histogram .bar')].map(bar => bar.querySelector('title').textContent)"""
    )
    rows = _every_row(opened)
    heads = page.evaluate(
        "() => [...document.querySelectorAll('#weights-table thead th')].map(th => [th.dataset.key, th.textContent])"
    )
    candidates = 2 if name == "two" else 1
    for index in range(candidates):
        tag = "w8" if index else "w4"
        line = next(
            value for label, value in facts.items() if label.startswith("weights") and (candidates == 1 or tag in label)
        )

        def figure(pattern: str, line: str = line) -> int:
            found = re.search(pattern, line)
            assert found, f"{pattern!r} not in {line!r}"
            return int(found.group(1))

        bars = [t.split(": ")[-2:] for t in histogram if candidates == 1 or tag in t.split(": ")[0]]
        in_bins = sum(int(n.split()[0]) for label, n in bars if label.endswith("dB"))
        exact_bar = sum(int(n.split()[0]) for label, n in bars if label == "exact")
        status = next(i for i, (key, _) in enumerate(heads) if key == f"status@{index}")
        sqnr = next(i for i, (key, _) in enumerate(heads) if key == f"sqnr_db@{index}")
        statuses = [r["cells"][status] for r in rows]
        measured_rows = sum(1 for r in rows if re.fullmatch(r"-?\d+\.\d\d", r["cells"][sqnr]))
        # exact copies: the summary's, the histogram's exact bar and the rows marked exact agree
        assert figure(r"(\d+) exact") == exact_bar == statuses.count("exact")
        # findings: the summary's count is the rows that show a finding, and no other row does
        assert figure(r"(\d+) findings?") == sum(1 for s in statuses if s.startswith("finding"))
        assert not any(
            heads[status][1].startswith("finding") and s and not s.startswith("finding") for s in statuses
        ), heads[status]
        # measured: those with an error are the histogram's bins and the rows with an SQNR
        assert figure(r"(\d+) with an error") == in_bins == measured_rows
        assert figure(r"(\d+) measured") == in_bins + exact_bar
        # and the parts make the matched count
        assert (
            figure(r"(\d+) matched")
            == len(rows)
            == sum(figure(p) for p in (r"(\d+) measured", r"(\d+) findings?", r"(\d+) integer"))
        )
    assert not opened.problems


def test_hostile_names_wrap_inside_the_card(browser, tmp_path):
    """Names from strangers of any length wrap whole inside their cell and card: 3,000 characters
    without a dot, 600 dotted parts, a bidi override; the table's measured row heights hold
    (every row once while scrolling, none left out under the last)."""
    from qtool.html_report.svg import display

    document = synthetic_comparison(3, b="w4/")
    hostile = ["x" * 3000, "a." * 600 + "weight", "model.layers.0.\u202eevil.weight"]
    for weight, name in zip(document["weights"], hostile):
        weight["name"] = name
    path = tmp_path / "hostile.html"
    path.write_text(render_compare([document]))
    opened = Opened(browser, path)
    page = opened.page
    cut = page.evaluate(
        """() => [...document.querySelectorAll('#weights-table th, #weights-table td, main section > *')]
             .filter(el => el.scrollWidth > el.clientWidth + 0.5 || el.getBoundingClientRect().right > el.closest('section').getBoundingClientRect().right + 0.5)
             .map(el => el.tagName + ' ' + el.className + ' ' + el.textContent.slice(0, 40))"""
    )
    assert not cut, cut[:5]
    rows = _every_row(opened)
    assert len(rows) == len(document["weights"])
    shown_names = {r["cells"][0] for r in rows}
    assert {display(name) for name in hostile} <= shown_names
    assert all(r["cells"][0] == display(r["name"]) for r in rows)
    assert not opened.problems


# -- issue 38: qtool eval's page, and compare --text's outputs ------------------------------------


def _with_outputs(documents: list[dict]) -> list[dict]:
    from tests.synthetic_reports import synthetic_evaluation

    for index, document in enumerate(documents):
        document["outputs"] = synthetic_evaluation(len({w["layer"] for w in document["weights"]} - {None}),
                                                   model=document["b"], base=document["a"], seed=index)  # fmt: skip
    return documents


@pytest.mark.parametrize("base", [True, False], ids=["against-a-base", "alone"])
def test_eval_page_text_stays_inside_its_card(browser, tmp_path, artifacts, base):
    """The eval page at 1280 px: every text inside its card, a long path from the command line
    too (it wraps); the charts drawn against a base, none without."""
    from qtool.html_report import render_eval
    from tests.synthetic_reports import synthetic_evaluation

    long = "models/" + "quantized-" * 30 + "w4a16"
    document = synthetic_evaluation(30, model=long, base=long.replace("w4a16", "bf16") if base else None)
    document["text"] = "corpora/" + "x" * 300 + ".raw"  # no break opportunity: it must wrap anywhere
    path = tmp_path / "eval.html"
    path.write_text(render_eval(document))
    opened = Opened(browser, path)
    outside = outside_cards(opened)
    opened.shot(artifacts, f"eval-{'base' if base else 'alone'}-1280x800.png")
    assert not outside, "\n".join(outside[:10])
    charts = opened.page.evaluate("() => [...document.querySelectorAll('svg.chart')].map(svg => svg.classList[1])")
    assert charts == (["histogram", "depth"] if base else [])
    if base:
        assert opened.page.evaluate("document.querySelectorAll('svg.depth .mark').length") == 30
    assert not opened.problems
    opened.page.close()


@pytest.mark.parametrize("candidates", [1, 2])
def test_compare_outputs_keep_each_candidates_colour(browser, tmp_path, artifacts, candidates):
    """compare --text: each candidate's KL bars, hidden-error line and marks are in the colour
    of its SQNR bars (one candidate too, where the weights' depth chart colours by kind); every
    text inside its card."""
    documents = _with_outputs([synthetic_comparison(6, b="rtn/"), synthetic_comparison(6, seed=1, b="gptq/")])
    documents = documents[:candidates]
    path = tmp_path / "compare-outputs.html"
    path.write_text(render_compare(documents))
    opened = Opened(browser, path)
    colours = opened.page.evaluate(
        """() => {
          const seen = {};
          const add = (s, where, colour) => ((seen[s] ??= {})[where] ??= new Set()).add(colour);
          for (const s of [0, 1]) {
            for (const bar of document.querySelectorAll(`#distribution svg.histogram .bar.s-${s}`)) add(s, 'SQNR bars', getComputedStyle(bar).fill);
            for (const bar of document.querySelectorAll(`#outputs svg.histogram .bar.s-${s}`)) add(s, 'KL bars', getComputedStyle(bar).fill);
            for (const line of document.querySelectorAll(`#outputs svg.depth .line.s-${s}`)) add(s, 'hidden line', getComputedStyle(line).stroke);
            for (const use of document.querySelectorAll(`#outputs svg.depth .mark.s-${s} use`)) {
              const style = getComputedStyle(use);
              add(s, 'hidden mark', s % 2 ? style.stroke : style.fill);
            }
          }
          return Object.fromEntries(Object.entries(seen).map(([s, where]) => [s, Object.fromEntries(Object.entries(where).map(([k, v]) => [k, [...v]]))]));
        }"""
    )
    found = []
    for series in map(str, range(candidates)):
        assert set(colours[series]) == {"SQNR bars", "KL bars", "hidden line", "hidden mark"}, colours[series]
        one = {c for where in colours[series].values() for c in where}
        assert len(one) == 1, f"candidate {series} is drawn in {colours[series]}"
        found.append(one.pop())
    assert len(set(found)) == candidates
    outside = outside_cards(opened)
    opened.page.evaluate("document.getElementById('outputs').scrollIntoView()")
    opened.shot(artifacts, f"compare-outputs-{candidates}-1280x800.png")
    assert not outside, "\n".join(outside[:10])
    assert not opened.problems
    opened.page.close()
