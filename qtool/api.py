"""The Python API; the CLI is a thin layer over these functions.

    >>> import qtool
    >>> report = qtool.inspect("sample_models/tiny-llama")
    >>> report.summary()["parameters"]
    722176
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from qtool.errors import UsageError
from qtool.formats import Checkpoint
from qtool.formats import open_checkpoint as _open_checkpoint
from qtool.inspection import Inspection, inspect_checkpoint

if TYPE_CHECKING:
    from qtool.audit import Audit, CheckRules
    from qtool.comparison import Comparison
    from qtool.pipeline import Plan, Result

__all__ = [
    "open_checkpoint",
    "inspect",
    "collect_stats",
    "Task",
    "prepare_quantize",
    "prepare_dequantize",
    "run",
    "quantize",
    "dequantize",
    "prepare_compare",
    "run_compare",
    "compare",
    "check",
]


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint's headers and side files. No tensor data is read."""
    return _open_checkpoint(path)


def inspect(path: str | os.PathLike[str]) -> Inspection:
    """Every weight of a checkpoint with its shape, dtype and scheme, from the headers alone."""
    return inspect_checkpoint(_open_checkpoint(path))


def collect_stats(inspection: Inspection, on_bytes: Callable[[int], None] | None = None) -> None:
    """Stream every plain weight's data and fill `inspection.stats`. Imports torch."""
    from qtool.stats import weight_stats

    checkpoint = inspection.checkpoint
    try:
        for weight in inspection.weights:
            if not weight.quantized:
                inspection.stats[weight.name] = weight_stats(checkpoint, weight, on_bytes)
    finally:
        checkpoint.close()


# -- quantize and dequantize -------------------------------------------------------------------


@dataclass
class Task:
    """A planned job: what `--dry-run` shows, and what `run` writes."""

    plan: "Plan"
    output: str
    single_file: bool
    warnings: list[str] = field(default_factory=list)


def _check_output(source_path: str, output: str, checkpoint: Checkpoint) -> bool:
    """The output is never the input, nor inside it. Returns whether it is a single file."""
    out = os.path.realpath(output)
    sources = [os.path.realpath(source_path), *(os.path.realpath(f) for f in checkpoint.files)]
    if out in sources or any(s.startswith(out + os.sep) for s in sources):
        raise UsageError(f"output {output} is the input", hint="write to a new path; qtool never modifies its input")
    if os.path.isdir(source_path) and out.startswith(os.path.realpath(source_path) + os.sep):
        raise UsageError(f"output {output} is inside the input folder", hint="write beside the input, not into it")
    return output.endswith((".safetensors", ".gguf"))


def prepare_quantize(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    scheme: str = "W4A16",
    *,
    include: Sequence[str] = (),
    ignore: Sequence[str] = (),
    tensor_schemes: Sequence[str] = (),
    format: str = "auto",
    dtype: str | None = None,
    max_shard_size: str | None = None,
    allow_requantize: bool = False,
) -> Task:
    """Plan a quantization: which weights, which scheme, every output tensor. Writes nothing."""
    from qtool.pipeline import parse_dtype, parse_size, plan_quantize
    from qtool.selection import Selection

    selection = Selection.from_options(scheme, list(include), list(ignore), list(tensor_schemes))
    checkpoint = _open_checkpoint(path)
    output = os.fspath(output)
    single_file = _check_output(os.fspath(path), output, checkpoint)
    weights = inspect_checkpoint(checkpoint).weights
    warnings = []
    quantized = [w for w in weights if w.quantized]
    if quantized:
        example = quantized[0]
        if not allow_requantize:
            raise UsageError(
                f"{path} is already quantized ({len(quantized)} weights, e.g. {example.name}: {example.scheme.label})",
                hint="pass --allow-requantize to dequantize it first and quantize again (error compounds)",
            )
        warnings.append(f"requantizing {len(quantized)} already-quantized weights: they are dequantized first, and errors compound")
    chosen = selection.choose(weights)
    schemes = {s.convention for s in chosen.values() if s is not None}
    if not schemes:
        raise UsageError(
            f"no weight of {path} matches the selection",
            hint="by default 2-D float *.weight tensors of linear layers are quantized; see --include",
        )
    if format == "gguf" or schemes == {"gguf"} or output.endswith(".gguf"):
        return _prepare_gguf(checkpoint, weights, chosen, output, warnings)
    if len(schemes) > 1:
        raise UsageError(f"the chosen schemes write different layouts ({', '.join(sorted(schemes))})", hint="pick schemes of one layout per run")
    layout = schemes.pop()
    if format not in ("auto", layout):
        raise UsageError(f"--format {format} cannot express {selection.scheme.label}", hint=f"that scheme writes {layout}; drop --format")
    plan = plan_quantize(
        checkpoint,
        weights,
        chosen,
        output_format=layout,
        out_dtype=parse_dtype(dtype),
        single_file=single_file,
        max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
    )
    return Task(plan, output, single_file, warnings)


def _prepare_gguf(checkpoint: Checkpoint, weights, chosen, output: str, warnings: list[str]) -> Task:
    """`--format gguf`: one .gguf file, written through the gguf package."""
    from qtool.gguf_export import gguf_type_for, plan_gguf

    if not output.endswith(".gguf"):
        raise UsageError(f"a GGUF output is one file: -o {output} should end in .gguf", hint="e.g. -o model-q4_0.gguf")
    for scheme in {s for s in chosen.values() if s is not None}:
        try:
            gguf_type_for(scheme)
        except (ValueError, KeyError):
            raise UsageError(
                f"GGUF has no block type for {scheme.label}", hint="use q8_0, q4_0, q4_1, q5_0, q5_1 or mxfp4 with --format gguf"
            ) from None
    return Task(plan_gguf(checkpoint, weights, chosen, output), output, True, warnings)


