"""Options shared by several commands, declared once."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["CheckpointArg", "OutputFormat", "FormatOpt", "JsonOpt", "FilterOpt", "QuietOpt"]


class OutputFormat(str, Enum):
    auto = "auto"
    table = "table"
    json = "json"
    tsv = "tsv"
    names = "names"


CheckpointArg = Annotated[
    Path,
    typer.Argument(
        help="A .safetensors file, a *.safetensors.index.json, or a model folder.",
        show_default=False,
    ),
]
FormatOpt = Annotated[
    OutputFormat,
    typer.Option("--format", "-f", help="Output: table, json, tsv or names. auto = a table on a terminal, else TSV."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Same as --format json.")]
FilterOpt = Annotated[
    Optional[str],
    typer.Option("--filter", "-k", help="Only names matching a glob ('*.q_proj.*'), or a regex after 're:' (anchored at the start)."),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
