"""The HTML report without a browser: it is written by the real CLI next to `--json` in the same
run, and every figure it carries equals the JSON's; names from files never become markup; it
needs no network; report paths are refused where qtool reads; the table payload round-trips.
(`tests/test_html_browser.py` opens the pages in Chromium.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.html_report import render_check, render_compare, render_quantize
from qtool.html_report.table_payload import Column, decode, encode
from tests.conftest import REPO, SAMPLES
from tests.synthetic_reports import synthetic_comparison

TINY = SAMPLES / "tiny-llama"
PAYLOAD = re.compile(r'<script type="application/octet-stream" id="table-data">([^<]*)</script>')
MARK = re.compile(
    r'<g class="mark [^"]*" data-series="(\d+)" data-layer="(\d*)" data-kind="([^"]*)" data-name="([^"]*)" data-value="([^"]*)"'
)


def qtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )


def table_rows(page: str) -> tuple[list[dict], list[dict]]:
    found = PAYLOAD.search(page)
    assert found, "no table payload"
    return decode(found.group(1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One folder with the real CLI's outputs: a W4A16 and an int4:g64 quantization of
    tiny-llama (with --json and --html from the same run), a compare of each (the first with
    --json and --html), a 3-way overlay and a failing check."""
    folder = tmp_path_factory.mktemp("html")
    out = qtool(
        "quantize",
        str(TINY),
        "-o",
        "w4",
        "-q",
        "--json",
        "--html",
        "quantize.html",
        "--report",
        "quantize.json",
        cwd=folder,
    )
    assert out.returncode == 0, out.stderr
    (folder / "quantize.stdout.json").write_text(out.stdout)
    assert qtool("quantize", str(TINY), "-o", "w4g64", "-s", "int4:g64", "-q", cwd=folder).returncode == 0
    out = qtool(
        "compare",
        str(TINY),
        "w4",
        "--min-sqnr",
        "19.05",
        "--json",
        "--html",
        "compare.html",
        "--report",
        "compare.report.json",
        "-q",
        cwd=folder,
    )
    assert out.returncode == 1, out.stderr
    (folder / "compare.json").write_text(out.stdout)
    out = qtool(
        "compare",
        str(TINY),
        "w4",
        "w4g64",
        "--min-sqnr",
        "19.05",
        "--json",
        "--report",
        "overlay.html",
        "-q",
        cwd=folder,
    )
    assert out.returncode == 1, out.stderr
    assert (
        out.stderr.splitlines()[0]
        == "error: w4: model.layers.0.self_attn.o_proj.weight: SQNR 19.003107 dB is below --min-sqnr 19.05"
    )
    (folder / "overlay.json").write_text(out.stdout)
    out = qtool(
        "check",
        "w4",
        "--expect-scheme",
        "W8A16",
        "--max-bits-per-weight",
        "6",
        "--json",
        "--html",
        "check.html",
        cwd=folder,
    )
    assert out.returncode == 1, out.stderr
    (folder / "check.json").write_text(out.stdout)
    return folder


def _policy(page: str) -> str:
    import html

    return html.unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page).group(1))


def _same(html_value, json_value) -> bool:
    if isinstance(json_value, float) and isinstance(html_value, (int, float)):
        return html_value == json_value
    return html_value == json_value


def test_quantize_html_has_the_json_figures(runs):
    document = json.loads((runs / "quantize.stdout.json").read_text())
    assert (
        json.loads((runs / "quantize.json").read_text())["weights"] == document["weights"]
    )  # --report: the same run's document
    page = (runs / "quantize.html").read_text()
    _, rows = table_rows(page)
    by_name = {row["name"]: row for row in rows}
    assert [row["name"] for row in rows] == [w["name"] for w in document["weights"]]  # worst first, as the JSON
    for weight in document["weights"]:
        row = by_name[weight["name"]]
        for key in ("sqnr_db", "max_abs_err", "bytes_before", "bytes_after", "layer", "scheme"):
            assert _same(row[key], weight[key]), (weight["name"], key)
        assert row["kind"] == weight["kind"]
    marks = MARK.findall(page)
    assert {(int(layer), kind) for _, layer, kind, _, _ in marks} == {
        (w["layer"], w["kind"]) for w in document["weights"]
    }
    for _, _, _, name, value in marks:  # each mark is the worst of its layer and kind, with the JSON's figure
        assert float(value) == next(w["sqnr_db"] for w in document["weights"] if w["name"] == unquote(name))
    summary = document["summary"]
    assert f"{summary['quantized']['sqnr_db']:.2f} dB" in page
    assert f"{document['models']['output']['bits_per_weight']:.4f} bits" in page
    for b in summary["histogram"]["bins"]:
        assert f"{b['from_db']}–{b['to_db']} dB: {b['weights']} weights" in page


