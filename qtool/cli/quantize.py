"""`qtool quantize`: a float checkpoint in, a quantized one out, with each weight's error."""

from typing import Annotated

import typer

from qtool.cli.options import (
    CheckpointArg,
    DeviceOpt,
    DryRunOpt,
    FormatOpt,
    HtmlOpt,
    JsonOpt,
    MaxShardOpt,
    OutputFormat,
    QuantizeOutputOpt,
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
from qtool.gcpause import paused_gc
from qtool.patterns import REGEX_HELP

HELP = """Quantize a checkpoint's linear weights and write a layout real loaders accept.

By default the 2-D float *.weight tensors of linear layers are quantized; embeddings,
lm_head, norms and biases are copied. The output layout is compressed-tensors (what vLLM and
transformers load) unless the scheme needs another (nf4: bitsandbytes; q8_0 ... q6_k and
llama.cpp's mixes: gguf) or --layout / an -o ending in .gguf names one. A GGUF is written for
llama, mistral and qwen2 models with their tokenizer, so llama.cpp runs it; for any other
model only with --allow-incomplete-gguf. Every quantized weight's
error (SQNR, relative RMSE, max abs error, cosine) is measured on the way; the worst 10 are
shown. Run `qtool schemes` for the schemes.

Loaders: in transformers 5.24 with compressed-tensors 0.20.1, W4A16_ASYM does not load (nor
does compressed-tensors' own output of it) and NVFP4A16 / MXFP4A16 run only with
dtype=torch.bfloat16 (compressed-tensors#839 fixes that later). README: "Loading the output".

GGUF: a .gguf input keeps all its key-values, tensor order and alignment. Lowercase q8_0,
q4_0, q4_k ... is one block type on the weights qtool selects; CAPITALS are llama.cpp's file
types, with llama.cpp's own choice of tensors and types: Q4_K_M, Q5_K_M, Q3_K_M, Q2_K, Q6_K,
Q8_0, Q4_0, IQ4_XS, IQ3_S, IQ3_M ... (mixes; IQ3_XXS, IQ2_M, IQ2_S, IQ2_XS and IQ2_XXS only
with --imatrix or --calibrate, as llama-quantize refuses them without an importance matrix) and
Q3_K, Q4_K, Q5_K (pure, like llama-quantize --pure). --pure makes
any file type pure: its default type on every tensor llama.cpp quantizes, with llama.cpp's row
fallbacks (--scheme Q2_K --pure is llama-quantize --pure Q2_K). Under a mix, --tensor-scheme
PATTERN=TYPE sets one type for matching tensors (llama-quantize --tensor-type) and --dry-run
prints each tensor's type and size. An -o ending in .gguf writes one GGUF file from any input.

\b
Examples:
  qtool quantize model/ -o model-w4/ --scheme W4A16
  qtool quantize model.safetensors -o out/ --scheme int8 --device cuda --report report.json
  qtool quantize model/ -o model-w4/ --scheme W4A16 --html report.html
  qtool quantize model/ -o out/ --scheme fp8:block128x128 --ignore 're:.*lm_head' --dry-run
  qtool quantize model/ -o out/ --scheme W4A16 --tensor-scheme 're:.*down_proj.*=W8A16'
  qtool quantize model/ -o model-q4_0.gguf --scheme q4_0
  qtool quantize model/ -o model-mxfp4.gguf --layout gguf --scheme mxfp4
  qtool quantize model-f16.gguf -o model-q4_k_m.gguf --scheme Q4_K_M --dry-run
  qtool quantize model-f16.gguf -o model-q4_k_m.gguf --scheme Q4_K_M --tensor-scheme 're:.*ffn_down.*=q6_k'
  qtool quantize model-f16.gguf -o model-q2_k.gguf --scheme Q2_K --pure
  qtool quantize model-q8_0.gguf -o model-q4_0.gguf --scheme Q4_0 --allow-requantize
  qtool quantize model-f16.gguf -o model-q4_k_m.gguf --scheme Q4_K_M --imatrix imatrix.gguf
  qtool quantize model-f16.gguf -o model-iq2_m.gguf --scheme IQ2_M --imatrix imatrix.gguf
  qtool quantize model/ -o model-gptq/ --scheme W4A16 --calibrate text.txt --samples 128 --seq-len 512
  qtool quantize model/ -o model-gptq/ --scheme W4A16 --calibrate text.txt --true-sequential

Calibrated (--calibrate TEXT): GPTQ, one decoder layer in memory at a time, the model's own
tokenizer and transformers' architecture (pip install 'qtool[calibrate]'); the report adds
each layer's time and output error on the calibration samples. The model folder's own code
(auto_map) never runs: a folder that needs it is refused, and so is a config.json its
weights belie (checked in --dry-run too).
"""


def quantize_command(
    path: CheckpointArg,
    output_path: QuantizeOutputOpt,
    scheme: Annotated[
        str,
        typer.Option(
            "--scheme",
            "-s",
            help="A preset (W4A16, FP8_BLOCK, ...), a short form (int4:g64:asym, q4_k) or a llama.cpp file type (Q4_K_M).",
        ),
    ] = "W4A16",
    include: Annotated[
        list[str] | None,
        typer.Option("--include", help=f"Quantize only names matching (glob, or re:regex; {REGEX_HELP}). Repeatable."),
    ] = None,
    ignore: Annotated[
        list[str] | None,
        typer.Option("--ignore", help=f"Never quantize names matching (glob, or re:regex; {REGEX_HELP}). Repeatable."),
    ] = None,
    tensor_scheme: Annotated[
        list[str] | None,
        typer.Option(
            "--tensor-scheme",
            help=f"PATTERN=SCHEME: another scheme for weights matching PATTERN (glob, or re:regex; {REGEX_HELP}). Repeatable.",
        ),
    ] = None,
    observer: Annotated[
        str | None,
        typer.Option(
            "--observer",
            help="How int scales are chosen: minmax (the block's range, the default) or mse (a search for the scale and zero "
            "point of least squared error, never worse than minmax on any group: on MiniLM +0.82 dB SQNR for W4A16, +2.3 dB "
            "for int2:g64:asym, only +0.1 dB for int8 per channel; a whole bf16 W4A16 quantize takes 1.5-2x as long). "
            "Applies to --scheme and to every --tensor-scheme naming none (or write int4:g128:mse).",
        ),
    ] = None,
    layout: Annotated[
        str,
        typer.Option(
            "--layout", help="Output layout: auto, compressed-tensors, bitsandbytes, or gguf (one .gguf file)."
        ),
    ] = "auto",
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="Cast the float tensors that stay unquantized: bf16, f16 or f32.")
    ] = None,
    allow_requantize: Annotated[
        bool, typer.Option("--allow-requantize", help="Accept an already-quantized input: dequantize it first.")
    ] = False,
    allow_incomplete_gguf: Annotated[
        bool,
        typer.Option(
            "--allow-incomplete-gguf",
            help="Write a GGUF even for a model qtool cannot describe to llama.cpp (not llama/mistral/qwen2, or no tokenizer): no runtime will load it.",
        ),
    ] = False,
    pure: Annotated[
        bool,
        typer.Option(
            "--pure",
            help="With a llama.cpp file type: its default type on every tensor llama.cpp quantizes, with the row fallbacks and no promotions (llama-quantize --pure).",
        ),
    ] = False,
    report: Annotated[
        str | None,
        typer.Option(
            "--report",
            help="Also write the summary document (every quantized weight's error) to this JSON file; HTML when it ends in .html.",
        ),
    ] = None,
    html: HtmlOpt = None,
    calibrate: Annotated[
        str | None,
        typer.Option(
            "--calibrate",
            help='Calibrate on this text (.txt, .jsonl with a "text" field, or a folder of them): GPTQ by default, compressed-tensors int schemes.',
        ),
    ] = None,
    algorithm: Annotated[
        str | None, typer.Option("--algorithm", help="With --calibrate: gptq (default), awq or rtn.")
    ] = None,
    imatrix: Annotated[
        str | None,
        typer.Option(
            "--imatrix",
            help="GGUF output: weigh llama.cpp's quantizers with this importance matrix (llama-imatrix's .gguf or legacy .dat), as llama-quantize --imatrix does.",
        ),
    ] = None,
    samples: Annotated[
        int, typer.Option("--samples", help="With --calibrate: how many token windows to calibrate on.")
    ] = 128,
    seq_len: Annotated[int, typer.Option("--seq-len", help="With --calibrate: tokens per window.")] = 512,
    seed: Annotated[int, typer.Option("--seed", help="With --calibrate: which windows are drawn.")] = 0,
    actorder: Annotated[
        str | None,
        typer.Option(
            "--actorder",
            help="With --calibrate (GPTQ): static (the default, as llm-compressor's) or weight (its alias): quantize columns by decreasing activation, groups unchanged; none: in their stored order.",
        ),
    ] = None,
    true_sequential: Annotated[
        bool,
        typer.Option(
            "--true-sequential",
            help="With --calibrate (GPTQ): each layer's Linears in the order the layer calls them, each on the outputs of those quantized before it, in one run of the layer: ~0.7x the time; what each sample's pass holds while a Linear waits is parked in a temporary file.",
        ),
    ] = False,
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
    if calibrate is not None:
        api.import_transformers_lean()
    with paused_gc(freeze=True):  # planning makes many objects and no cycles; the plan lives on
        plan = api.prepare_quantize(
            path,
            output_path,
            scheme,
            include=include or (),
            ignore=ignore or (),
            tensor_schemes=tensor_scheme or (),
            layout=layout,
            dtype=dtype,
            max_shard_size=max_shard_size,
            allow_requantize=allow_requantize,
            report=report,
            allow_incomplete_gguf=allow_incomplete_gguf,
            pure=pure,
            html=html,
            observer=observer,
            calibrate=calibrate,
            algorithm=algorithm,
            samples=samples,
            seq_len=seq_len,
            seed=seed,
            imatrix=imatrix,
            actorder=actorder,
            true_sequential=true_sequential,
        )
    if dry_run:
        show_plan(plan, sink)
        return
    outcome = run_plan(
        plan,
        device=device,
        threads=threads,
        overwrite=overwrite,
        quiet=quiet,
        spread=(workers, executor, ray_address, max_retries),
        measure=True,
    )
    _show_summary(outcome.to_json(), sink)


