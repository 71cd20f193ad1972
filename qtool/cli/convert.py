"""`qtool convert`: a model moved to another toolchain's format, each weight saying whether it
moved exactly. Built so far: a GGUF back to a Hugging Face model folder (`--to hf`), and
quantized codes moved as they are into compressed-tensors (`--to compressed-tensors`)."""

from __future__ import annotations

from typing import Annotated

import typer

from qtool.cli.options import (
    CheckpointArg,
    DryRunOpt,
    FormatOpt,
    JsonOpt,
    MaxShardOpt,
    OutputFormat,
    OverwriteOpt,
    QuietOpt,
    ThreadsOpt,
)
from qtool.cli.output import Column, Output, Rows, Section, print_warning, progress
from qtool.cli.text import human_bytes

__all__ = ["HELP", "convert_command"]

HELP = """Convert a model to another toolchain's format, saying per weight whether it is exact.

--to hf: a GGUF (llama, mistral or qwen2) back to the Hugging Face model folder that
transformers' from_pretrained loads: model.safetensors with every weight decoded to --dtype
under its Hugging Face name (a llama's q/k rows back in Hugging Face's order), config.json
from the GGUF's metadata, the tokenizer from its vocabulary (tokenizer.json,
tokenizer_config.json, the chat template), generation_config.json with its BOS and EOS.
A weight is exact when its written values are the GGUF's float32 dequantization (llama.cpp's)
bit for bit: always with the default --dtype f32; with bf16 or f16 where every value fits, else
the report gives its error. Any other checkpoint is written as `qtool dequantize` writes it.

--to compressed-tensors: a quantized model's own integer codes, scales and zero points moved
as they are into compressed-tensors' pack-quantized tensors, never decoded and rounded again:
GPTQ (v1, v2; desc_act when its g_idx keeps each group's inputs together), AutoAWQ (GEMM,
GEMV), compressed-tensors int, and GGUF Q4_0, Q8_0 (and Q4_1 where its minimum is an integer
zero point), a GGUF read under its Hugging Face names with its config and tokenizer. The model
dtype is the one the source dequantizes in (float16 for GPTQ and AWQ, float32 for GGUF), so
compressed-tensors' own dequantization gives the source's values bit for bit; a weight whose
move would not be exact is refused, naming why, and nothing is written; with
--allow-requantize, a weight whose grid compressed-tensors cannot hold (a K-quant, nf4, fp8) is
decoded and quantized again with --scheme instead, its error in the report.

--to gguf: a GPTQ, AWQ or compressed-tensors int model's codes and scales written as GGUF
blocks (-o NAME.gguf), named and described as quantize writes a GGUF: symmetric 4-bit groups
as Q4_0 (nibble = code + 8), symmetric 8-bit and codes with zero points as Q8_0 (int8 = code -
zero point); groups must be whole blocks of 32. ggml forms each product in float32 where those
toolchains round it to their scales' dtype, so a weight is exact only where every product fits
that dtype; the report measures each weight either way.

The other targets (mlx, bitsandbytes) are not built yet.

\b
Examples:
  qtool convert model-q4_0.gguf -o model-hf/ --to hf
  qtool convert model-q4_0.gguf -o model-hf/ --to hf --dtype bf16 --json
  qtool convert model-q4_0.gguf -o model-hf/ --to hf --dry-run
  qtool convert model-gptq/ -o model-ct/ --to compressed-tensors
  qtool convert model-q4_0.gguf -o model-ct/ --to compressed-tensors --json
  qtool convert model-q4_k_m.gguf -o model-ct/ --to compressed-tensors --allow-requantize
  qtool convert model-w4/ -o model-q4_0.gguf --to gguf
"""


def convert_command(
    path: CheckpointArg,
    output_path: Annotated[
        str,
        typer.Option("--output", "-o", help="The folder to write (a .gguf file for --to gguf).", show_default=False),
    ],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="The format to write: hf, compressed-tensors or gguf (built); mlx, bitsandbytes (not yet).",
        ),
    ] = "hf",
    dtype: Annotated[
        str,
        typer.Option("--dtype", help="--to hf: f32 (exact), bf16 or f16, the dtype every weight is written in."),
    ] = "f32",
    allow_requantize: Annotated[
        bool,
        typer.Option(
            "--allow-requantize",
            help="--to compressed-tensors: decode and quantize again the weights whose codes cannot move (reported as not exact).",
        ),
    ] = False,
    scheme: Annotated[
        str,
        typer.Option(
            "--scheme",
            help="With --allow-requantize: the scheme those weights get (auto: int4:g32:asym from 4 bits or fewer, else int8:g32).",
        ),
    ] = "auto",
    dry_run: DryRunOpt = False,
    max_shard_size: MaxShardOpt = None,
    overwrite: OverwriteOpt = False,
    threads: ThreadsOpt = None,
    fmt: FormatOpt = OutputFormat.auto,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from qtool import api

    sink = Output("json" if json_ else fmt.value)
    plan = api.prepare_convert(
        path,
        output_path,
        to=to,
        dtype=dtype,
        max_shard_size=max_shard_size,
        requantize=scheme if allow_requantize else None,
    )
    if dry_run:
        plan.source.close()
        document = api.convert_plan_document(plan, to)
        sink.emit(document, _weight_rows(document, f"Plan: {plan.output}"), [_facts(document, plan.output)])
        return
    for warning in plan.warnings:
        print_warning(warning)
    with progress("converting", sum(job.bytes_in for job in plan.jobs), quiet) as advance:
        report = api.run_convert(plan, to=to, threads=threads, overwrite=overwrite, on_progress=advance)
    document = report.to_json()
    for name, value in sorted(report.run.measured.non_finite.items()):
        print_warning(f"{name} decodes to {value} values: written as they decode (see `qtool check --no-nan`)")
    sink.emit(document, _weight_rows(document, "Converted weights"), [_facts(document, plan.output)])


def _exact(value) -> str:
    return "exact" if value else "measured when written" if value is None else "not exact"


def _weight_rows(document: dict, title: str) -> Rows:
    return Rows(
        [
            Column("weight"),
            Column("from"),
            Column("action"),
            Column("dtype"),
            Column("shape"),
            Column("exact", human=_exact),
            Column("SQNR dB", human=lambda v: "—" if v is None else f"{v:.2f}", justify="right"),
        ],
        [
            [w["name"], w["stored_as"], w["action"], w["dtype"], w["shape"], w["exact"], w.get("sqnr_db")]
            for w in document["weights"]
        ],
        collapse_keys=(1, 2, 3, 4, 5, 6),
        title=title,
    )


def _facts(document: dict, output: str | None) -> Section:
    summary = document["summary"]
    rows = [
        ["output", output],
        ["target", document["target"]],
        ["files", ", ".join([*document["files"], *document["side_files"]])],
    ]
    if "exact_weights" in summary:
        rows.append(["exact weights", f"{summary['exact_weights']} of {summary['weights']}"])
    rows.append(["size", f"{human_bytes(summary['bytes_before'])} -> {human_bytes(summary['bytes_after'])}"])
    if "seconds" in document:
        rows.append(["time", f"{document['seconds']:.1f} s"])
    return Section("Summary", [Column("fact"), Column("value", justify="right")], rows, show_header=False)
