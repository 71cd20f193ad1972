"""`qtool imatrix`: llama.cpp's importance matrix of a Hugging Face model, for `--imatrix`."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from qtool.cli.options import (
    CheckpointArg,
    DeviceOpt,
    FormatOpt,
    JsonOpt,
    OutputFormat,
    OverwriteOpt,
    QuietOpt,
    ThreadsOpt,
)
from qtool.cli.output import Column, Output, Rows, Section, print_status, print_warning, progress

HELP = """Compute llama.cpp's importance matrix of a model on a calibration text.

For each Linear weight of the decoder layers, the sum over the text's tokens of each input
column's squared activation, and the tokens counted: what llama-imatrix accumulates, written in
its GGUF format with the GGUF tensor names qtool's conversion gives, so `llama-quantize
--imatrix` and `qtool quantize --imatrix` take it. The text is cut as llama-imatrix cuts it:
consecutive chunks of --chunk-size tokens from the start (each one's first token BOS where the
model's tokenizer adds one). One decoder layer is in memory at a time (transformers' layer
classes, pip install 'qtool[calibrate]'); the model folder's own code (auto_map) never runs.

\b
Examples:
  qtool imatrix model/ --calibrate text.txt -o imatrix.gguf
  qtool imatrix model/ --calibrate text.txt -o imatrix.gguf --chunks 8 --chunk-size 512
  qtool quantize model/ -o model-q4_k_m.gguf --scheme Q4_K_M --imatrix imatrix.gguf
  qtool quantize model/ -o model-q4_k_m.gguf --scheme Q4_K_M --calibrate text.txt   # both in one
"""


def imatrix_command(
    path: CheckpointArg,
    output_path: Annotated[
        str, typer.Option("--output", "-o", help="The importance matrix to write (.gguf).", show_default=False)
    ],
    calibrate: Annotated[
        str,
        typer.Option(
            "--calibrate",
            help='The calibration text: a .txt, a .jsonl with a "text" field, or a folder of them.',
            show_default=False,
        ),
    ],
    chunks: Annotated[
        int | None,
        typer.Option(
            "--chunks", help="At most this many chunks (default: all the text holds), as llama-imatrix --chunks.", min=1
        ),
    ] = None,
    chunk_size: Annotated[
        int, typer.Option("--chunk-size", help="Tokens per chunk, as llama-imatrix -c.", min=16)
    ] = 512,
    allow_incomplete_gguf: Annotated[
        bool,
        typer.Option(
            "--allow-incomplete-gguf",
            help="Name the tensors as qtool's GGUF conversion does even for a model it cannot describe to llama.cpp.",
        ),
    ] = False,
    overwrite: OverwriteOpt = False,
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    fmt: FormatOpt = OutputFormat.auto,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from qtool import api

    sink = Output("json" if json_ else fmt.value)
    api.import_transformers_lean()

    bars = contextlib.ExitStack()
    advance = [lambda _step: None]

    def started(count: int, size: int, layers: int) -> None:  # the work ahead, before the first layer runs
        print_status(
            f"imatrix: {count} chunk{'s' if count != 1 else ''} of {size} tokens, through {layers} decoder layer{'s' if layers != 1 else ''}",
            quiet,
        )
        advance[0] = bars.enter_context(progress("imatrix layers", layers, quiet, bytes_=False))

    def layer_done(layer, layers: int) -> None:
        advance[0](1)
        print_status(f"layer {layer.index + 1}/{layers}: {len(layer.weights)} weights in {layer.seconds:.1f} s", quiet)

    with bars:
        document = api.imatrix(
            path, output_path, calibrate, chunks=chunks, chunk_size=chunk_size, device=device, threads=threads,
            overwrite=overwrite, allow_incomplete_gguf=allow_incomplete_gguf, on_layer=layer_done, on_start=started,
        )  # fmt: skip
    for warning in document.get("warnings", ()):
        print_warning(warning)
    rows = Rows(
        [Column("name"), Column("columns", justify="right"), Column("tokens", justify="right")],
        [[t["name"], t["columns"], t["counts"][0]] for t in document["tensors"]],
        collapse_keys=(1, 2),
        title="Importance matrix",
    )
    facts = Section(
        "Summary",
        [Column("fact"), Column("value", justify="right")],
        [
            ["output", document["path"]],
            ["tensors covered", document["entries"]],
            ["chunks", f"{document['chunk_count']} of {document['chunk_size']} tokens"],
            ["text", document["text"]],
            ["time", f"{document['seconds']:.1f} s"],
        ],
        show_header=False,
    )
    sink.emit(document, rows, [facts])
