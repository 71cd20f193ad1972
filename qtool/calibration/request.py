"""A calibrated quantization (GPTQ, AWQ, RTN) as planned, and run before the executor: the
request (`qtool.planning.calibration` checks everything a run would refuse and draws the token
windows, so `--dry-run` and a bad input fail the same way, with nothing written); `apply` runs
the runner and returns what it made, each weight's codes as a `Precomputed` encoding, which the
executor applies beside the plan (`qtool.plan.Calibrated`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Callable


if TYPE_CHECKING:
    import torch

    from qtool.calibration.skeleton import Skeleton
    from qtool.plan import Calibrated, Plan

__all__ = ["CalibrationRequest", "Replaced", "apply"]


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


@dataclass(frozen=True)
class CalibrationRequest:
    text: str
    algorithm: str
    tokens: torch.Tensor  # [samples, seq_len]
    seed: int
    actorder: str | None = None  # GPTQ's column order: "weight" / "static", or None
    true_sequential: bool = False  # GPTQ: each layer's Linears on their quantized predecessors' outputs, in one run
    notes: tuple[str, ...] = ()  # what transformers said while the model and tokenizer were read, for the warnings
    skeleton: Skeleton | None = field(default=None, compare=False, repr=False)  # planning's, built once

    def to_json(self) -> dict[str, Any]:
        document = {
            "text": self.text,
            "algorithm": self.algorithm,
            "samples": int(self.tokens.shape[0]),
            "seq_len": int(self.tokens.shape[1]),
            "seed": self.seed,
        }
        if self.actorder:
            document["actorder"] = self.actorder
        if self.true_sequential:
            document["true_sequential"] = True
        return document


def apply(
    plan: Plan, request: CalibrationRequest, device: str, on_layer: Callable[[Any, int], None] | None = None
) -> Calibrated:
    """Calibrate; what it made for the plan's jobs (each calibrated weight's codes, AWQ's
    smoothed norms) and the calibration document for the report. RTN ("rtn") makes nothing:
    the text only checked. The caller sets the threads (`qtool.pipeline.kernel_threads`)."""
    from qtool.calibration.runner import RunnerOptions, calibrate
    from qtool.formats.transformers_boundary import collected
    from qtool.plan import QUANTIZE, Calibrated, Precomputed

    if request.algorithm == "rtn":
        return Calibrated({**request.to_json(), "layers": []})
    jobs = [job for job in plan.jobs if job.action == QUANTIZE and job.scheme is not None]
    schemes = {job.weight.name: job.scheme for job in jobs}
    said: list[str] = []
    with collected(said, "calibration: "):  # transformers' and torch's talk: the report's warnings, escaped where shown
        result = calibrate(
            plan.source, [job.weight for job in plan.jobs], schemes, plan.layout, request.tokens,
            RunnerOptions(algorithm=request.algorithm, device=device, actorder=request.actorder, true_sequential=request.true_sequential), seed=request.seed, on_layer=on_layer, skeleton=request.skeleton,
        )  # fmt: skip
    encodings = {}
    for job in jobs:
        tensors = result.encoded.pop(job.weight.name, None)
        if tensors is not None:
            encodings[job.weight.name] = Precomputed(tensors, request.algorithm)
    by_name = {job.weight.name: job for job in plan.jobs}
    transforms = {}
    for name, values in result.replaced.items():
        job = by_name.get(name)
        transforms[name] = Replaced(values, (job.out_dtype or job.weight.data.dtype.name) if job is not None else "F32")
    document = {**request.to_json(), **result.to_json()} | ({"warnings": said} if said else {})
    return Calibrated(document, encodings, transforms)