def test_compare_html_has_the_json_figures(runs):
    document = json.loads((runs / "compare.json").read_text())
    assert json.loads((runs / "compare.report.json").read_text()) == document  # --report x.json: the --json document
    page = (runs / "compare.html").read_text()
    _, rows = table_rows(page)
    assert [row["name"] for row in rows] == [w["name"] for w in document["weights"]]
    for row, weight in zip(rows, document["weights"]):
        assert (
            row["sqnr_db@0"] == weight["sqnr_db"]
            and row["max_abs_err@0"] == weight["max_abs_err"]
            and row["bytes_b@0"] == weight["bytes_b"]
        )
        assert row["status@0"] == ("exact" if weight["exact"] else "")
    measured = [w for w in document["weights"] if w["sqnr_db"] is not None]
    assert len(MARK.findall(page)) == len({(w["layer"], w["kind"]) for w in measured})
    assert "gate: min SQNR 19.05 dB" in page
    assert "✗ FAIL: 1 violation" in page and "1 violations" not in page
    violation = document["violations"][0]
    assert violation.startswith("model.layers.0.self_attn.o_proj.weight: ")
    assert f'<a href="#weight=model.layers.0.self_attn.o_proj.weight">{violation}</a>' in page


def test_overlay_report_is_html_by_suffix_and_json_holds_each_comparison(runs):
    document = json.loads((runs / "overlay.json").read_text())
    assert [c["b"] for c in document["comparisons"]] == ["w4", "w4g64"]
    assert document["ok"] is False and document["violations"] == [
        "w4: model.layers.0.self_attn.o_proj.weight: SQNR 19.003107 dB is below --min-sqnr 19.05"
    ]
    single = json.loads((runs / "compare.json").read_text())
    first = document["comparisons"][0]
    assert {k: v for k, v in first.items() if k != "seconds"} == {
        k: v for k, v in single.items() if k != "seconds"
    }  # the 2-argument document, unchanged
    page = (runs / "overlay.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    _, rows = table_rows(page)
    second = {w["name"]: w for w in document["comparisons"][1]["weights"]}
    for row in rows:
        assert row["sqnr_db@1"] == second[row["name"]]["sqnr_db"]
    series = {(int(s), int(layer), kind) for s, layer, kind, _, _ in MARK.findall(page)}
    for index, comparison in enumerate(document["comparisons"]):
        assert {(s, layer, kind) for s, layer, kind in series if s == index} == {
            (index, w["layer"], w["kind"]) for w in comparison["weights"] if w["sqnr_db"] is not None
        }


def test_check_html_links_each_finding_to_its_row(runs):
    document = json.loads((runs / "check.json").read_text())
    page = (runs / "check.html").read_text()
    _, rows = table_rows(page)
    assert {row["name"] for row in rows} == {w["name"] for w in document["weight_rows"]}
    flagged = {f["weight"] for f in document["findings"] if f["weight"]}
    assert {row["name"] for row in rows[: len(flagged)]} == flagged  # rows with findings first
    for finding in document["findings"]:
        if finding["weight"]:
            assert f'<a href="#weight={finding["weight"]}">{finding["rule"]}: {finding["weight"]}: ' in page
    by_name = {w["name"]: w for w in document["weight_rows"]}
    for row in rows:
        assert (
            row["bits_per_weight"] == by_name[row["name"]]["bits_per_weight"]
            and row["bytes"] == by_name[row["name"]]["bytes"]
        )
    assert document["policy"]["max_bits_per_weight"] == 6.0
    assert "max bits per weight 6 (over the whole checkpoint)" in page


def test_pages_need_no_network(runs):
    for name in ("quantize.html", "compare.html", "overlay.html", "check.html"):
        page = (runs / name).read_text()
        assert "default-src 'none'" in _policy(page)
        urls = set(re.findall(r"\w+://[\w.-]+", PAYLOAD.sub("", page)))
        assert urls <= {"http://www.w3.org"}, (name, urls)  # the SVG namespace, never fetched
        assert all(link.startswith("#") for link in re.findall(r'href="([^"]*)"', page))
        assert " src=" not in page and "url(" not in page and "@import" not in page
        assert not re.search(r"<(link|img|iframe|object|embed)\b", page)
        assert page.count("<script") == 2 and page.count("<style") == 1


def test_inline_script_and_style_match_the_policy_hashes(runs):
    import base64
    import hashlib

    page = (runs / "quantize.html").read_text()
    style = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    script = re.findall(r"<script>(.*?)</script>", page, re.S)[-1]
    for source, directive in ((style, "style-src"), (script, "script-src")):
        digest = base64.b64encode(hashlib.sha256(source.encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in _policy(page)


HOSTILE = [
    "model.layers.0.mlp.down_proj.</script><script>alert(1)</script>",
    'model.layers.1.self_attn.q_proj."><img src=x onerror=alert(1)>',
    "model.layers.2.mlp.up_proj.\x1b[31m\u202egnp.exe\n",
]


def test_hostile_names_stay_text():
    document = synthetic_comparison(3)
    for weight, name in zip(document["weights"], HOSTILE):
        weight["name"] = weight["name_b"] = name
    document["violations"] = [f"{name}: SQNR 1 dB is below --min-sqnr 15" for name in HOSTILE]
    document["b"] = "<b>bold</b>/"
    page = render_compare([document])
    assert "<script>alert" not in page and "<img" not in page and "<b>bold" not in page
    assert "\x1b" not in page and "\u202e" not in page
    assert "\\x1b[31m\\u202egnp.exe\\n" in page  # shown escaped, as the CLI shows it
    _, rows = table_rows(page)
    assert {row["name"] for row in rows} >= set(HOSTILE)  # the exact names, for the JSON comparison


def test_thousand_and_sixty_thousand_weights_stay_small():
    small = render_compare([synthetic_comparison(110)])
    assert len(small.encode()) < 500_000
    experts = synthetic_comparison(40, 500)
    page = render_compare([experts])
    assert len(page.encode()) < 5_000_000
    marks = MARK.findall(page)
    # experts aggregated: one mark per layer for all 1,500 expert weights of that layer
    assert sum(1 for _, _, kind, _, _ in marks if kind == "experts") == 40
    outlier = min(
        (w for w in experts["weights"] if w["kind"] == "experts" and w["sqnr_db"] is not None),
        key=lambda w: w["sqnr_db"],
    )
    assert any(unquote(name) == outlier["name"] for _, _, _, name, _ in marks)
    _, rows = table_rows(page)
    assert len(rows) == len(experts["weights"])  # every row kept in the table


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(max_size=40),
            st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False)),
            st.sampled_from(["a", "b", None]),
        ),
        max_size=30,
    )
)
def test_payload_round_trips(rows):
    columns = [Column("name", "weight", "name"), Column("value", "SQNR", "db"), Column("scheme", "scheme", "text")]
    documents = [{"name": name, "value": value, "scheme": scheme} for name, value, scheme in rows]
    decoded_columns, decoded = decode(encode(columns, documents))
    assert [c["key"] for c in decoded_columns] == ["name", "value", "scheme"]
    assert decoded == documents


