"""What a model does on a text, as the page shows it: the evaluation document of `qtool eval`
(`qtool.evaluation.report`), on its own page or as the `outputs` of each candidate on the
compare page. One section holds it, the same on both pages:

- the facts: windows and tokens scored, perplexity; against a base also the base's
  perplexity, the ratio, the per-token KL divergence (mean, median, p99, max) and the top-1
  agreement;
- the KL divergence per token, the document's decades as a histogram (`bar_charts`);
- the hidden-state error after each layer along the depth, on a log axis (`depth_chart`),
  since it grows by decades through the layers.

A candidate is drawn in its colour class `s-N` (its index on the compare page), so it has one
colour on the whole page. Without a base nothing was compared: the facts only, no chart. A
figure the document lacks (null) shows as "—"; the page computes none of its own.
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Sequence

from qtool.html_report.bar_charts import kld_histogram_chart, series_legend
from qtool.html_report.depth_chart import Axis, Mark, depth_chart
from qtool.html_report.page_parts import Page
from qtool.html_report.svg import display, shown, text
from qtool.message_text import counted

__all__ = ["eval_page", "outputs_section", "output_facts", "output_gates"]


def _figure(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def output_facts(document: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, plain text) of one evaluation: what it scored and what it measured."""
    facts = [
        (
            "windows",
            f"{document['windows']} of {document['ctx']} tokens ({counted(document['tokens_scored'], 'token')} scored)",
        ),
        ("perplexity", _figure(document["perplexity"], ".4f")),
    ]
    if document["base"] is None:
        return facts
    kld = document["kld"] or {}
    top1 = document["top1_agreement"]
    return facts + [
        ("base perplexity", _figure(document["base"]["perplexity"], ".4f")),
        ("perplexity ratio", _figure(document["ppl_ratio"], ".5f")),
        ("mean KL divergence", _figure(kld.get("mean"), ".6f")),
        (
            "KL median / p99 / max",
            " / ".join(_figure(kld.get(key), ".6f") for key in ("median", "p99", "max")),
        ),
        ("top-1 agreement", "—" if top1 is None else f"{100 * top1:.2f} %"),
    ]


def _facts_of(documents: Sequence[dict[str, Any]], names: Sequence[str]) -> list[tuple[str, str]]:
    """Each fact once where every candidate has the same (the windows, the base's perplexity),
    else once per candidate, named."""
    per = [output_facts(d) for d in documents]
    labels = list(dict.fromkeys(label for facts in per for label, _ in facts))
    rows = []
    for label in labels:
        values = [dict(facts).get(label, "—") for facts in per]
        if len(set(values)) == 1:
            rows.append((text(label), text(values[0])))
        else:
            rows += [(f"{text(label)} ({shown(name)})", text(value)) for name, value in zip(names, values)]
    return rows


def _hidden_error_chart(
    documents: Sequence[dict[str, Any]], series: Sequence[int], names: Sequence[str], series_names: Sequence[str]
) -> str:
    """The hidden-state error after each layer, one line per candidate, with its caption:
    `documents[i]` drawn as series `series[i]` and named `names[i]`; `series_names` are every
    candidate's, by series. A layer whose error is 0 (hidden states equal to the base's) has no
    place on a log axis; it is counted in the caption instead, as a figure that is not finite is."""
    marks, zero, bad = [], [], []
    for index, document, name in zip(series, documents, names):
        for layer in document["layers"]:
            value = layer["hidden_error"]
            if value is None:
                continue
            if not math.isfinite(value):
                bad.append((name, layer["index"]))
            elif value <= 0:
                zero.append((name, layer["index"]))
            else:
                where = int(layer["index"])
                name_of = f"hidden state after layer {where}"
                marks.append(Mark(index, where, "hidden", None, value, name_of, "relative to the base's"))
    notes = []
    for found, what in ((zero, "equal the base's (error 0, not drawn on the log axis)"), (bad, "have no finite error")):
        if found:
            layers = ", ".join(
                f"{layer}" + (f" ({display(name)})" if len(documents) > 1 else "") for name, layer in found[:20]
            )
            more = f" and {len(found) - 20} more" if len(found) > 20 else ""
            notes.append(f"The hidden states after layer {layers}{more} {what}.")
    if not marks:
        if zero and not bad:
            return '<p class="empty">The hidden states equal the base\'s after every layer (error 0).</p>'
        return f'<p class="empty">{text(" ".join(notes) or "No layer has a hidden-state error.")}</p>'
    svg = depth_chart(
        marks,
        Axis("hidden-state error", "", "high", log=True),
        series_names,
        label="hidden-state error after each layer, log scale"
        + (", one line per candidate" if len(documents) > 1 else ""),
    )
    caption = (
        "After each decoder layer, the error of the hidden states against the base's on the same tokens: "
        "Σ (h − h_base)² / Σ h_base², on a log axis. Hover a mark for its figure."
    )
    return svg + f'<p class="caption">{text(" ".join([caption, *notes]))}</p>'


