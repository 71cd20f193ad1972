"""A quantize request to its plan (and a dequantize's options to theirs): the checkpoint opened and its weights read from the headers,
the selection applied, the layout chosen, every output path checked, the options made
`PlanOptions`, the layout's plan, and the calibration stage prepared. Everything a run would
refuse is refused here, with nothing written. The plan returned is a value: nothing changes it
after (`qtool.plan`)."""

from __future__ import annotations

import os
from dataclasses import replace

from qtool.errors import SchemeError, UsageError
from qtool.formats import Checkpoint, open_checkpoint
from qtool.inspection import inspect_checkpoint
from qtool.plan import Plan
from qtool.planning import calibration as calibration_stage
from qtool.planning.paths import check_paths, refuse_remote_data, side_file_warnings
from qtool.planning.request import ImatrixFile, ImatrixText, QuantizeRequest

__all__ = ["plan_quantize", "plan_dequantize"]


def plan_quantize(request: QuantizeRequest) -> Plan:
    """The request's plan, its checkpoint open (the run closes it; a refusal here does)."""
    refuse_remote_data(request.path)
    checkpoint = open_checkpoint(request.path)
    try:
        checkpoint.require_local()
        plan = _plan(checkpoint, request)
        if request.html is not None:  # checked as the JSON report is, and never the same file
            from qtool.report_output import refuse_report_paths

            check_paths(checkpoint, request.output, request.html, container=plan.layout.container)
            refuse_report_paths([], [plan.report, request.html])
            plan = replace(plan, html=request.html)
        return calibration_stage.prepare(plan, request.calibration)
    except BaseException:
        checkpoint.close()  # `run` closes it after a plan; nothing does after a refusal
        raise


def _plan(checkpoint: Checkpoint, request: QuantizeRequest) -> Plan:
    from qtool.layouts import choose_layout
    from qtool.pipeline import parse_dtype, parse_size
    from qtool.plan import PlanOptions

    path, output, calibration = request.path, request.output, request.calibration
    importance = None
    if isinstance(calibration, ImatrixFile):
        from qtool.formats.imatrix import read_imatrix

        refuse_remote_data(calibration.path)
        importance = read_imatrix(calibration.path)
    weights = inspect_checkpoint(checkpoint).weights
    warnings = []
    quantized = [w for w in weights if w.quantized]
    if quantized:
        example = quantized[0]
        if not request.allow_requantize:
            raise UsageError(
                f"{path} is already quantized ({len(quantized)} weights, e.g. {example.name}: {example.scheme.label})",
                hint="allow requantizing to dequantize it first and quantize again (errors compound)",
                option="allow_requantize",
            )
        warnings.append(
            f"requantizing {len(quantized)} already-quantized weights: they are dequantized first, and errors compound"
        )
    has_imatrix = isinstance(calibration, (ImatrixFile, ImatrixText))
    chosen = request.selection.choose(
        checkpoint, weights, allow_incomplete_gguf=request.allow_incomplete_gguf, has_imatrix=has_imatrix
    )
    if not chosen.schemes and chosen.mix is None:
        raise UsageError(
            f"no weight of {path} matches the selection",
            hint="by default 2-D float *.weight tensors of linear layers are quantized; include others by pattern",
            option="include",
        )
    if chosen.mix is not None and not request.to_gguf:
        raise SchemeError(
            f"{chosen.mix} is a llama.cpp file type, which only the gguf layout writes",
            hint="write a .gguf file, or name one scheme for another layout",
        )
    layout = choose_layout(chosen.distinct, request.layout)
    if importance is not None and layout.container != "gguf":
        raise UsageError(
            f"an importance matrix weighs llama.cpp's GGUF quantizers; this writes {layout.name}",
            hint="write a .gguf file with a GGUF type or mix (q4_k, Q4_K_M ...), or drop the imatrix",
            option="imatrix",
        )
    single_file = check_paths(checkpoint, output, request.report, container=layout.container)
    if importance is not None and os.path.realpath(output) == os.path.realpath(importance.path):
        raise UsageError(
            f"output {output} is the importance matrix {importance.path}",
            hint="write to a new path; qtool never modifies its input",
        )
    if request.max_shard_size and layout.container == "gguf":
        raise UsageError("a GGUF output is one file and is not split into shards", option="max_shard_size")
    options = PlanOptions(
        single_file=single_file,
        out_dtype=parse_dtype(request.dtype),
        max_shard_size=parse_size(request.max_shard_size) if request.max_shard_size else None,
        file_name=os.path.basename(output) if single_file else "model.safetensors",
        allow_incomplete_gguf=request.allow_incomplete_gguf,
        imatrix=importance,
        imatrix_name=calibration.path if isinstance(calibration, ImatrixFile) else "",
        imatrix_pending=isinstance(calibration, ImatrixText),
    )
    plan = layout.plan(checkpoint, weights, chosen, options)
    said = warnings + (plan.notes if plan.said is None else plan.said) + side_file_warnings(checkpoint, single_file)
    return replace(plan, output=output, single_file=single_file, report=request.report, warnings=tuple(said))


def plan_dequantize(path: str | os.PathLike[str], output: str, dtype: str | None, max_shard_size: str | None) -> Plan:
    """Every quantized weight decoded to float, keyed by its logical name (what
    `qtool.api.prepare_dequantize` documents); its checkpoint open, as a quantize plan's."""
    from qtool.layouts import LAYOUTS
    from qtool.pipeline import parse_dtype, parse_size
    from qtool.plan import Chosen, PlanOptions

    refuse_remote_data(path)
    checkpoint = open_checkpoint(path)
    try:
        checkpoint.require_local()
        single_file = check_paths(checkpoint, output, None, container="safetensors")
        weights = inspect_checkpoint(checkpoint).weights
        warnings = (
            [] if any(w.quantized for w in weights) else [f"{path} has no quantized weights; the output is a copy"]
        )
        options = PlanOptions(
            single_file=single_file,
            out_dtype=parse_dtype(dtype),
            max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
            file_name=os.path.basename(output) if single_file else "model.safetensors",
            hugging_face_names=True,
        )
        plan = LAYOUTS["safetensors"].plan(checkpoint, weights, Chosen(), options)
    except BaseException:
        checkpoint.close()
        raise
    return replace(
        plan,
        output=output,
        single_file=single_file,
        warnings=tuple(warnings + side_file_warnings(checkpoint, single_file)),
    )
