"""`qtool dequantize`: any checkpoint qtool reads, back to plain float safetensors."""

from __future__ import annotations

from typing import Annotated

import typer

from qtool.cli.options import (
    CheckpointArg,
    DeviceOpt,
    DryRunOpt,
    FormatOpt,
    JsonOpt,
    MaxShardOpt,
    OutputFormat,
    OutputPathOpt,
    OverwriteOpt,
    QuietOpt,
    ThreadsOpt,
    WorkersOpt,
    ExecutorOpt,
    RayAddressOpt,
    MaxRetriesOpt,
)
from qtool.cli.output import Column, Output, Rows, Section
from qtool.cli.plans import run_plan, show_plan
from qtool.cli.text import human_bytes

HELP = """Decode every quantized weight to float, keyed by its logical name.

The output is a plain safetensors checkpoint (a folder, or one file when -o ends in
.safetensors): `...q_proj.weight` instead of weight_packed/weight_scale, with the plain
tensors copied through. The dtype defaults to the one the input records, else bf16.

\b
Examples:
  qtool dequantize model-w4/ -o back.safetensors
  qtool dequantize model-fp8/ -o model-bf16/ --dtype bf16 --device cuda
"""


def dequantize_command(
    path: CheckpointArg,
    output_path: OutputPathOpt,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="bf16, f16 or f32 (default: as the input records, else bf16).")
    ] = None,
    dry_run: DryRunOpt = False,
    max_shard_size: MaxShardOpt = None,
    overwrite: OverwriteOpt = False,
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    workers: WorkersOpt = 1,
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    max_retries: MaxRetriesOpt = None,
    fmt: FormatOpt = OutputFormat.auto,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from qtool import api

    sink = Output("json" if json_ else fmt.value)
    plan = api.prepare_dequantize(path, output_path, dtype=dtype, max_shard_size=max_shard_size)
    if dry_run:
        show_plan(plan, sink)
        return
    document = run_plan(
        plan,
        device=device,
        threads=threads,
        overwrite=overwrite,
        quiet=quiet,
        spread=(workers, executor, ray_address, max_retries),
        measure=False,
    ).to_json()
    decoded, summary = document["weights"], document["summary"]
    rows = Rows(
        [Column("weight"), Column("from"), Column("shape"), Column("dtype")],
        [[w["name"], w["from"], w["shape"], w["tensors"][0]["dtype"]] for w in decoded],
        collapse_keys=(1, 2, 3),
        title="Decoded weights",
    )
    facts = Section(
        "Summary",
        [Column("fact"), Column("value", justify="right")],
        [
            ["output", plan.output],
            ["weights decoded", f"{len(decoded)} of {summary['weights']}"],
            ["size", f"{human_bytes(summary['bytes_before'])} -> {human_bytes(summary['bytes_after'])}"],
            ["time", f"{document['seconds']:.1f} s"],
        ],
        show_header=False,
    )
    sink.emit(document, rows, [facts])
