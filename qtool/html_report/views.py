"""Each report document turned into the parts of one page: header facts, problems (violations,
findings) linked to their rows, the depth chart's marks, the histograms, the bits-per-weight
bars and the table's columns and rows. Figures are taken from the documents as they are (the
JSON `--json` prints); only their presentation (units, rounding for display, order) is decided
here.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from qtool.html_report.bar_charts import bits_by_scheme_chart, sqnr_histogram_chart
from qtool.html_report.depth_chart import Axis, Mark, depth_chart
from qtool.html_report.eval_view import eval_page, output_gates, outputs_section
from qtool.html_report.page_parts import Page
from qtool.html_report.svg import attr, display, fmt_bytes, fmt_db, fmt_number, shown, text
from qtool.html_report.table_payload import Column
from qtool.message_text import counted
from qtool.weight_position import KINDS

__all__ = ["Page", "quantize_page", "compare_page", "check_page", "eval_page"]


def _sqnr_status(weight: dict[str, Any]) -> str:
    """Why a quantize row's SQNR is null: no error at all, or an all-zero original."""
    if weight["sqnr_db"] is not None:
        return ""
    return "exact" if not weight.get("max_abs_err") else "no signal"


def _pair_status(weight: dict[str, Any]) -> str:
    """A compare row's status, in the words the summary and the histogram count with: a finding,
    an exact copy (measured, no error), an integer tensor (compared for equality, not measured),
    no signal (A all zeros, B not), or nothing (measured, with an error: its SQNR says it)."""
    if weight["finding"] is not None:
        return f"finding: {weight['finding']}"
    if weight.get("integer"):
        return "integer, equal"
    if weight["exact"]:
        return "exact"
    return "no signal" if weight["sqnr_db"] is None and weight.get("max_abs_err") else ""


def _compare_counts(summary: dict[str, Any]) -> str:
    """The summary's counts as parts that add up: matched = measured (with an error + exact + no
    signal) + integer tensors (equal) + findings. The document's `exact` counts the equal integer
    tensors too; the histogram and the table's "exact" count measured weights only, so the page
    says which is which."""
    histogram = summary["histogram"]
    in_bins = sum(b["weights"] for b in histogram["bins"])
    integer = summary.get("integer") or {"compared": 0, "equal": 0}
    measured = [counted(in_bins, "with an error", "with an error"), f"{histogram['exact']} exact"]
    if histogram["no_signal"]:
        measured.append(f"{histogram['no_signal']} with no signal in A")
    unplaced = summary["measured"] - in_bins - histogram["exact"] - histogram["no_signal"]
    if unplaced:
        measured.append(counted(unplaced, "without a figure", "without a figure"))
    parts = [f"{summary['measured']} measured ({', '.join(measured)})"]
    if integer["equal"] or integer["compared"]:
        parts.append(f"{counted(integer['equal'], 'integer tensor')}, equal (compared for equality, not measured)")
    else:
        parts.append("0 integer tensors")
    parts.append(counted(summary["findings"], "finding"))
    other = summary["matched"] - summary["measured"] - integer["equal"] - summary["findings"]
    if other:
        parts.append(counted(other, "other", "other"))
    return (
        f"{summary['matched']} matched ({summary['weights_a']} in A, {summary['weights_b']} in B): {' + '.join(parts)}; "
        f"{summary['only_in_a']} only in A, {summary['only_in_b']} only in B"
    )


def _shape(shape: Sequence[int]) -> str:
    return "×".join(str(d) for d in shape) if shape else "scalar"


def _position(weight: dict[str, Any]) -> dict[str, Any]:
    return {"layer": weight.get("layer"), "kind": weight.get("kind") or "other", "expert": weight.get("expert")}


def _kinds(marks: Sequence[Mark]) -> list[str]:
    """The kinds plotted, in the legend's order (qtool.weight_position.KINDS, then other)."""
    found = {m.kind or "other" for m in marks}
    return [k for k in KINDS if k in found] + (["other"] if "other" in found else [])


