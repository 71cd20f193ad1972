"""`qtool compare`: two checkpoints, weight by weight; gates for CI."""

from __future__ import annotations

import math
from typing import Annotated

import typer

from qtool.cli.check import PolicyOpt
from qtool.cli.eval import (
    CtxOpt,
    DtypeOpt,
    MaxKldOpt,
    MaxPplRatioOpt,
    MinTop1Opt,
    WindowsOpt,
    show_outputs,
)
from qtool.cli.options import (
    DeviceOpt,
    ThreadsOpt,
    FormatOpt,
    HtmlOpt,
    JsonOpt,
    OutputFormat,
    QuietOpt,
    ReportOpt,
    ReportOverwriteOpt,
)
from qtool.cli.output import Column, Output, Rows, Section, print_error, print_status, print_warning, progress
from qtool.errors import UsageError, ViolationError
from qtool.message_text import counted
from qtool.patterns import REGEX_HELP

__all__ = ["HELP", "compare_command"]

HELP = """Compare two checkpoints weight by weight: is B still close to A?

A is the reference (say the bf16 original), B the candidate (its GPTQ, AWQ,
compressed-tensors or GGUF version). Weights pair up by logical name; a GGUF side's LLaMA
names are read as Hugging Face names, and --map renames more. Both sides are dequantized on
--device, one pair at a time, and measured: SQNR (dB), relative RMSE, max abs error and
cosine. The table lists the worst weights first, then the weights only in A or only in B, the
model-wide SQNR and a histogram of per-weight SQNR. An AWQ candidate is measured against
A's weights times the smoothing scales its norms give; the weights smoothed through a
quantized Linear (up_proj -> down_proj) get no SQNR, and one warning line says so. Exit status: 1 when a gate is breached,
shapes differ, or a weight holds NaN/Inf (one line each on stderr); 2 on bad usage, an
unreadable input, or when no weight pairs at all (1 under a gate): nothing compared never passes.

With --text, the models are also compared where it matters, on their outputs: A and each
candidate run in lockstep on the text, one decoder layer of each in memory at a time (what
qtool eval --base does): the mean, median, p99 and max KL divergence of B's next-token
distributions from A's, their top-1 agreement, both perplexities and each layer's hidden-state
error, in --json's "outputs"; --max-kld, --min-top1 and --max-ppl-ratio gate them. This is
how to gate an AWQ model, whose smoothed weights weight SQNR cannot judge.

More candidates (A B C ...) are each measured against A: the table then gives each one's SQNR
per weight, --json a document holding each comparison, and --html one page with them overlaid
(one colour, dash and fill each), e.g. minmax against mse, or RTN against GPTQ.

\b
Examples:
  qtool compare model/ model-w4/ --min-sqnr 15 --max-missing 0
  qtool compare model/ model-q4_0.gguf --json | jq .summary
  qtool compare a/ b/ --map 're:^transformer\\.h\\.=model.layers.' --max-rel-rmse 0.1
  qtool compare model/ model-w4/ --min-sqnr 15 --html compare.html
  qtool compare model/ model-minmax/ model-mse/ --html overlay.html
  qtool compare model/ model-awq/ --text wiki.test.txt --windows 16 --max-kld 0.05 --min-top1 0.9
"""

MapOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--map",
        help=f"Rename OLD=NEW before matching: re:REGEX (anchored; {REGEX_HELP}) or a literal prefix; \\1 in NEW. Repeatable, applied in order.",
    ),
]


NOTHING_HINT = (
    "pair the names with --map OLD=NEW (a GGUF dequantized back keeps GGUF names), or compare two versions of one model"
)


def _number(value, digits: str) -> str:
    return "—" if value is None else format(value, digits)


def _model_sqnr(summary: dict) -> str:
    """The model SQNR as the summary shows it: null is "exact" when something was measured,
    and "n/a" when nothing was (never a figure that was not measured)."""
    if not summary["measured"]:
        return "n/a (nothing measured)"
    return "exact" if summary["sqnr_db"] is None else f"{_number(summary['sqnr_db'], '.2f')} dB"


def _sqnr_cell(weight: dict):
    """A weight's SQNR cell: "exact", "smoothed" (AWQ's smoothing leaves it no error figure:
    a norm holding the scales, a Linear smoothed through a quantized one), or the figure."""
    if weight["exact"]:
        return "exact"
    if weight.get("smoothing") and weight["sqnr_db"] is None and weight["finding"] is None:
        return "smoothed"
    return weight["sqnr_db"]


