"""One self-contained HTML file from a `Page`: inline CSS and script (package data in `assets/`),
inline SVG, the table's rows embedded (see `table_payload`); a page without a depth chart or a
table (an evaluation's) has no such section. Nothing is fetched: the page's
Content-Security-Policy allows no network at all, and only its own style and script by hash,
so a name from a file can never become markup or code, even if escaping were missed.
"""

from __future__ import annotations

import base64
import hashlib
from functools import cache
from importlib import resources

from qtool.html_report.bar_charts import series_legend
from qtool.html_report.svg import MARKERS, attr, fmt_bytes, kind_class, kind_label, marker_for, shown, text
from qtool.html_report.table_payload import encode
from qtool.html_report.page_parts import Page

__all__ = ["render_page"]


@cache
def _asset(name: str) -> str:
    return resources.files("qtool.html_report").joinpath("assets", name).read_text(encoding="utf-8")


def _sha256(source: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(source.encode("utf-8")).digest()).decode("ascii")


def _revision(model: dict) -> str:
    revision = model.get("revision")
    if not revision:
        return "—"
    where = revision.get("repo") or ("git" if revision["source"] == "git" else revision["source"])
    ref = revision.get("ref")
    label = f"{where} @ {revision['commit'][:12]}" + (f" ({ref.rsplit('/', 1)[-1]})" if ref else "")
    return f'<span class="mono" title="{attr(revision["source"] + " " + revision["commit"])}">{shown(label)}</span>'


def _models(page: Page) -> str:
    if not page.models:
        return ""
    rows = []
    for role, model in page.models:
        schemes = ", ".join(k for k in model["by_scheme"] if k != "plain") or "plain"
        rows.append(
            f'<tr><th scope="row">{text(role)}</th><td class="path mono">{shown(model["path"])}</td><td>{text(model["format"])}</td>'
            f"<td>{_revision(model)}</td><td>{text(schemes)}</td>"
            f'<td class="num" title="{model["bytes"]} bytes">{text(fmt_bytes(model["bytes"]))}</td>'
            f'<td class="num">{model["parameters"]:,}</td><td class="num">{model["bits_per_weight"]:.4f} bits</td></tr>'
        )
    head = "<tr><th>model</th><th>path</th><th>format</th><th>revision</th><th>schemes</th><th>size</th><th>parameters</th><th>bits per weight</th></tr>"
    return f'<table class="models"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _problems(page: Page) -> str:
    if not page.problems:
        return ""
    items = []
    for line, weight in page.problems:
        body = shown(line)
        if weight is not None:
            from urllib.parse import quote

            body = f'<a href="#weight={attr(quote(weight, safe=""))}">{body}</a>'
        items.append(f"<li>{body}</li>")
    return f'<section id="problems"><h2>{text(page.problems_title)} ({len(page.problems)})</h2><ol class="problems">{"".join(items)}</ol></section>'


def _marker(kind: str, series: int = 0) -> str:
    return f'<g class="mark {kind_class(kind)} s-{series}"><use href="#m-{marker_for(kind)}" transform="translate(13 7) scale(5)"/></g>'


def _legend(page: Page) -> str:
    defs = (
        '<svg width="0" height="0" aria-hidden="true"><defs>'
        + "".join(f'<path id="lm-{n}" d="{d}"/>' for n, d in MARKERS.items())
        + "</defs></svg>"
    )
    items = []
    overlay = len(page.series_names) > 1
    if overlay:
        for series, name in enumerate(page.series_names):
            items.append(
                f'<li><svg viewBox="0 0 26 14" aria-hidden="true"><line class="line s-{series}" x1="0" x2="26" y1="7" y2="7"/>'
                f'{_marker("other", series).replace("#m-", "#lm-")}</svg><span class="mono">{shown(name)}</span></li>'
            )
    for kind in page.kinds:
        items.append(
            f'<li><svg viewBox="0 0 26 14" aria-hidden="true">{_marker(kind).replace("#m-", "#lm-")}</svg>{text(kind_label(kind))}</li>'
        )
    return defs + f'<ul class="legend">{"".join(items)}</ul>'


