"""`qtool inspect`: what is in a checkpoint, weight by weight."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from qtool.cli.options import CheckpointArg, FilterOpt, FormatOpt, JsonOpt, OutputFormat, QuietOpt
from qtool.cli.output import Column, Output, Rows, Section, print_warning, progress
from qtool.cli.text import human_bytes, human_count
from qtool.gcpause import paused_gc

HELP = """Show every weight of a checkpoint: shape, dtype, quantization scheme, size.

A quantized weight's packed data, scales and zero points are one row. Plain tensors show
'—' as their scheme. Only the headers are read, unless --stats is given.

A quantization config field of the wrong JSON type ("ignore": 5) is an error naming the file
and the field (exit 2). Tensors that half-fit a convention (a scale stored as F6, a torchao
record of the wrong type) stay plain, with a note saying why.

\b
Examples:
  qtool inspect model/                           # a folder, file, or *.index.json
  qtool inspect model.safetensors --json | jq .summary
  qtool inspect model/ -k 're:.*\\.mlp\\.' --no-collapse
  qtool inspect model/ --raw -f tsv              # stored tensors, not weights
  qtool inspect model/ -k 'pooler*'              # the summary covers the weights listed
  qtool inspect model/ --stats                   # min/max/mean/std/NaN per plain weight
  qtool inspect imatrix.gguf                     # a llama.cpp importance matrix (or .dat)