def compare_command(
    a: Annotated[
        str,
        typer.Argument(
            metavar="A", help="The reference checkpoint (a file, an index, a folder, a .gguf).", show_default=False
        ),
    ],
    b: Annotated[str, typer.Argument(metavar="B", help="The checkpoint measured against A.", show_default=False)],
    more: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[C ...]", help="More candidates, each measured against A (overlaid in --html).", show_default=False
        ),
    ] = None,
    maps: MapOpt = None,
    min_sqnr: Annotated[
        float | None, typer.Option("--min-sqnr", help="Fail when a weight's SQNR is below this many dB.")
    ] = None,
    max_rel_rmse: Annotated[
        float | None, typer.Option("--max-rel-rmse", help="Fail when a weight's relative RMSE is above this.", min=0)
    ] = None,
    max_missing: Annotated[
        int | None, typer.Option("--max-missing", help="Fail when more weights than this have no counterpart.", min=0)
    ] = None,
    policy: PolicyOpt = None,
    text: Annotated[
        str | None,
        typer.Option(
            "--text",
            help='Also compare the outputs on this text (a .txt, a .jsonl with a "text" field, or a folder of them).',
            show_default=False,
        ),
    ] = None,
    ctx: CtxOpt = 512,
    windows: WindowsOpt = None,
    max_kld: MaxKldOpt = None,
    min_top1: MinTop1Opt = None,
    max_ppl_ratio: MaxPplRatioOpt = None,
    dtype: DtypeOpt = "float32",
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    html: HtmlOpt = None,
    report: ReportOpt = None,
    overwrite: ReportOverwriteOpt = False,
    fmt: FormatOpt = OutputFormat.auto,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from qtool import api
    from qtool.api import load_policy

    sink = Output("json" if json_ else fmt.value)
    chosen = load_policy(policy).with_compare_options(
        min_sqnr=min_sqnr, max_rel_rmse=max_rel_rmse, max_missing=max_missing, maps=tuple(maps or ())
    )
    output_gates = api.OutputGates(max_kld=max_kld, min_top1=min_top1, max_ppl_ratio=max_ppl_ratio)
    if output_gates.any_set and text is None:
        raise UsageError("the output gates measure the outputs on a text, and none is given", option="text")
    comparisons = [api.prepare_compare(a, candidate, maps=chosen.maps) for candidate in (b, *(more or ()))]
    for comparison in comparisons:  # nothing paired: bad input, unless a gate makes it a violation (exit 1)
        reason = comparison.nothing_compared()
        if reason and not chosen.gates.any_set and text is None:
            raise UsageError(f"{comparison.b.path}: {reason}", hint=NOTHING_HINT)
    if report is not None or html is not None:  # before the measuring, which may take long
        api.refuse_report_paths(
            [c for comparison in comparisons for c in (comparison.a, comparison.b)],
            [report, html],
            overwrite=overwrite,
            text=text,
        )
    for note in dict.fromkeys(note for c in comparisons for note in (*c.a.notes, *c.b.notes)):
        print_warning(note)
    with progress("comparing", sum(c.total_bytes for c in comparisons), quiet) as advance:
        for comparison in comparisons:
            api.run_compare(comparison, device=device, on_progress=advance)
    for comparison in comparisons:  # AWQ's smoothing: what was measured how, one line per run
        line = comparison.smoothing_line()
        if line:
            print_warning(f"{comparison.b.path}: {line}" if len(comparisons) > 1 else line)
    documents = [comparison.to_json(chosen.gates) for comparison in comparisons]
    if text is not None:  # the outputs, candidate by candidate against A
        if len(comparisons) > 1:
            print_status(f"outputs: {len(comparisons)} candidates against {a}", quiet)
        for comparison, document in zip(comparisons, documents):
            outputs = api.evaluate(
                comparison.b.path, text, base=a, ctx=ctx, windows=windows, device=device, dtype=dtype, threads=threads,
                gates=output_gates,
            )  # fmt: skip
            for warning in outputs["warnings"]:
                print_warning(warning)
            document["outputs"] = outputs
            document["violations"] = [*document["violations"], *outputs["violations"]]
            document["ok"] = not document["violations"]
    if report is not None:
        api.write_report(report, "compare", documents, overwrite=overwrite)
    if html is not None:
        api.write_report(html, "compare", documents, html=True, overwrite=overwrite)
    if len(documents) == 1:
        _show(documents[0], sink)
    else:
        _show_overlay(documents, sink)
    lines = []
    for comparison, document in zip(comparisons, documents):
        reasons = []
        try:
            comparison.raise_for_violations(chosen.gates)
        except ViolationError as exc:  # one line per violation, as `diff` and linters report
            reasons = list(exc.reasons)
        reasons += (document.get("outputs") or {}).get("violations", [])
        lines += [f"{comparison.b.path}: {reason}" if len(comparisons) > 1 else reason for reason in reasons]
    if lines:
        for line in lines:
            print_error(line)
        raise typer.Exit(ViolationError.exit_code) from None