def prepare_dequantize(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_size: str | None = None,
) -> Task:
    """Plan decoding every quantized weight to float, keyed by its logical name. Writes nothing."""
    from qtool.pipeline import parse_dtype, parse_size, plan_dequantize

    checkpoint = _open_checkpoint(path)
    output = os.fspath(output)
    single_file = _check_output(os.fspath(path), output, checkpoint)
    weights = inspect_checkpoint(checkpoint).weights
    warnings = [] if any(w.quantized for w in weights) else [f"{path} has no quantized weights; the output is a copy"]
    plan = plan_dequantize(
        checkpoint,
        weights,
        dtype=parse_dtype(dtype),
        single_file=single_file,
        max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
    )
    return Task(plan, output, single_file, warnings)


def run(
    task: Task,
    *,
    device: str = "cpu",
    threads: int | None = None,
    overwrite: bool = False,
    on_progress: Callable[[int], None] | None = None,
    measure: bool = True,
) -> "Result":
    """Stream a planned task to its output, atomically. Imports torch unless qtool.native runs
    every job on the CPU."""
    from qtool import native
    from qtool.formats.writer import Output
    from qtool.pipeline import execute, resolve_device

    resolved = resolve_device(device)
    if threads:
        if threads < 1:
            raise UsageError(f"--threads {threads} must be at least 1")
        native.set_threads(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        else:  # torch sizes its pool from this when (if) a job imports it; no import just for this
            os.environ["OMP_NUM_THREADS"] = str(threads)
    if task.output.endswith(".gguf"):
        from qtool.gguf_export import execute_gguf

        try:
            return execute_gguf(task.plan, task.output, overwrite=overwrite, device=resolved, on_progress=on_progress, measure=measure)
        finally:
            task.plan.source.close()
    output = Output(task.output, single_file=task.single_file, overwrite=overwrite)
    try:
        return execute(task.plan, output, device=resolved, measure=measure, on_progress=on_progress)
    finally:
        task.plan.source.close()


def quantize(path, output, scheme: str = "W4A16", *, device: str = "cpu", overwrite: bool = False, **options) -> "Result":
    """Quantize a checkpoint into `output` (a folder, or a .safetensors file)."""
    return run(prepare_quantize(path, output, scheme, **options), device=device, overwrite=overwrite)


def dequantize(path, output, *, dtype: str | None = None, device: str = "cpu", overwrite: bool = False) -> "Result":
    """Decode every quantized weight of a checkpoint to float, into `output`."""
    return run(prepare_dequantize(path, output, dtype=dtype), device=device, overwrite=overwrite, measure=False)


# -- compare and check -------------------------------------------------------------------------


def prepare_compare(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    maps: Sequence[str] = (),
    gguf_names: bool = True,
) -> "Comparison":
    """Pair A's weights with B's by logical name and check their shapes, from the headers.

    `maps` are rename rules, `OLD=NEW` (`re:` regex anchored at the start, else a literal
    prefix), applied in order to both sides' names. With `gguf_names`, a GGUF side's LLaMA
    names are read as Hugging Face names first (`blk.0.attn_q.weight` ->
    `model.layers.0.self_attn.q_proj.weight`)."""
    from qtool.comparison import plan_comparison
    from qtool.naming import parse_rename

    rules = [parse_rename(text) for text in maps]
    checkpoint_a = _open_checkpoint(a)
    checkpoint_b = _open_checkpoint(b)
    return plan_comparison(
        checkpoint_a, inspect_checkpoint(checkpoint_a).weights, checkpoint_b, inspect_checkpoint(checkpoint_b).weights, rules, gguf_names=gguf_names
    )


def compare(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    maps: Sequence[str] = (),
    device: str = "cpu",
    gguf_names: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> "Comparison":
    """Measure B against A weight by weight (SQNR, relative RMSE, max abs error, cosine),
    both sides dequantized on `device`, one pair at a time. Imports torch.

    `.violations(Gates(min_sqnr=...))` lists what breaks a gate; `.to_json()` is the
    `qtool compare --json` document."""
    return run_compare(prepare_compare(a, b, maps=maps, gguf_names=gguf_names), device=device, on_progress=on_progress)


def run_compare(comparison: "Comparison", *, device: str = "cpu", on_progress: Callable[[int], None] | None = None) -> "Comparison":
    """Measure a prepared comparison (`on_progress` gets bytes, out of `.total_bytes`), then
    close both checkpoints. Imports torch."""
    from qtool.comparison import run_comparison
    from qtool.pipeline import resolve_device

    try:
        return run_comparison(comparison, device=resolve_device(device), on_progress=on_progress)
    finally:
        comparison.a.close()
        comparison.b.close()


def check(
    path: str | os.PathLike[str],
    rules: "CheckRules | None" = None,
    *,
    device: str = "cpu",
    on_progress: Callable[[int], None] | None = None,
) -> "Audit":
    """Audit a checkpoint against `rules`; `.findings` lists what breaks them. Reads the header
    only, unless `rules.no_nan` asks for the data."""
    from qtool.audit import CheckRules, audit

    rules = rules or CheckRules()
    rules.validate()
    checkpoint = _open_checkpoint(path)
    try:
        resolved = "cpu"
        if rules.no_nan:
            from qtool.pipeline import resolve_device

            resolved = resolve_device(device)
        return audit(checkpoint, inspect_checkpoint(checkpoint).weights, rules, device=resolved, on_progress=on_progress)
    finally:
        checkpoint.close()