"""

NO_SCHEME = "—"


def inspect_command(
    path: CheckpointArg,
    fmt: FormatOpt = OutputFormat.auto,
    json_: JsonOpt = False,
    filter_: FilterOpt = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="List the stored tensors of the weights reported instead of the weights.")
    ] = False,
    collapse: Annotated[
        bool, typer.Option("--collapse/--no-collapse", help="Fold repeated layers into one row (human table only).")
    ] = True,
    stats: Annotated[
        bool, typer.Option("--stats", help="Read the data and add value statistics per plain weight.")
    ] = False,
    quiet: QuietOpt = False,
) -> None:
    from qtool import api

    output = Output("json" if json_ else fmt.value, collapse=collapse)
    if stats:
        api.refuse_remote_data(path)  # before any open, which would need the network
    imatrix = None if raw else api.imatrix_of(path)  # a legacy .dat has no header to tell by
    if imatrix is not None:
        return _show_imatrix(output, imatrix, filter_)
    with paused_gc(freeze=True):  # a header of 1.6M tensors makes millions of objects and no cycles
        report = api.inspect(path, filter=filter_)
        imatrix = None if raw else api.imatrix_of(path, report)
        if imatrix is not None:
            return _show_imatrix(output, imatrix, filter_)
        for note in report.checkpoint.notes:
            print_warning(note)
        if filter_ is not None and not report.weights:  # a typo lists nothing, and says so
            print_warning(f"-k {filter_!r} matches no weight in {path}")
        if stats:
            total = sum(w.nbytes for w in report.weights if not w.quantized)
            with progress("reading", total, quiet) as advance:
                report = api.collect_stats(report, advance)
        as_json = output.format == "json"  # the document is all JSON prints: no rows to build
        document = report.to_json(lazy=as_json and not raw)
        if raw:  # the stored tensors of the weights reported, so they add up to the summary
            tensors = report.tensors
            document["tensors"] = [
                {
                    "name": t.name,
                    "dtype": t.dtype.name,
                    "shape": list(t.shape),
                    "bytes": t.nbytes,
                    "file": t.file,
                    "offset": t.begin,
                }
                for t in tensors
            ]
            output.emit(document, None if as_json else _tensor_rows(tensors))
        else:
            output.emit(
                document,
                None if as_json else _weight_rows(document["weights"], stats),
                () if as_json else _summary_sections(document),
            )


def _show_imatrix(output: Output, imatrix: Any, filter_: str | None) -> None:
    """An importance matrix: the weights it covers (its own `--json` document, kind "imatrix")."""
    from qtool.patterns import compile_pattern

    document = imatrix.to_json()
    if filter_ is not None:
        matches = compile_pattern(filter_)
        document["tensors"] = [t for t in document["tensors"] if matches(t["name"])]
        if not document["tensors"]:
            print_warning(f"-k {filter_!r} matches no tensor in {imatrix.path}")
    if output.format == "json":
        return output.emit(document, None)
    counted = "tokens" if document["format"] == "gguf" else "chunks"  # a legacy file keeps ncall: chunks, rounded up
    columns = [
        Column("name"),
        Column("columns", justify="right"),
        Column("experts", justify="right"),
        Column(counted, justify="right"),
    ]
    rows = [[t["name"], t["columns"], t["matrices"], _tokens(t["counts"])] for t in document["tensors"]]
    key, value = Column("fact"), Column("value", justify="right")
    facts = [
        ["format", "GGUF imatrix" if document["format"] == "gguf" else "legacy imatrix (.dat)"],
        ["tensors covered", document["entries"]],
        ["chunks", document["chunk_count"]],
        ["chunk size", document["chunk_size"] or "not recorded"],
        ["datasets", ", ".join(document["datasets"]) or NO_SCHEME],
    ]
    output.emit(
        document,
        Rows(columns, rows, collapse_keys=(1, 2, 3), title="Importance matrix"),
        [Section("Summary", [key, value], facts, show_header=False)],
    )


def _tokens(counts: list[int]) -> str:
    """A 2-D weight's token count; an expert tensor's smallest and largest."""
    return str(counts[0]) if len(set(counts)) == 1 else f"{min(counts)}..{max(counts)}"


def _weight_rows(weights: list[dict[str, Any]], stats: bool) -> Rows:
    columns = [
        Column("name"),
        Column("shape"),
        Column("dtype"),
        Column("scheme", human=lambda v: v or NO_SCHEME),
        Column("parameters", human=human_count, justify="right"),
        Column("size", human=human_bytes, justify="right"),
    ]
    rows = [
        [w["name"], w["shape"], w["dtype"], w["scheme"]["label"] if w["scheme"] else None, w["parameters"], w["bytes"]]
        for w in weights
    ]
    if stats:
        keys = ("min", "max", "mean", "std", "absmax", "nan", "inf")
        columns += [Column(k, human=_stat, justify="right") for k in keys]
        for row, w in zip(rows, weights):
            row += [(w.get("stats") or {}).get(k) for k in keys]
    notes_present = any(w["notes"] for w in weights)
    if notes_present:
        columns.append(Column("notes"))
        for row, w in zip(rows, weights):
            row.append("; ".join(w["notes"]))
    keys_for_collapse = [i for i in range(1, len(columns)) if columns[i].header not in ("parameters", "size")]
    return Rows(
        columns, rows, collapse_keys=keys_for_collapse if not stats else (), collapse_sums=(4, 5), title="Weights"
    )


def _stat(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _tensor_rows(tensors) -> Rows:
    columns = [
        Column("name"),
        Column("dtype"),
        Column("shape"),
        Column("bytes", human=human_bytes, justify="right"),
        Column("file"),
        Column("offset", justify="right"),
    ]
    rows = [[t.name, t.dtype.name, list(t.shape), t.nbytes, t.file, t.begin] for t in tensors]
    return Rows(columns, rows, title="Stored tensors")


def _summary_sections(document: dict[str, Any]) -> list[Section]:
    summary = document["summary"]
    key, value = Column("fact"), Column("value", justify="right")
    facts = Section(
        "Summary",
        [key, value],
        [
            ["stored tensors", summary["tensors"]],
            ["weights", f"{summary['weights']} ({summary['quantized_weights']} quantized)"],
            ["parameters", f"{human_count(summary['parameters'])} ({summary['parameters']:,})"],
            ["bytes on disk", f"{human_bytes(summary['bytes'])} ({summary['bytes']:,})"],
            ["bits per weight", f"{summary['bits_per_weight']:.3f}"],
            ["conventions", ", ".join(document["conventions"]) or NO_SCHEME],
            ["format", document["format"]],
            ["files", len(document["files"])],
        ],
        show_header=False,
    )
    by_dtype = Section(
        "Bytes by dtype",
        [
            Column("dtype"),
            Column("tensors", justify="right"),
            Column("bytes", human=human_bytes, justify="right"),
            Column("share", justify="right"),
        ],
        [[d, v["tensors"], v["bytes"], _share(v["bytes"], summary["bytes"])] for d, v in summary["by_dtype"].items()],
    )
    by_scheme = Section(
        "Parameters by scheme",
        [
            Column("scheme"),
            Column("weights", justify="right"),
            Column("parameters", human=human_count, justify="right"),
            Column("share", justify="right"),
        ],
        [
            [s, v["weights"], v["parameters"], _share(v["parameters"], summary["parameters"])]
            for s, v in summary["by_scheme"].items()
        ],
    )
    metadata = Section(
        "Metadata",
        [Column("key"), Column("value")],
        [[k, v if len(v) <= 200 else v[:197] + "..."] for k, v in document["metadata"].items()],
        show_header=False,
    )
    return [facts, by_dtype, by_scheme, metadata]


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "—"
