"""`qtool eval`: a model's perplexity on a text, and against a base model what quantization
did to its outputs (KL divergence, top-1 agreement, hidden-state error by layer); gates for CI."""

from __future__ import annotations

import contextlib
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
    ThreadsOpt,
)
from qtool.cli.output import Column, Output, Rows, Section, print_error, print_status, print_warning, progress
from qtool.errors import ViolationError

__all__ = [
    "HELP",
    "eval_command",
    "TextOpt",
    "CtxOpt",
    "WindowsOpt",
    "DtypeOpt",
    "MaxKldOpt",
    "MinTop1Opt",
    "MaxPplRatioOpt",
    "show_outputs",
]

HELP = """Measure a model on a text: its perplexity, and against --base what it lost.

The text is scored as llama-perplexity scores it, so the figures compare: tokenized with the
model's own tokenizer, cut into consecutive windows of --ctx tokens from the start (each
window's first token the BOS where the tokenizer adds one), the loss taken over the second
half of each window. With --base, both models run in lockstep, one decoder layer of each in
memory at a time and no logits file: per scored token the KL divergence of the model's
next-token distribution from the base's (mean, median, p99, max), the share of tokens whose
most likely next token agrees (top-1), both perplexities and their ratio, and after each layer
the relative error of the model's hidden states against the base's.

Any checkpoint qtool reads whose architecture transformers builds (LLaMA, Qwen2/3, Mistral,
Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE): float folders, compressed-tensors, GPTQ, AWQ,
bitsandbytes, quanto, torchao, MLX, fp8, and GGUF of the LLaMA family (read back under its
Hugging Face names, with the tokenizer its vocabulary gives). Needs pip install
'qtool[calibrate]'; the model folder's own code never runs. Exit status: 1 when a gate is
breached (one line each on stderr), 2 on bad input.

\\b
Examples:
  qtool eval model/ --text wiki.test.txt --windows 16
  qtool eval model-w4/ --base model/ --text wiki.test.txt --windows 16 --max-kld 0.05
  qtool eval model-q4_k_m.gguf --base model-f16.gguf --text wiki.test.txt --json | jq .kld
"""

TextOpt = Annotated[
    str,
    typer.Option(
        "--text",
        help='The text to score: a .txt, a .jsonl with a "text" field, or a folder of them.',
        show_default=False,
    ),
]
CtxOpt = Annotated[int, typer.Option("--ctx", help="Tokens per window, as llama-perplexity -c.", min=4)]
WindowsOpt = Annotated[
    int | None,
    typer.Option("--windows", help="Score the first N windows (default: every whole window of the text).", min=1),
]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="The compute dtype: float32, bfloat16 or float16.")]
MaxKldOpt = Annotated[
    float | None, typer.Option("--max-kld", help="Fail when the mean KL divergence from the base is above this.", min=0)
]
MinTop1Opt = Annotated[
    float | None,
    typer.Option("--min-top1", help="Fail when the top-1 agreement with the base (0..1) is below this.", min=0, max=1),
]
MaxPplRatioOpt = Annotated[
    float | None,
    typer.Option("--max-ppl-ratio", help="Fail when the perplexity over the base's is above this.", min=0),
]


def eval_command(
    path: CheckpointArg,
    text: TextOpt,
    base: Annotated[
        str | None,
        typer.Option("--base", help="The reference model (the original of a quantized one).", show_default=False),
    ] = None,
    ctx: CtxOpt = 512,
    windows: WindowsOpt = None,
    max_kld: MaxKldOpt = None,
    min_top1: MinTop1Opt = None,
    max_ppl_ratio: MaxPplRatioOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    threads: ThreadsOpt = None,
    html: HtmlOpt = None,
    report: ReportOpt = None,
    overwrite: ReportOverwriteOpt = False,
    fmt: FormatOpt = OutputFormat.auto,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from qtool import api

    sink = Output("json" if json_ else fmt.value)
    api.import_transformers_lean()
    gates = api.OutputGates(max_kld=max_kld, min_top1=min_top1, max_ppl_ratio=max_ppl_ratio)
    if report is not None or html is not None:  # before the measuring, which may take long
        inputs = [api.open_checkpoint(p) for p in (path, base) if p is not None]
        api.refuse_report_paths(inputs, [report, html], overwrite=overwrite, text=text)
    with _progress(quiet) as (started, layer_done):
        document = api.evaluate(
            path, text, base=base, ctx=ctx, windows=windows, device=device, dtype=dtype, threads=threads, gates=gates,
            on_start=started, on_layer=layer_done,
        )  # fmt: skip
    for warning in document["warnings"]:
        print_warning(warning)
    if report is not None:
        api.write_report(report, "eval", [document], overwrite=overwrite)
    if html is not None:
        api.write_report(html, "eval", [document], html=True, overwrite=overwrite)
    _show(document, sink)
    fail(document)


@contextlib.contextmanager
def _progress(quiet: bool):
    """(on_start, on_layer) for the API: a line saying the work ahead, then a bar of layer steps."""
    bars = contextlib.ExitStack()
    advance = [lambda _step: None]

    def started(count: int, ctx: int, steps: int) -> None:
        print_status(f"eval: {count} window{'s' if count != 1 else ''} of {ctx} tokens", quiet)
        advance[0] = bars.enter_context(progress("eval layers", steps, quiet, bytes_=False))

    def layer_done(step: int, steps: int, seconds: float) -> None:
        advance[0](1)

    with bars:
        yield started, layer_done


def fail(document: dict) -> None:
    """Exit 1, one line per breached gate, when the document has violations."""
    if document["violations"]:
        for line in document["violations"]:
            print_error(line)
        raise typer.Exit(ViolationError.exit_code) from None


def _figure(value, digits: str) -> str:
    return "—" if value is None else format(value, digits)


def show_outputs(document: dict) -> list[list[str]]:
    """The summary rows of an evaluation (its model's perplexity, and against a base the rest)."""
    kld = document["kld"]
    rows = [
        ["windows", f"{document['windows']} of {document['ctx']} tokens ({document['tokens_scored']} scored)"],
        ["perplexity", _figure(document["perplexity"], ".4f")],
    ]
    if document["base"] is not None:
        rows += [
            ["base perplexity", _figure(document["base"]["perplexity"], ".4f")],
            ["perplexity ratio", _figure(document["ppl_ratio"], ".5f")],
            ["mean KL divergence", _figure(kld["mean"], ".6f")],
            ["KL median / p99 / max", f"{kld['median']:.6f} / {kld['p99']:.6f} / {kld['max']:.6f}"],
            ["top-1 agreement", f"{100 * document['top1_agreement']:.2f} %"],
        ]
    return rows


def _show(document: dict, sink: Output) -> None:
    layers = document["layers"]
    table = Rows(
        [
            Column("layer", justify="right"),
            Column("hidden-state error", justify="right", human=lambda v: _figure(v, ".3e")),
        ],
        [[layer["index"], layer["hidden_error"]] for layer in layers] if document["base"] is not None else [],
        title=f"{document['model']} against {document['base']['path']}, after each layer" if document["base"] else None,
    )
    facts = Section(
        "Summary",
        [Column("fact"), Column("value", justify="right")],
        [
            ["model", document["model"]],
            *([["base", document["base"]["path"]]] if document["base"] else []),
            ["text", document["text"]],
            *show_outputs(document),
            ["time", f"{document['seconds']:.1f} s on {document['device']} ({document['dtype']})"],
            ["result", "OK" if document["ok"] else f"{len(document['violations'])} violation(s)"],
        ],
        show_header=False,
    )
    sink.emit(document, table, [facts])