def _table(page: Page) -> str:
    cols = "".join(f'<col class="c-{c.type} c-{attr(c.key.split("@")[0])}">' for c in page.columns)
    heads = "".join(
        f'<th scope="col" data-key="{attr(c.key)}" aria-sort="none"{" title=" + chr(34) + attr(c.title) + chr(34) if c.title else ""}>'
        f'<button type="button">{text(c.label)}{" (" + text(c.unit) + ")" if c.unit else ""}</button></th>'
        for c in page.columns
    )
    return (
        '<section id="weights"><h2>Weights</h2>'
        f'<p class="caption">{text(page.table_caption)} Click a column to sort, click again to reverse; click a mark in the chart or a finding to find its row.</p>'
        '<div class="controls"><label>Filter by name <input type="search" id="filter" placeholder="e.g. down_proj or layers.31." autocomplete="off"></label>'
        f'<span id="row-count" aria-live="polite">{len(page.rows):,} weights</span></div>'
        f'<div class="table-scroll" id="table-scroll" tabindex="0"><table id="weights-table"><colgroup>{cols}</colgroup><thead><tr>{heads}</tr></thead><tbody></tbody></table></div>'
        "<noscript><p>The table needs JavaScript; the same rows are in the command's --json output.</p></noscript></section>"
    )


def render_page(page: Page, *, version: str) -> str:
    css, js = _asset("report.css"), _asset("report.js")
    policy = f"default-src 'none'; style-src '{_sha256(css)}'; script-src '{_sha256(js)}'; img-src data:; base-uri 'none'; form-action 'none'"
    if page.verdict is None:
        verdict = '<p class="verdict none">no gate</p>'
    else:
        label, ok = page.verdict
        verdict = f'<p class="verdict {"pass" if ok else "fail"}" role="status">{"✓" if ok else "✗"} {text(label)}</p>'
    facts = "".join(f"<dt>{text(label)}</dt><dd>{value}</dd>" for label, value in page.facts)
    distribution = []
    if page.histogram is not None:
        distribution.append(
            f'<div><h2>Per-weight SQNR</h2>{page.histogram}{series_legend(page.series_names)}<p class="caption">{text(page.histogram_caption or "Weights per 5 dB bin.")}</p></div>'
        )
    if page.bits:
        distribution.append(
            f'<div><h2>Bits per weight by scheme</h2>{page.bits}<p class="caption">Every stored byte (scales and zero points too) × 8 / parameters.</p></div>'
        )
    depth_title = "Error along the depth" if page.kind != "check" else "Bits per weight along the depth"
    return "".join(
        [
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{attr(policy)}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1"><meta name="color-scheme" content="light dark">',
            f'<meta name="generator" content="qtool {attr(version)}"><title>{shown(page.title)}</title>',
            f"<style>{css}</style></head>",
            f'<body class="report-{page.kind}{" overlay" if len(page.series_names) > 1 else ""}">',
            f"<header><h1>{shown(page.title)}</h1>{verdict}</header><main>",
            f'<section id="summary"><h2>{text(page.summary_title)}</h2>{_models(page)}<dl class="facts">{facts}</dl></section>',
            _problems(page),
            f'<section id="depth"><h2>{depth_title}</h2>{_legend(page)}{page.depth}<p class="caption">{text(page.depth_caption)} Hover a mark for its weight and figures.</p></section>'
            if page.depth
            else "",
            f'<section class="two" id="distribution">{"".join(distribution)}</section>' if distribution else "",
            *page.sections,
            _table(page) if page.columns else "",
            f"</main><footer>qtool {text(version)}: rendered from the same document that --json prints.</footer>",
            f'<script type="application/octet-stream" id="table-data">{encode(page.columns, page.rows)}</script>'
            if page.columns
            else "",
            f"<script>{js}</script></body></html>",
        ]
    )
