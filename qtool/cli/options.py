"""Options shared by several commands, declared once.

Every command prints through the same two options: `-f/--format` (table, json, tsv, names, or
auto: a table on a terminal, TSV in a pipe) and `--json`, the same as `--format json`.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qtool.patterns import REGEX_HELP

__all__ = [
    "CheckpointArg",
    "OutputFormat",
    "FormatOpt",
    "JsonOpt",
    "FilterOpt",
    "OutputPathOpt",
    "QuantizeOutputOpt",
    "QuietOpt",
    "HtmlOpt",
    "ReportOpt",
    "ReportOverwriteOpt",
]


class OutputFormat(str, Enum):
    auto = "auto"
    table = "table"
    json = "json"
    tsv = "tsv"
    names = "names"


# A str, not a Path: pathlib folds the `//` of `https://` and `hf://` locations into one `/`.
CheckpointArg = Annotated[
    str,
    typer.Argument(
        help="A .safetensors, .gguf, .pt/.bin or .bpk file, a *.index.json, or a model folder; or, for inspect and check, hf://ORG/REPO, hf://ORG/REPO@REVISION/PATH or an https:// URL of a file.",
        show_default=False,
    ),
]
FormatOpt = Annotated[
    OutputFormat,
    typer.Option(
        "--format", "-f", help="How to print: table, json, tsv or names. auto = a table on a terminal, else TSV."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON: the same as --format json.")]
FilterOpt = Annotated[
    str | None,
    typer.Option(
        "--filter",
        "-k",
        help=f"Only names matching a glob ('*.q_proj.*'), or a regex after 're:' (anchored at the start; {REGEX_HELP}).",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]

OutputPathOpt = Annotated[
    Path,
    typer.Option(
        "--output",
        "-o",
        help="Where to write: a folder, or a path ending in .safetensors for one file.",
        show_default=False,
    ),
]
QuantizeOutputOpt = Annotated[
    Path,
    typer.Option(
        "--output",
        "-o",
        help="Where to write: a folder, a path ending in .safetensors for one file, or one ending in .gguf for a GGUF file (llama.cpp).",
        show_default=False,
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N, or auto (CUDA when present).")]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads", help="CPU threads for the math, torch's and qtool's native kernels' (default: every CPU).", min=1
    ),
]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Replace an existing output (atomically, when the new one is complete).")
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Print the plan (per-weight scheme, size before and after) and write nothing.")
]
MaxShardOpt = Annotated[
    str | None,
    typer.Option(
        "--max-shard-size",
        help="Split the output into shards of at most this size (5GB, 500MB). Default: follow the input's sharding.",
    ),
]

# issue 23: report files
HtmlOpt = Annotated[
    str | None,
    typer.Option(
        "--html",
        help="Also write the HTML report (one self-contained page: error along the depth, histogram, every weight) to this file.",
        show_default=False,
    ),
]
ReportOpt = Annotated[
    str | None,
    typer.Option(
        "--report", help="Also write the --json document to this file; HTML when it ends in .html.", show_default=False
    ),
]
ReportOverwriteOpt = Annotated[
    bool,
    typer.Option("--overwrite", help="Replace an existing report file (atomically, when the new one is complete)."),
]
WorkersOpt = Annotated[
    int,
    typer.Option(
        "--workers",
        help="Run the shard jobs in N local processes (spawned; --threads divided among them). 1: one process, as always.",
        min=1,
    ),
]
ExecutorOpt = Annotated[
    str,
    typer.Option(
        "--executor",
        help="Where shard jobs run: local (--workers processes here) or ray (a Ray cluster; needs qtool[ray]).",
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address", help="The Ray cluster to join with --executor ray (default: RAY_ADDRESS, else a local Ray)."
    ),
]
MaxRetriesOpt = Annotated[
    int | None,
    typer.Option(
        "--max-retries", help="Retry a shard job whose worker or node was lost this many times (default 3).", min=0
    ),
]
