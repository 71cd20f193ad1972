"""A calibrated quantization asked for, checked when it is planned and run before the
executor: `prepare` validates everything a run would refuse (the text, its token count, the
tokenizer, the architecture, the input, the schemes) so `--dry-run` and a bad input fail the
same way, with nothing written; `apply` runs the runner and hands its tensors to the plan's
jobs as `Precomputed` encodings."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from qtool.errors import UsageError

if TYPE_CHECKING:
    import torch

    from qtool.plan import Plan

__all__ = ["CalibrationRequest", "Replaced", "prepare", "apply"]


@dataclass(frozen=True)
class Replaced:
    """A float tensor calibration changed (AWQ's smoothed norm), written in place of the
    stored values: a `qtool.plan.Transform` of a copied or cast job."""

    values: Any  # torch.Tensor, float32, the weight's shape
    dtype: str  # the written dtype's name

    def apply(self, values: Any, rows: int) -> Any:
        from qtool.buffers import tensor_bytes
        from qtool.dtypes import storage_dtype

        return tensor_bytes(self.values.to(storage_dtype(self.dtype).torch_dtype()).contiguous())


@dataclass
class CalibrationRequest:
    text: str
    algorithm: str
    tokens: "torch.Tensor"  # [samples, seq_len]
    seed: int
    actorder: str | None = None  # GPTQ's column order: "weight" / "static", or None
    true_sequential: bool = False  # GPTQ: each layer's Linears on their quantized predecessors' outputs, in one run
    notes: tuple[str, ...] = ()  # what transformers said while the model and tokenizer were read, for the warnings

    def to_json(self) -> dict[str, Any]:
        document = {"text": self.text, "algorithm": self.algorithm, "samples": int(self.tokens.shape[0]), "seq_len": int(self.tokens.shape[1]), "seed": self.seed}
        if self.actorder:
            document["actorder"] = self.actorder
        if self.true_sequential:
            document["true_sequential"] = True
        return document


def prepare(plan: "Plan", text: str, algorithm: str, samples: int, seq_len: int, seed: int, *, actorder: str | None = None, true_sequential: bool = False) -> CalibrationRequest:
    from qtool.calibration.runner import ALGORITHMS, check_scheme
    from qtool.calibration.samples import SampleOptions, draw_samples, load_tokenizer, read_text
    from qtool.calibration.skeleton import Skeleton
    from qtool.plan import QUANTIZE

    source = plan.source
    if algorithm not in ALGORITHMS:
        raise UsageError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}", option="algorithm")
    if source.format != "safetensors":
        raise UsageError(f"{source.path} is a {source.format} checkpoint; calibration reads a Hugging Face model folder (safetensors, config.json, tokenizer)", option="calibrate")
    if plan.layout.name != "compressed-tensors":
        raise UsageError(f"calibrated quantization writes compressed-tensors, not {plan.layout.name}", option="calibrate")
    quantized = [job.weight.name for job in plan.jobs if job.weight.quantized]
    if quantized:
        raise UsageError(f"{source.path} is already quantized ({quantized[0]}); calibration needs float weights", option="calibrate")
    SampleOptions(samples, seq_len, seed).check()
    actorder = resolve_actorder(actorder, algorithm)
    if true_sequential and algorithm != "gptq":
        raise UsageError(f"true sequential orders GPTQ's Linears; {algorithm} quantizes each layer from its float run", hint="use --algorithm gptq, or leave --true-sequential out", option="true_sequential")
    if algorithm in ("gptq", "awq"):
        for job in plan.jobs:
            if job.action == QUANTIZE and job.scheme is not None:
                check_scheme(job.weight.name, job.scheme)
    folder = source.path if os.path.isdir(source.path) else os.path.dirname(os.path.abspath(source.path))
    calibration = read_text(text)  # its files checked (regular, in size) before transformers is imported
    notes = list(Skeleton.build(source).notes)  # an architecture transformers does not know, or a config the weights belie, is refused here
    tokens = draw_samples(calibration, load_tokenizer(folder, notes), SampleOptions(samples, seq_len, seed), text)
    if actorder is not None:
        _record_actorder(plan, actorder)
    return CalibrationRequest(os.fspath(text), algorithm, tokens, seed, actorder, true_sequential, tuple(notes))


DEFAULT_ACTORDER = "static"  # llm-compressor 0.14's GPTQModifier writes this unless told otherwise
NO_ACTORDER = "none"  # the columns in their stored order


def resolve_actorder(actorder: str | None, algorithm: str) -> str | None:
    """GPTQ's column order as the run uses it: the asked one checked, llm-compressor's default
    ("static") when none was asked, None for `none` and for algorithms without columns to order."""
    from qtool.calibration.gptq import ACTORDERS

    if actorder is None:
        return DEFAULT_ACTORDER if algorithm == "gptq" else None
    if actorder == NO_ACTORDER:
        return None
    if actorder in ("group", "dynamic"):
        raise UsageError(
            f"activation order {actorder!r} (columns regrouped, a weight_g_idx per weight) is gone from compressed-tensors since 0.19, which refuses its config",
            hint="use --actorder weight (or its alias static): the same column order, groups unchanged", option="actorder",
        )  # fmt: skip
    if actorder not in ACTORDERS:
        raise UsageError(f"activation order {actorder!r} is not one of {', '.join((*ACTORDERS, NO_ACTORDER))}", option="actorder")
    if algorithm != "gptq":
        raise UsageError(f"--actorder orders GPTQ's columns; {algorithm} has none to order", hint="use --algorithm gptq, or leave --actorder out", option="actorder")
    return actorder


def _record_actorder(plan: "Plan", actorder: str) -> None:
    """compressed-tensors records the order in each config group's weight arguments."""
    config = (plan.config or {}).get("quantization_config")
    for group in (config or {}).get("config_groups", {}).values():
        if group.get("weights") is not None and group["weights"].get("type") == "int":
            group["weights"]["actorder"] = actorder


def apply(plan: "Plan", request: CalibrationRequest, device: str, threads: int | None = None, on_layer: Callable[[Any, int], None] | None = None) -> dict[str, Any]:
    """Calibrate (with `threads` torch and native threads, restored after) and set each calibrated job's
    encoding; the calibration document for the report. RTN ("rtn") leaves the plan as it is:
    the text only checked."""
    from qtool.pipeline import kernel_threads

    if request.algorithm == "rtn":
        return {**request.to_json(), "layers": []}
    with kernel_threads(threads):  # GPTQ's column sweep runs natively, the rest in torch
        return _calibrated(plan, request, device, on_layer)


def _calibrated(plan: "Plan", request: CalibrationRequest, device: str, on_layer) -> dict[str, Any]:
    from qtool.calibration.runner import RunnerOptions, calibrate
    from qtool.errors import InternalError
    from qtool.plan import CAST, COPY, QUANTIZE, Precomputed

    from qtool.formats.transformers_boundary import collected

    jobs = [job for job in plan.jobs if job.action == QUANTIZE and job.scheme is not None]
    schemes = {job.weight.name: job.scheme for job in jobs}
    said: list[str] = []
    with collected(said, "calibration: "):  # transformers' and torch's talk: the report's warnings, escaped where shown
        result = calibrate(
            plan.source, [job.weight for job in plan.jobs], schemes, plan.layout, request.tokens,
            RunnerOptions(algorithm=request.algorithm, device=device, actorder=request.actorder, true_sequential=request.true_sequential), seed=request.seed, on_layer=on_layer,
        )  # fmt: skip
    for job in jobs:
        tensors = result.encoded.pop(job.weight.name, None)
        if tensors is not None:
            job.encoding = Precomputed(tensors, request.algorithm)
    for job in plan.jobs:
        values = result.replaced.pop(job.weight.name, None)
        if values is None:
            continue
        if job.action not in (COPY, CAST) or job.transform is not None:
            raise InternalError(f"{job.weight.name}: calibration changed it, but the plan {job.action}s it")
        job.transform = Replaced(values, job.out_dtype or job.weight.data.dtype.name)
    if result.replaced:
        raise InternalError(f"calibration changed {sorted(result.replaced)[0]}, which the plan does not write")
    return {**request.to_json(), **result.to_json()} | ({"warnings": said} if said else {})