def outputs_section(documents: Sequence[dict[str, Any] | None], names: Sequence[str]) -> str:
    """The section of the candidates' evaluations: `documents[i]` is candidate i's evaluation
    (None where it has none), `names[i]` its name and `s-i` its colour. Empty when none has
    one."""
    drawn = [(index, d, names[index]) for index, d in enumerate(documents) if d is not None]
    if not drawn:
        return ""
    evaluated = [d for _, d, _ in drawn]
    shown_names = [name for _, _, name in drawn]
    facts = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in _facts_of(evaluated, shown_names))
    facts_html = f'<dl class="facts">{facts}</dl>'
    compared = [(index, d, name) for index, d, name in drawn if d["base"] is not None]
    head = f'<h2>Outputs on <span class="mono">{shown(evaluated[0]["text"])}</span></h2>'
    if not compared:  # nothing to compare with: the perplexity and the facts, no chart
        return f'<section id="outputs" class="outputs">{head}{facts_html}</section>'
    legend = series_legend([name for _, _, name in compared], [index for index, _, _ in compared])
    histograms = [(index, d["kld_histogram"], name) for index, d, name in compared if d["kld_histogram"]]
    if histograms:
        kld = kld_histogram_chart(
            [h for _, h, _ in histograms],
            [index for index, _, _ in histograms],
            names,
            label="histogram of the per-token KL divergence from the base",
        ) + series_legend([name for _, _, name in histograms], [index for index, _, _ in histograms])
        kld += '<p class="caption">Scored tokens per decade of the KL divergence of the next-token distribution from the base\'s (nats); hover a bar for its count.</p>'
    else:
        kld = '<p class="empty">No token was scored against the base.</p>'
    depth = _hidden_error_chart(
        [d for _, d, _ in compared], [index for index, _, _ in compared], [name for _, _, name in compared], names
    )
    return (
        f'<section id="outputs" class="outputs">{head}'
        f'<div class="two"><div>{facts_html}</div><div><h3>KL divergence per token</h3>{kld}</div></div>'
        f"<h3>Hidden-state error along the depth</h3>{legend}{depth}</section>"
    )


def output_gates(gates: dict[str, float | None]) -> list[str]:
    """The output gates that are set, in words."""
    return [
        part
        for part in (
            f"max mean KL divergence {gates['max_kld']:g}" if gates.get("max_kld") is not None else "",
            f"min top-1 agreement {gates['min_top1']:g}" if gates.get("min_top1") is not None else "",
            f"max perplexity ratio {gates['max_ppl_ratio']:g}" if gates.get("max_ppl_ratio") is not None else "",
        )
        if part
    ]


def eval_page(document: dict[str, Any]) -> Page:
    """`qtool eval`'s page: what was evaluated, the verdict of its gates, and its outputs."""
    base = document["base"]
    gate_text = " · ".join(output_gates(document["gates"]))
    violations = document["violations"]
    result = "OK" if document["ok"] else counted(len(violations), "violation")
    facts = [
        ("model", f'<span class="mono">{shown(document["model"])}</span>'),
        ("base", f'<span class="mono">{shown(base["path"])}</span>' if base else "none: the perplexity only"),
        ("text", f'<span class="mono">{shown(document["text"])}</span>'),
        ("gates", text(gate_text or "none given")),
        ("time", text(f"{document['seconds']:.1f} s on {document['device']} ({document['dtype']})")),
        ("result", text(result)),
    ]
    facts += [("warning", shown(line)) for line in document.get("warnings") or []]
    return Page(
        kind="eval",
        title=f"qtool eval: {document['model']}" + (f" against {base['path']}" if base else ""),
        verdict=("PASS" if document["ok"] else f"FAIL: {result}", document["ok"]) if gate_text or violations else None,
        models=[],
        facts=facts,
        summary_title="Evaluation",
        problems_title="Violations",
        problems=[(line, None) for line in violations],
        series_names=[document["model"]],
        sections=[outputs_section([document], [document["model"]])],
    )