def _db(value) -> str:
    return "exact" if value is None else f"{value:.2f}"


def _show_summary(document: dict, sink: Output) -> None:
    rows = Rows(
        [
            Column("weight"),
            Column("scheme"),
            Column("SQNR dB", human=_db, justify="right"),
            Column("rel RMSE", human=lambda v: "0" if v is None else f"{v:.4f}", justify="right"),
            Column("max abs err", human=lambda v: "0" if v is None else f"{v:.4g}", justify="right"),
            Column("cosine", human=lambda v: "1" if v is None else f"{v:.6f}", justify="right"),
        ],
        [
            [w["name"], w["scheme"], w["sqnr_db"], w["rel_rmse"], w["max_abs_err"], w["cosine"]]
            for w in document["weights"][:10]
        ],
        title="Worst weights by SQNR",
    )
    summary = document["summary"]
    facts = Section(
        "Summary",
        [Column("fact"), Column("value", justify="right")],
        [
            ["output", document["output"]],
            ["weights quantized", f"{summary['quantized_weights']} of {summary['weights']}"],
            ["size", f"{human_bytes(summary['bytes_before'])} -> {human_bytes(summary['bytes_after'])}"],
            ["bits per weight", f"{summary['bits_per_weight']:.3f}"],
            *(
                [["SQNR, quantized weights", f"{_db(summary['quantized']['sqnr_db'])} dB"]]
                if "quantized" in summary
                else []
            ),  # a mix may quantize nothing
            *(
                [["SQNR, all weights", f"{_db(summary['all_weights']['sqnr_db'])} dB"]]
                if "all_weights" in summary
                else []
            ),
            ["time", f"{document['seconds']:.1f} s on {document['device']}"],
        ],
        show_header=False,
    )
    sink.emit(document, rows, [facts])
