"""`qtool compare`: two checkpoints, weight by weight; gates for CI."""

from __future__ import annotations

import math
from typing import Annotated, List, Optional

import typer

from qtool.cli.check import PolicyOpt
from qtool.cli.options import DeviceOpt, FormatOpt, JsonOpt, OutputFormat, QuietOpt
from qtool.cli.output import Column, Output, Rows, Section, print_error, print_warning, progress
from qtool.errors import ViolationError

__all__ = ["HELP", "compare_command"]

HELP = """Compare two checkpoints weight by weight: is B still close to A?

A is the reference (say the bf16 original), B the candidate (its GPTQ, AWQ,
compressed-tensors or GGUF version). Weights pair up by logical name; a GGUF side's LLaMA
names are read as Hugging Face names, and --map renames more. Both sides are dequantized on
--device, one pair at a time, and measured: SQNR (dB), relative RMSE, max abs error and
cosine. The table lists the worst weights first, then the weights only in A or only in B, the
model-wide SQNR and a histogram of per-weight SQNR. Exit status: 1 when a gate is breached,
shapes differ, or a weight holds NaN/Inf (one line each on stderr); 2 on bad usage or an
unreadable input.

\b
Examples:
  qtool compare model/ model-w4/ --min-sqnr 15 --max-missing 0
  qtool compare model/ model-q4_0.gguf --json | jq .summary
  qtool compare a/ b/ --map 're:^transformer\\.h\\.=model.layers.' --max-rel-rmse 0.1
"""

MapOpt = Annotated[
    Optional[List[str]],
    typer.Option("--map", help="Rename OLD=NEW before matching: re:REGEX (anchored) or a literal prefix; \\1 in NEW. Repeatable, applied in order."),
]


def _number(value, digits: str) -> str:
    return "—" if value is None else format(value, digits)


def compare_command(
    a: Annotated[str, typer.Argument(metavar="A", help="The reference checkpoint (a file, an index, a folder, a .gguf).", show_default=False)],
    b: Annotated[str, typer.Argument(metavar="B", help="The checkpoint measured against A.", show_default=False)],
    maps: MapOpt = None,
    min_sqnr: Annotated[Optional[float], typer.Option("--min-sqnr", help="Fail when a weight's SQNR is below this many dB.")] = None,
    max_rel_rmse: Annotated[Optional[float], typer.Option("--max-rel-rmse", help="Fail when a weight's relative RMSE is above this.", min=0)] = None,
    max_missing: Annotated[Optional[int], typer.Option("--max-missing", help="Fail when more weights than this have no counterpart.", min=0)] = None,
    policy: PolicyOpt = None,
    device: DeviceOpt = "cpu",
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
    comparison = api.prepare_compare(a, b, maps=chosen.maps)
    for note in (*comparison.a.notes, *comparison.b.notes):
        print_warning(note)
    with progress("comparing", comparison.total_bytes, quiet) as advance:
        api.run_compare(comparison, device=device, on_progress=advance)
    document = comparison.to_json(chosen.gates)
    _show(document, sink)
    try:
        comparison.raise_for_violations(chosen.gates)
    except ViolationError as exc:  # one line per violation, as `diff` and linters report
        for reason in exc.reasons:
            print_error(reason)
        raise typer.Exit(exc.exit_code) from None


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
        sqnr = "exact" if w["exact"] else w["sqnr_db"]
        row = [w["name"], *([w["name_b"]] if renamed else []), w["shape"], w["scheme_a"], w["scheme_b"], sqnr, w["rel_rmse"], w["max_abs_err"], w["cosine"], w["finding"]]
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
            ["model SQNR", "exact" if summary["sqnr_db"] is None and summary["measured"] else f"{_number(summary['sqnr_db'], '.2f')} dB"],
            ["model rel RMSE", _number(summary["rel_rmse"], ".4f")],
            ["worst weight", "—" if worst is None else f"{worst['name']} ({worst['finding'] or ('exact' if worst['exact'] else _number(worst['sqnr_db'], '.2f') + ' dB')})"],
            ["time", f"{document['seconds']:.1f} s on {document['device']}"],
            ["result", "OK" if document["ok"] else f"{len(document['violations'])} violations"],
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
        Section("Per-weight SQNR", [Column("SQNR"), Column("weights", justify="right"), Column("")], bins, show_header=False),
    ]
    sink.emit(document, table, sections)
