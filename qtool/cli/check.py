"""`qtool check`: audit one checkpoint against a policy, from its header."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.options import (
    CheckpointArg,
    DeviceOpt,
    FormatOpt,
    HtmlOpt,
    JsonOpt,
    OutputFormat,
    QuietOpt,
    ReportOpt,
    ReportOverwriteOpt,
)
from qtool.cli.output import Column, Output, Rows, Section, print_warning, progress
from qtool.message_text import counted
from qtool.patterns import REGEX_HELP

__all__ = ["HELP", "PolicyOpt", "check_command"]

HELP = """Audit a checkpoint: is it quantized the way we said it would be?

Reads the header only, unless --no-nan asks for the data. Without a quantization rule, check
still audits the checkpoint against its own compressed-tensors quantization_config: linear
weights it targets but that are stored plain, weights quantized although its `ignore` lists
them (`re:` entries as compressed-tensors matches them), and quantized weights missing a
member such as a scale. Exit status: 0 the policy holds, 1 a finding, 2 bad usage or an
unreadable input.

\b
Examples:
  qtool check model-w4/ --expect-scheme W4A16 --max-bits-per-weight 8
  qtool check model-w4/ --require-quantized 're:.*\\.experts\\..*' --allow-plain 're:.*\\.mlp\\.gate\\.weight'
  qtool check model-w4/ --policy qtool-policy.toml --json
  qtool check model.gguf --fail-on-unknown --no-nan
  qtool check model-w4/ --expect-scheme W4A16 --html check.html
"""

PolicyOpt = Annotated[
    Path | None,
    typer.Option(
        "--policy", help="A qtool-policy.toml with the same rules; options given here add to it.", show_default=False
    ),
]


def check_command(
    path: CheckpointArg,
    expect_scheme: Annotated[
        str | None,
        typer.Option(
            "--expect-scheme", help="Every quantized and every selected weight has this scheme (W4A16, int8, ...)."
        ),
    ] = None,
    require_quantized: Annotated[
        list[str] | None,
        typer.Option(
            "--require-quantized",
            help=f"Weights matching (glob, or re:regex; {REGEX_HELP}) must be quantized. Repeatable.",
        ),
    ] = None,
    allow_plain: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-plain", help=f"Weights matching (glob, or re:regex; {REGEX_HELP}) may stay plain. Repeatable."
        ),
    ] = None,
    max_bits_per_weight: Annotated[
        float | None,
        typer.Option(
            "--max-bits-per-weight",
            help="All stored bits / all parameters, as inspect reports it, at most this.",
            min=0,
        ),
    ] = None,
    fail_on_unknown: Annotated[
        bool, typer.Option("--fail-on-unknown", help="A weight qtool can't classify, or any note, is a finding.")
    ] = False,
    no_nan: Annotated[
        bool, typer.Option("--no-nan", help="Read every weight (dequantized first) and fail on NaN or Inf.")
    ] = False,
    policy: PolicyOpt = None,
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
    reports = (report, html)
    rules = (
        load_policy(policy)
        .with_check_options(
            expect_scheme=expect_scheme,
            require_quantized=tuple(require_quantized or ()),
            allow_plain=tuple(allow_plain or ()),
            max_bits_per_weight=max_bits_per_weight,
            fail_on_unknown=fail_on_unknown,
            no_nan=no_nan,
        )
        .check
    )
    rules.validate()
    if rules.no_nan:
        api.refuse_remote_data(path)  # before the open below, which would need the network
        with api.open_checkpoint(path) as checkpoint:  # headers only: the progress bar's total
            total = sum(t.nbytes for t in checkpoint.tensors.values())
        with progress("checking", total, quiet) as advance:
            result = api.check(
                path, rules, device=device, on_progress=advance, report_paths=reports, overwrite_reports=overwrite
            )
    else:
        result = api.check(path, rules, device=device, report_paths=reports, overwrite_reports=overwrite)
    for note in result.notes:
        print_warning(note)
    document = result.to_json(weight_rows=sink.format == "json" or any(p is not None for p in reports))
    if report is not None:
        api.write_report(report, "check", [document], overwrite=overwrite)
    if html is not None:
        api.write_report(html, "check", [document], html=True, overwrite=overwrite)
    rows = Rows(
        [Column("rule"), Column("weight", human=lambda v: v or "—"), Column("detail")],
        [[f.rule, f.weight, f.detail] for f in result.findings],
        title="Findings",
    )
    facts = Section(
        "Summary",
        [Column("fact"), Column("value", justify="right")],
        [
            ["checkpoint", result.path],
            ["weights", str(result.weights)],
            ["rules", ", ".join(result.rules) or "none (no rule given and no quantization_config)"],
            ["result", "OK" if result.ok else counted(len(result.findings), "finding")],
        ],
        show_header=False,
    )
    sink.emit(document, rows, [facts])
    result.raise_for_findings()