def _worst_fact(name: str | None, value: float | None, note: str = "") -> str:
    if name is None:
        return "—"
    figure = note or fmt_db(value)
    return f'<a href="#weight={attr(_url(name))}" class="weight-link">{shown(name)}</a> ({text(figure)})'


def _url(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


def _link_problem(line: str, names: set[str]) -> tuple[str, str | None]:
    """A violation line `NAME: what` linked to NAME's row when NAME is a weight of the table."""
    cut = line.find(": ")
    while cut != -1:
        if line[:cut] in names:
            return line, line[:cut]
        cut = line.find(": ", cut + 1)
    return line, None


# -- quantize ------------------------------------------------------------------------------------


def quantize_page(document: dict[str, Any]) -> Page:
    summary = document["summary"]
    weights = document["weights"]
    models = document.get("models", {})
    worst = next((w for w in weights if w["sqnr_db"] is not None), None)
    marks = [
        Mark(
            0,
            w["layer"],
            w["kind"],
            w["expert"],
            w["sqnr_db"],
            w["name"],
            f"max abs err {fmt_number(w['max_abs_err'] or 0)} · {fmt_bytes(w['bytes_after'])}",
        )
        for w in weights
        if w["sqnr_db"] is not None
    ]
    schemes = [s for s in models.get("output", {}).get("by_scheme", {}) if s != "plain"]
    facts = [
        ("layout", text(document["layout"])),
        ("schemes", text(", ".join(schemes) or "—")),
        ("weights quantized", text(f"{summary['quantized_weights']} of {summary['weights']}")),
        ("SQNR, quantized weights", text(fmt_db(summary.get("quantized", {}).get("sqnr_db")))),
        ("SQNR, all weights", text(fmt_db(summary.get("all_weights", {}).get("sqnr_db")))),
        ("worst weight", _worst_fact(worst["name"] if worst else None, worst["sqnr_db"] if worst else None)),
        ("gate", "none: <code>qtool compare --min-sqnr</code> and <code>qtool check</code> gate a release"),
        ("time", text(f"{document['seconds']:.1f} s on {document['device']}")),
    ]
    columns = [
        Column("name", "weight", "name", sort="asc"),
        Column("layer", "layer", "number", sort="asc"),
        Column("kind", "kind", "text"),
        Column("shape", "shape", "text"),
        Column("scheme", "scheme", "text"),
        Column(
            "sqnr_db",
            "SQNR",
            "db",
            "dB",
            sort="asc",
            title="signal-to-quantization-noise ratio; lower is worse",
            status="status",
        ),
        Column("max_abs_err", "max abs error", "number", sort="desc"),
        Column("bytes_before", "bytes before", "bytes", "B", sort="desc"),
        Column("bytes_after", "bytes after", "bytes", "B", sort="desc"),
        Column("status", "note", "text"),
    ]
    rows = [{**w, **_position(w), "shape": _shape(w["shape"]), "status": _sqnr_status(w)} for w in weights]
    return Page(
        kind="quantize",
        title=f"qtool quantize: {document['input']} → {document['output']}",
        verdict=None,
        models=[("input", models["input"]), ("output", models["output"])] if models else [],
        facts=facts,
        depth=depth_chart(
            marks, Axis("SQNR", "dB", "low"), [""], label="SQNR of each weight along the depth of the model"
        ),
        depth_caption=f"{counted(len(marks), 'quantized weight')} with an error; the worst of each kind per layer.",
        series_names=[document["output"]],
        kinds=_kinds(marks),
        histogram=sqnr_histogram_chart(
            [summary["histogram"]], [document["output"]], threshold=None, label="histogram of per-weight SQNR"
        )
        if "histogram" in summary
        else None,
        histogram_caption="The quantized weights per 5 dB bin; exact: quantized with no error at all.",
        bits=bits_by_scheme_chart(
            [
                (role, m, series)
                for role, m, series in (("input", models.get("input"), None), ("output", models.get("output"), 0))
                if m
            ],
            label="bits per weight by scheme",
        ),
        columns=columns,
        rows=rows,
        table_caption="Every quantized weight, worst first.",
    )


# -- compare -------------------------------------------------------------------------------------


def compare_page(documents: Sequence[dict[str, Any]]) -> Page:
    """One comparison, or several candidates against the same A (overlaid, one series each)."""
    first = documents[0]
    overlay = len(documents) > 1
    names = [d["b"] for d in documents]
    gates = first["gates"]
    failed = [d for d in documents if not d["ok"]]
    verdict_text = (
        "PASS"
        if not failed
        else "FAIL: "
        + ", ".join(counted(len(d["violations"]), "violation") + (f" in {d['b']}" if overlay else "") for d in failed)
    )
    gate_text = " · ".join(
        part
        for part in (
            f"min SQNR {gates['min_sqnr']:g} dB" if gates["min_sqnr"] is not None else "",
            f"max relative RMSE {gates['max_rel_rmse']:g}" if gates["max_rel_rmse"] is not None else "",
            f"max missing {gates['max_missing']}" if gates["max_missing"] is not None else "",
            *output_gates((first.get("outputs") or {}).get("gates") or {}),
        )
        if part
    )
    facts: list[tuple[str, str]] = [
        ("gates", text(gate_text or "none given (shape mismatches and NaN/Inf always fail)"))
    ]
    for d in documents:
        s = d["summary"]
        who = f" ({display(d['b'])})" if overlay else ""
        worst = s["worst"]
        worst_note = (worst or {}).get("finding") or ("exact" if worst and worst["exact"] else "")
        facts += [
            (
                f"model SQNR{who}",
                text(fmt_db(s["sqnr_db"]) if s["sqnr_db"] is not None or not s["measured"] else "exact"),
            ),
            (f"weights{who}", text(_compare_counts(s))),
            (
                f"worst weight{who}",
                _worst_fact(worst["name"] if worst else None, worst["sqnr_db"] if worst else None, worst_note),
            ),
        ]
    facts.append(("time", text(", ".join(f"{d['seconds']:.1f} s" for d in documents) + f" on {first['device']}")))
    table_names = {w["name"] for d in documents for w in d["weights"]}
    problems: list[tuple[str, str | None]] = []
    for d in documents:
        for line in d["violations"]:
            problems.append((f"{d['b']}: {line}" if overlay else line, _link_problem(line, table_names)[1]))
    for d in documents:
        for name in d["only_in_a"][:50]:
            problems.append((f"only in A{(' (not in ' + d['b'] + ')') if overlay else ''}: {name}", None))
        for name in d["only_in_b"][:50]:
            problems.append((f"only in {d['b'] if overlay else 'B'}: {name}", None))
    marks = [
        Mark(
            series,
            w["layer"],
            w["kind"],
            w["expert"],
            w["sqnr_db"],
            w["name"],
            f"max abs err {fmt_number(w['max_abs_err'] or 0)} · {fmt_bytes(w.get('bytes_b'))}",
        )
        for series, d in enumerate(documents)
        for w in d["weights"]
        if w["sqnr_db"] is not None and w["finding"] is None
    ]
    threshold = gates["min_sqnr"]
    axis = Axis("SQNR", "dB", "low", threshold, f"gate: min SQNR {threshold:g} dB" if threshold is not None else "")
    columns, rows = _compare_table(documents)
    # (role, summary, series): a candidate's series is its colour in every chart; A has none
    drawn = [("A", first["models"]["a"], None)] if first.get("models") else []
    drawn += [
        ("B" if not overlay else f"B{index + 1}", d["models"]["b"], index)
        for index, d in enumerate(documents)
        if d.get("models")
    ]
    models = [(role, model) for role, model, _ in drawn]
    return Page(
        kind="compare",
        title=f"qtool compare: {first['a']} vs {', '.join(names)}",
        verdict=(verdict_text, not failed),
        models=models,
        facts=facts,
        problems_title="Violations" if any(d["violations"] for d in documents) else "Weights without a counterpart",
        problems=problems,
        depth=depth_chart(
            marks,
            axis,
            names,
            label="SQNR of each weight along the depth of the model"
            + (", one series per candidate" if overlay else ""),
        ),
        depth_caption=f"{_plotted(marks, names)} (exact copies, integer tensors and findings are not plotted); the worst of each kind per layer.",
        series_names=names,
        kinds=_kinds(marks),
        histogram=sqnr_histogram_chart(
            [d["summary"]["histogram"] for d in documents],
            names,
            threshold=threshold,
            label="histogram of per-weight SQNR",
        ),
        histogram_caption="The measured weights"
        + (" of each candidate" if overlay else "")
        + " per 5 dB bin; exact: measured with no error at all. Integer tensors (compared for equality) and findings are not measured.",
        bits=bits_by_scheme_chart(drawn, label="bits per weight by scheme"),
        columns=columns,
        rows=rows,
        table_caption="Every matched weight, worst first" + (f" (in {names[0]})." if overlay else "."),
        sections=[section for section in (outputs_section([d.get("outputs") for d in documents], names),) if section],
    )


def _plotted(marks: Sequence[Mark], names: Sequence[str]) -> str:
    """How many weights the depth chart plots: one count, or one per candidate."""
    counts = [sum(1 for m in marks if m.series == series) for series in range(len(names))]
    if len(counts) == 1:
        return counted(counts[0], "measured weight") + " with an error"
    if len(set(counts)) == 1:
        return f"{counted(counts[0], 'measured weight')} with an error for each candidate"
    return "measured weights with an error: " + ", ".join(f"{n} in {display(name)}" for n, name in zip(counts, names))


def _compare_table(documents: Sequence[dict[str, Any]]) -> tuple[list[Column], list[dict[str, Any]]]:
    overlay = len(documents) > 1
    columns = [
        Column("name", "weight", "name"),
        Column("layer", "layer", "number"),
        Column("kind", "kind", "text"),
        Column("shape", "shape", "text"),
        Column("scheme_a", "scheme A", "text"),
    ]
    for index in range(len(documents)):
        suffix = f"@{index}"
        who = f" B{index + 1}" if overlay else " B"
        columns += [
            Column("scheme_b" + suffix, "scheme" + who, "text"),
            Column(
                "sqnr_db" + suffix,
                "SQNR" + (who if overlay else ""),
                "db",
                "dB",
                "asc",
                "SQNR against A; lower is worse",
                status="status" + suffix,
            ),
            Column("max_abs_err" + suffix, "max abs error" + (who if overlay else ""), "number", sort="desc"),
            Column("bytes_b" + suffix, "bytes" + who, "bytes", "B", sort="desc"),
            Column(
                "status" + suffix,
                "status" + (who if overlay else ""),
                "text",
                title="finding, exact (measured, no error), integer (compared for equality) or no signal; empty: measured, with an error",
            ),
        ]
    rows: dict[str, dict[str, Any]] = {}
    for index, d in enumerate(documents):
        suffix = f"@{index}"
        for w in d["weights"]:
            row = rows.get(w["name"])
            if row is None:
                row = rows[w["name"]] = {
                    "name": w["name"],
                    **_position(w),
                    "shape": _shape(w["shape"]),
                    "scheme_a": w["scheme_a"] or "plain",
                }
            row.update(
                {
                    "scheme_b" + suffix: w["scheme_b"] or "plain",
                    "sqnr_db" + suffix: w["sqnr_db"],
                    "max_abs_err" + suffix: w["max_abs_err"],
                    "bytes_b" + suffix: w.get("bytes_b"),
                    "status" + suffix: _pair_status(w),
                }
            )
    return columns, list(rows.values())


# -- check ---------------------------------------------------------------------------------------


def check_page(document: dict[str, Any]) -> Page:
    policy = document.get("policy", {})
    weights = document.get("weight_rows", [])
    findings = document["findings"]
    by_weight: dict[str, list[str]] = {}
    for finding in findings:
        if finding["weight"] is not None:
            by_weight.setdefault(finding["weight"], []).append(finding["rule"])
    names = {w["name"] for w in weights}
    rules = []
    if policy.get("expect_scheme"):
        rules.append(f"expect-scheme {policy['expect_scheme']}")
    rules += [f"require-quantized {p}" for p in policy.get("require_quantized", [])]
    rules += [f"allow-plain {p}" for p in policy.get("allow_plain", [])]
    if policy.get("max_bits_per_weight") is not None:
        rules.append(f"max-bits-per-weight {policy['max_bits_per_weight']:g} bits/weight")
    rules += [name for name, key in (("fail-on-unknown", "fail_on_unknown"), ("no-nan", "no_nan")) if policy.get(key)]
    facts = [
        ("policy", text(" · ".join(rules) or "no rule given")),
        ("rules applied", text(", ".join(document["rules"]) or "none (no rule given and no quantization_config)")),
        ("weights", text(str(document["weights"]))),
        ("findings", text(str(len(findings)))),
    ]
    threshold = policy.get("max_bits_per_weight")
    marks = [
        Mark(
            0,
            w["layer"],
            w["kind"],
            w["expert"],
            w["bits_per_weight"],
            w["name"],
            f"{w['scheme'] or 'plain'} · {fmt_bytes(w['bytes'])}",
        )
        for w in weights
    ]
    axis = Axis(
        "bits per weight",
        "bits",
        "high",
        threshold,
        f"max bits per weight {threshold:g} (over the whole checkpoint)" if threshold is not None else "",
    )
    columns = [
        Column("name", "weight", "name"),
        Column("layer", "layer", "number"),
        Column("kind", "kind", "text"),
        Column("shape", "shape", "text"),
        Column("dtype", "dtype", "text"),
        Column("scheme", "scheme", "text"),
        Column("bits_per_weight", "bits per weight", "number", "bits", sort="desc"),
        Column("bytes", "bytes", "bytes", "B", sort="desc"),
        Column("findings", "findings", "text", sort="desc"),
    ]
    rows = [
        {
            **w,
            **_position(w),
            "shape": _shape(w["shape"]),
            "scheme": w["scheme"] or "plain",
            "findings": ", ".join(by_weight.get(w["name"], [])),
        }
        for w in weights
    ]
    rows.sort(key=lambda row: not row["findings"])  # stable: rows with findings first, then in the document's order
    model = document.get("model")
    return Page(
        kind="check",
        title=f"qtool check: {document['path']}",
        verdict=("PASS" if document["ok"] else f"FAIL: {counted(len(findings), 'finding')}", document["ok"]),
        models=[("checkpoint", model)] if model else [],
        facts=facts,
        problems_title="Findings",
        problems=[
            (
                f"{f['rule']}: {f['weight'] + ': ' if f['weight'] else ''}{f['detail']}",
                f["weight"] if f["weight"] in names else None,
            )
            for f in findings
        ],
        depth=depth_chart(
            marks, axis, [document["path"]], label="bits per weight of each weight along the depth of the model"
        ),
        depth_caption="Bits per weight of every weight (the check reads headers, so there is no error to plot); the highest of each kind per layer.",
        series_names=[document["path"]],
        kinds=_kinds(marks),
        bits=bits_by_scheme_chart([("checkpoint", model, 0)], label="bits per weight by scheme") if model else "",
        columns=columns,
        rows=rows,
        table_caption="Every weight; those with findings first.",
    )