def test_renderers_take_the_documents_as_they_are():
    assert render_quantize and render_check  # the public names exist
    with pytest.raises(ValueError):
        render_compare([])


def test_report_paths_are_refused_where_qtool_reads(tmp_path):
    model = tmp_path / "model"
    import shutil

    shutil.copytree(TINY, model)
    out = qtool("compare", "model", "model", "--html", "model/report.html", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.splitlines()[0].startswith(
        "error: report model/report.html lies inside the input"
    )
    assert not (model / "report.html").exists()
    out = qtool("check", "model", "--html", "r.html", "--report", "r.html", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.splitlines()[0] == "error: reports r.html and r.html are the same file"
    out = qtool("quantize", "model", "-o", "out", "--report", "r.html", "--html", "r.html", cwd=tmp_path)
    assert out.returncode == 2 and "are the same file" in out.stderr and not (tmp_path / "out").exists()
    (tmp_path / "old.html").write_text("keep")
    out = qtool("check", "model", "--html", "old.html", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.splitlines()[0] == "error: report old.html already exists"
    assert (tmp_path / "old.html").read_text() == "keep"
    out = qtool("compare", "model", "model", "--report", "old.html", cwd=tmp_path)  # refused before measuring
    assert out.returncode == 2 and out.stderr.splitlines()[0] == "error: report old.html already exists"
    assert qtool("check", "model", "--html", "old.html", "--overwrite", cwd=tmp_path).returncode == 0
    assert (tmp_path / "old.html").read_text().startswith("<!DOCTYPE html>")
    assert not [p for p in os.listdir(tmp_path) if "qtool-tmp" in p]


def test_model_revision_from_a_hub_cache_and_git(tmp_path):
    from qtool.formats.revision import revision_of

    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"")
    assert revision_of(str(tmp_path / "hub" / "gone")) is None  # a path that is not there has no revision
    assert revision_of(str(snapshot / "model.safetensors")) == {
        "source": "hub-cache",
        "repo": "org/name",
        "commit": commit,
    }
    work = tmp_path / "work"
    (work / ".git" / "refs" / "heads").mkdir(parents=True)
    (work / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (work / ".git" / "packed-refs").write_text(f"# pack-refs\n{commit} refs/heads/main\n")
    (work / "models" / "m").mkdir(parents=True)
    assert revision_of(str(work / "models" / "m")) == {
        "source": "git",
        "repo": None,
        "commit": commit,
        "ref": "refs/heads/main",
    }
    (work / ".git" / "HEAD").write_text("ref: refs/heads/../../../etc/passwd\n")
    assert revision_of(str(work / "models" / "m")) is None
    (work / ".git" / "HEAD").write_text("x" * 10_000)
    assert revision_of(str(work)) is None
    assert revision_of("hf://org/name") is None


def test_compare_counts_add_up_with_every_kind_of_pair(tmp_path):
    """Issue 42 #23: the page's weight counts are parts that add up (matched = measured + equal
    integer tensors + findings; measured = with an error + exact + no signal), and the table's
    status column says the same of each row: an exact copy or an equal integer tensor is no
    finding. Every kind of pair at once: measured, exact, no signal, shape mismatch, integer
    equal, integer differing."""
    import torch
    from safetensors.torch import save_file

    from qtool import api
    from qtool.html_report.views import compare_page

    base = torch.randn(8, 32)
    a = {"l.0.q.weight": base, "l.0.k.weight": base.clone(), "l.0.v.weight": torch.zeros(8, 32), "l.0.o.weight": torch.randn(8, 32),
         "pos": torch.arange(16), "ids": torch.arange(16)}  # fmt: skip
    b = {"l.0.q.weight": base + 0.01 * torch.randn(8, 32), "l.0.k.weight": base.clone(), "l.0.v.weight": torch.ones(8, 32), "l.0.o.weight": torch.randn(4, 32),
         "pos": torch.arange(16), "ids": torch.arange(16).flip(0)}  # fmt: skip
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    document = api.compare(tmp_path / "a.safetensors", tmp_path / "b.safetensors").to_json()
    summary = document["summary"]
    assert (summary["matched"], summary["measured"], summary["exact"], summary["findings"], summary["integer"]) == (
        6,
        3,
        2,
        2,
        {"compared": 2, "equal": 1},
    )
    page = compare_page([document])
    weights = dict(page.facts)["weights"]
    assert (
        "6 matched (6 in A, 6 in B): 3 measured (1 with an error, 1 exact, 1 with no signal in A) + 1 integer tensor, equal (compared for equality, not measured)"
        in weights
    )
    assert "+ 2 findings;" in weights
    statuses = {row["name"]: row["status@0"] for row in page.rows}
    assert (
        statuses["l.0.q.weight"] == ""
        and statuses["l.0.k.weight"] == "exact"
        and statuses["l.0.v.weight"] == "no signal"
    )
    assert statuses["pos"] == "integer, equal"
    assert statuses["ids"].startswith("finding: integer values differ") and statuses["l.0.o.weight"].startswith(
        "finding: "
    )
    assert sum(s.startswith("finding") for s in statuses.values()) == summary["findings"]
    assert list(statuses.values()).count("exact") == summary["histogram"]["exact"]
    assert [c.label for c in page.columns if c.key == "status@0"] == ["status"]


# -- issue 38: the page of `qtool eval`, and the outputs on the compare page ----------------------

EVAL_MARK = re.compile(
    r'<g class="mark [^"]* s-(\d+)" data-series="\d+" data-layer="(\d+)" data-kind="hidden" data-name="[^"]*" data-value="([^"]*)"'
)
KL_BAR = re.compile(r'<rect class="bar s-(\d+)"[^>]*><title>([^<]*): (\d+) tokens</title></rect>')


def test_eval_page_has_the_document_figures():
    from qtool.html_report import render_eval
    from tests.synthetic_reports import synthetic_evaluation

    document = synthetic_evaluation(12)
    page = render_eval(document)
    kld = document["kld"]
    for figure in (
        f"{document['perplexity']:.4f}",
        f"{document['base']['perplexity']:.4f}",
        f"{document['ppl_ratio']:.5f}",
        f"{kld['mean']:.6f}",
        f"{kld['median']:.6f} / {kld['p99']:.6f} / {kld['max']:.6f}",
        f"{100 * document['top1_agreement']:.2f} %",
        f"{document['windows']} of {document['ctx']} tokens ({document['tokens_scored']} tokens scored)",
        "1.2 s on cpu (float32)",
    ):
        assert f"<dd>{figure}</dd>" in page, figure
    # the hidden-state error: one mark per layer, with the document's figure, on a log axis
    marks = EVAL_MARK.findall(page)
    assert [(int(layer), float(value)) for _, layer, value in marks] == [
        (layer["index"], layer["hidden_error"]) for layer in document["layers"]
    ]
    assert 'aria-label="hidden-state error after each layer, log scale"' in page
    assert ">10⁻⁴</text>" in page and ">10⁻³</text>" in page and ">10⁻²</text>" in page
    # the KL divergence per token: one bar per decade of the document, its count in the tooltip
    bars = KL_BAR.findall(page)
    assert [int(count) for _, _, count in bars] == [b["tokens"] for b in document["kld_histogram"]]
    assert bars[3][1] == "KL 0.0001 to 0.001" and bars[-1][1] == "KL 10 and above"
    assert sum(int(count) for _, _, count in bars) == document["tokens_scored"]
    # no weights here: no table, no payload
    assert 'id="weights"' not in page and not PAYLOAD.search(page) and page.count("<script") == 1
    assert '<p class="verdict none">no gate</p>' in page


def test_eval_page_needs_no_network():
    from qtool.html_report import render_eval
    from tests.synthetic_reports import synthetic_evaluation

    page = render_eval(synthetic_evaluation())
    assert "default-src 'none'" in _policy(page)
    assert set(re.findall(r"\w+://[\w.-]+", page)) <= {"http://www.w3.org"}
    assert all(link.startswith("#") for link in re.findall(r'href="([^"]*)"', page))
    assert not re.search(r"<(link|img|iframe|object|embed)\b", page) and " src=" not in page


def test_eval_page_escapes_names_from_the_command_line_and_files():
    from qtool.html_report import render_eval
    from tests.synthetic_reports import synthetic_evaluation

    document = synthetic_evaluation(
        4, model="models/<script>alert(1)</script>", base='base/"><img src=x onerror=alert(1)>'
    )
    document["text"] = "wiki.\x1b[31m\u202etxt.exe"
    document["warnings"] = ["<b>warned</b>"]
    document["violations"] = ["mean KL divergence <i>1</i> is above the limit 0.1"]
    document["ok"] = False
    page = render_eval(document)
    assert "<script>alert" not in page and "<img" not in page and "<b>warned" not in page and "<i>1" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "\x1b" not in page and "\u202e" not in page and "wiki.\\x1b[31m\\u202etxt.exe" in page
    assert "✗ FAIL: 1 violation" in page
    assert "<li>mean KL divergence &lt;i&gt;1&lt;/i&gt; is above the limit 0.1</li>" in page


def test_eval_page_without_a_base_has_no_chart():
    from qtool.html_report import render_eval
    from tests.synthetic_reports import synthetic_evaluation

    document = synthetic_evaluation(6, base=None)
    page = render_eval(document)
    assert f"<dd>{document['perplexity']:.4f}</dd>" in page
    assert '<svg class="chart' not in page and "KL" not in page and "hidden-state" not in page
    assert "none: the perplexity only" in page


def test_eval_page_of_a_model_against_itself():
    """Hidden states equal to the base's have no place on a log axis: a sentence says so."""
    from qtool.html_report import render_eval
    from tests.synthetic_reports import synthetic_evaluation

    document = synthetic_evaluation(3)
    for layer in document["layers"]:
        layer["hidden_error"] = 0.0
    page = render_eval(document)
    assert 'svg class="chart depth' not in page
    assert "The hidden states equal the base's after every layer (error 0)." in page
    document["layers"][1]["hidden_error"] = 2e-3
    page = render_eval(document)
    assert [int(layer) for _, layer, _ in EVAL_MARK.findall(page)] == [1]
    assert "The hidden states after layer 0, 2 equal the base" in page


def test_eval_gates_give_the_verdict():
    from qtool.evaluation.report import OutputGates
    from qtool.html_report import render_eval
    from tests.synthetic_reports import synthetic_evaluation

    document = synthetic_evaluation(4, gates=OutputGates(max_kld=1e-4, min_top1=0.5))
    assert len(document["violations"]) == 1
    page = render_eval(document)
    assert "✗ FAIL: 1 violation" in page
    assert "max mean KL divergence 0.0001 · min top-1 agreement 0.5" in page
    assert f"<li>{document['violations'][0]}</li>" in page
    assert "✓ PASS" in render_eval(synthetic_evaluation(4, gates=OutputGates(min_top1=0.5)))


def test_compare_page_shows_each_candidates_outputs():
    """compare --text: the outputs section after the weights' charts, each candidate in its
    series colour (s-N) as in the SQNR charts; the output gates with the others."""
    from qtool.evaluation.report import OutputGates
    from tests.synthetic_reports import synthetic_evaluation

    documents = [synthetic_comparison(4, b="rtn/"), synthetic_comparison(4, seed=1, b="gptq/")]
    for index, document in enumerate(documents):
        document["outputs"] = synthetic_evaluation(
            4, model=document["b"], base="synthetic/", seed=index, gates=OutputGates(max_kld=0.5)
        )
    single = render_compare(documents[:1])
    assert single.index('id="distribution"') < single.index('id="outputs"') < single.index('id="weights"')
    assert "max mean KL divergence 0.5" in single
    outputs = documents[0]["outputs"]
    assert f"<dd>{outputs['perplexity']:.4f}</dd>" in single
    assert [float(v) for _, _, v in EVAL_MARK.findall(single)] == [layer["hidden_error"] for layer in outputs["layers"]]
    assert [int(n) for _, _, n in KL_BAR.findall(single)] == [b["tokens"] for b in outputs["kld_histogram"]]
    documents[1]["outputs"]["base"] = documents[0]["outputs"]["base"]  # one A, one base perplexity
    page = render_compare(documents)
    marks = EVAL_MARK.findall(page)
    for series, document in enumerate(documents):
        assert [float(v) for s, _, v in marks if s == str(series)] == [
            layer["hidden_error"] for layer in document["outputs"]["layers"]
        ]
        bars = [(name, int(n)) for s, name, n in KL_BAR.findall(page) if s == str(series)]
        assert [n for _, n in bars] == [b["tokens"] for b in document["outputs"]["kld_histogram"]]
        assert all(name.startswith(document["b"] + ": ") for name, _ in bars)
        # the facts that differ are named by candidate; the base's perplexity is one
        assert f"<dt>perplexity ({document['b']})</dt><dd>{document['outputs']['perplexity']:.4f}</dd>" in page
    assert page.count("<dt>base perplexity</dt>") == 1
    assert page.count('id="outputs"') == 1
    assert 'id="outputs"' not in render_compare([synthetic_comparison(4)])  # no --text: no section


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory) -> Path:
    """A folder with a tiny random LLaMA (`model`, as tests/test_calibration_runner.py makes it),
    a text to score, and the model quantized int4:g32 by the CLI (`w4`)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.test_calibration_runner import TEXT, tiny_model

    folder = tmp_path_factory.mktemp("eval-html")
    tiny_model(folder / "model", "llama")
    (folder / "text.txt").write_text(TEXT)
    out = qtool("quantize", "model", "-o", "w4", "--scheme", "int4:g32", "-q", cwd=folder)
    assert out.returncode == 0, out.stderr
    return folder


def test_eval_writes_its_html_page_through_the_cli(tiny_text_model):
    """`qtool eval --html` through a real process: the page is written and carries the --json
    document's perplexity (issue 38)."""
    folder = tiny_text_model
    out = qtool(
        "eval", "model", "--base", "model", "--text", "text.txt", "--ctx", "32", "--windows", "2",
        "--html", "out.html", "--json", "-q", cwd=folder,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    page = (folder / "out.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert f"<dd>{document['perplexity']:.4f}</dd>" in page
    assert document["top1_agreement"] == 1.0 and "<dd>100.00 %</dd>" in page
    assert "The hidden states equal the base's after every layer (error 0)." in page  # the model against itself


def test_compare_text_writes_the_outputs_into_its_page(tiny_text_model):
    """`qtool compare A B --text --html` through a real process: the page's outputs section
    carries the --json document's `outputs`, layer by layer and bin by bin."""
    folder = tiny_text_model
    out = qtool(
        "compare", "model", "w4", "--text", "text.txt", "--ctx", "32", "--windows", "2",
        "--html", "compare.html", "--json", "-q", cwd=folder,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    outputs = json.loads(out.stdout)["outputs"]
    page = (folder / "compare.html").read_text()
    assert 'id="outputs"' in page and f"<dd>{outputs['perplexity']:.4f}</dd>" in page
    assert [(int(layer), float(value)) for _, layer, value in EVAL_MARK.findall(page)] == [
        (layer["index"], layer["hidden_error"]) for layer in outputs["layers"]
    ]
    assert all(layer["hidden_error"] > 0 for layer in outputs["layers"])
    assert [int(n) for _, _, n in KL_BAR.findall(page)] == [b["tokens"] for b in outputs["kld_histogram"]]


def test_log_axis_ticks_are_round_over_any_range():
    """The hidden-state error's log axis: 1-2-5 ticks within a decade, decades over a few,
    every fifth decade over thirty; each tick placed where its value lies."""
    from qtool.html_report.depth_chart import Axis, Mark, depth_chart

    def ticks(*values: float) -> list[str]:
        marks = [Mark(0, layer, "hidden", None, value, f"layer {layer}", "") for layer, value in enumerate(values)]
        svg = depth_chart(marks, Axis("hidden-state error", "", "high", log=True), ["m"], label="x")
        return re.findall(r'<text class="tick" x="\d+" y="[\d.]+" text-anchor="end">([^<]*)</text>', svg)

    assert ticks(1e-4) == ["5×10⁻⁵", "10⁻⁴", "2×10⁻⁴"]
    assert ticks(1e-4, 1e-2) == ["10⁻⁴", "10⁻³", "10⁻²"]
    assert ticks(1e-30, 1.0) == ["10⁻³⁰", "10⁻²⁵", "10⁻²⁰", "10⁻¹⁵", "10⁻¹⁰", "10⁻⁵", "1"]