def _show_overlay(documents: list[dict], sink: Output) -> None:
    """Several candidates: one row per weight with each candidate's SQNR (A's order, worst of
    the first candidate first), and one summary line per candidate."""
    from qtool.api import overlay_document

    by_name = [{w["name"]: w for w in d["weights"]} for d in documents]
    columns = [Column("weight"), Column("shape")]
    for index in range(len(documents)):
        columns += [
            Column(f"B{index + 1} scheme", human=lambda v: v or "plain"),
            Column(
                f"B{index + 1} SQNR dB", human=lambda v: v if isinstance(v, str) else _number(v, ".2f"), justify="right"
            ),
        ]
    rows = []
    for w in documents[0]["weights"]:
        row = [w["name"], w["shape"]]
        for weights in by_name:
            other = weights.get(w["name"])
            if other is None:
                row += [None, "—"]
            else:
                row += [other["scheme_b"], other["finding"] or _sqnr_cell(other)]
        rows.append(row)
    table = Rows(columns, rows, title=f"{documents[0]['a']} vs {len(documents)} candidates, worst of B1 first")
    facts = []
    for index, d in enumerate(documents):
        s = d["summary"]
        worst = s["worst"]
        facts.append(
            [
                f"B{index + 1}",
                d["b"],
                _model_sqnr(s),
                "—"
                if worst is None
                else f"{worst['name']} ({worst['finding'] or ('exact' if worst['exact'] else _number(worst['sqnr_db'], '.2f') + ' dB')})",
                "OK" if d["ok"] else counted(len(d["violations"]), "violation"),
            ]
        )
    summary = Section(
        "Candidates",
        [Column("B"), Column("path"), Column("model SQNR", justify="right"), Column("worst weight"), Column("result")],
        facts,
    )
    sink.emit(overlay_document(documents), table, [summary])


def _smoothed(smoothing: dict) -> str:
    return f"{smoothing['norms']} norms; {smoothing['rescaled']} weights measured against A times their scales, {smoothing['unrecovered']} not measured"


def _show(document: dict, sink: Output) -> None:
    weights = document["weights"]
    renamed = any(w["name"] != w["name_b"] for w in weights)
    columns = [Column("weight")]
    if renamed:
        columns.append(Column("in B"))
    columns += [
        Column("shape"),
        Column("A", human=lambda v: v or "plain"),
        Column("B", human=lambda v: v or "plain"),
        Column("SQNR dB", human=lambda v: v if isinstance(v, str) else _number(v, ".2f"), justify="right"),
        Column("rel RMSE", human=lambda v: _number(v, ".4f"), justify="right"),
        Column("max abs err", human=lambda v: _number(v, ".4g"), justify="right"),
        Column("cosine", human=lambda v: _number(v, ".6f"), justify="right"),
        Column("finding", human=lambda v: v or ""),
    ]
    rows = []
    for w in weights:
        sqnr = _sqnr_cell(w)
        row = [
            w["name"],
            *([w["name_b"]] if renamed else []),
            w["shape"],
            w["scheme_a"],
            w["scheme_b"],
            sqnr,
            w["rel_rmse"],
            w["max_abs_err"],
            w["cosine"],
            w["finding"],
        ]
        rows.append(row)
    table = Rows(columns, rows, title=f"{document['a']} vs {document['b']}, worst first")
    summary = document["summary"]
    worst = summary["worst"]
    facts = Section(
        "Summary",
        [Column("fact"), Column("value", justify="right")],
        [
            ["weights", f"{summary['matched']} matched ({summary['weights_a']} in A, {summary['weights_b']} in B)"],
            ["measured", f"{summary['measured']} ({summary['exact']} exact)"],
            ["findings", str(summary["findings"])],
            ["only in A / only in B", f"{summary['only_in_a']} / {summary['only_in_b']}"],
            ["model SQNR", _model_sqnr(summary)],
            *([["smoothed (AWQ)", _smoothed(summary["smoothing"])]] if summary.get("smoothing") else []),
            [
                "model rel RMSE",
                _number(summary["rel_rmse"], ".4f") if summary["measured"] else "n/a (nothing measured)",
            ],
            [
                "worst weight",
                "—"
                if worst is None
                else f"{worst['name']} ({worst['finding'] or ('exact' if worst['exact'] else _number(worst['sqnr_db'], '.2f') + ' dB')})",
            ],
            ["time", f"{document['seconds']:.1f} s on {document['device']}"],
            *([[f"outputs: {k}", v] for k, v in show_outputs(document["outputs"])] if document.get("outputs") else []),
            ["result", "OK" if document["ok"] else counted(len(document["violations"]), "violation")],
        ],
        show_header=False,
    )
    histogram = summary["histogram"]
    most = max([b["weights"] for b in histogram["bins"]] + [histogram["exact"], 1])

    def bar(count: int) -> str:
        return "█" * math.ceil(24 * count / most) if count else ""

    bins = [[f"{b['from_db']} – {b['to_db']} dB", b["weights"], bar(b["weights"])] for b in histogram["bins"]]
    if histogram["exact"]:
        bins.append(["exact", histogram["exact"], bar(histogram["exact"])])
    sections = [
        Section("Only in A", [Column("weight")], [[name] for name in document["only_in_a"]], show_header=False),
        Section("Only in B", [Column("weight")], [[name] for name in document["only_in_b"]], show_header=False),
        facts,
        Section(
            "Per-weight SQNR", [Column("SQNR"), Column("weights", justify="right"), Column("")], bins, show_header=False
        ),
    ]
    sink.emit(document, table, sections)
