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

__all__ = ["CalibrationRequest", "prepare", "apply"]


@dataclass
class CalibrationRequest:
    text: str
    algorithm: str
    tokens: "torch.Tensor"  # [samples, seq_len]
    seed: int

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "algorithm": self.algorithm, "samples": int(self.tokens.shape[0]), "seq_len": int(self.tokens.shape[1]), "seed": self.seed}


def prepare(plan: "Plan", text: str, algorithm: str, samples: int, seq_len: int, seed: int) -> CalibrationRequest:
    from qtool.calibration.runner import ALGORITHMS, check_scheme
    from qtool.calibration.samples import SampleOptions, draw_samples, load_tokenizer, read_text
    from qtool.calibration.skeleton import Skeleton
    from qtool.plan import QUANTIZE

    source = plan.source
    if algorithm not in ALGORITHMS:
        raise UsageError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}", hint="awq is not written yet", option="algorithm")
    if source.format != "safetensors":
        raise UsageError(f"{source.path} is a {source.format} checkpoint; calibration reads a Hugging Face model folder (safetensors, config.json, tokenizer)", option="calibrate")
    if plan.layout.name != "compressed-tensors":
        raise UsageError(f"calibrated quantization writes compressed-tensors, not {plan.layout.name}", option="calibrate")
    quantized = [job.weight.name for job in plan.jobs if job.weight.quantized]
    if quantized:
        raise UsageError(f"{source.path} is already quantized ({quantized[0]}); calibration needs float weights", option="calibrate")
    SampleOptions(samples, seq_len, seed).check()
    if algorithm == "gptq":
        for job in plan.jobs:
            if job.action == QUANTIZE and job.scheme is not None:
                check_scheme(job.weight.name, job.scheme)
    folder = source.path if os.path.isdir(source.path) else os.path.dirname(os.path.abspath(source.path))
    Skeleton.build(source)  # an architecture transformers does not know is refused here
    documents = read_text(text)
    tokens = draw_samples(documents, load_tokenizer(folder), SampleOptions(samples, seq_len, seed), text)
    return CalibrationRequest(os.fspath(text), algorithm, tokens, seed)


def apply(plan: "Plan", request: CalibrationRequest, device: str, threads: int | None = None, on_layer: Callable[[Any, int], None] | None = None) -> dict[str, Any]:
    """Calibrate (with `threads` torch threads, restored after) and set each calibrated job's
    encoding; the calibration document for the report. RTN ("rtn") leaves the plan as it is:
    the text only checked."""
    import torch

    if request.algorithm == "rtn":
        return {**request.to_json(), "layers": []}
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _calibrated(plan, request, device, on_layer)
    finally:
        torch.set_num_threads(previous)


def _calibrated(plan: "Plan", request: CalibrationRequest, device: str, on_layer) -> dict[str, Any]:
    from qtool.calibration.runner import RunnerOptions, calibrate
    from qtool.plan import QUANTIZE, Precomputed

    jobs = [job for job in plan.jobs if job.action == QUANTIZE and job.scheme is not None]
    schemes = {job.weight.name: job.scheme for job in jobs}
    result = calibrate(
        plan.source, [job.weight for job in plan.jobs], schemes, plan.layout, request.tokens,
        RunnerOptions(algorithm=request.algorithm, device=device), seed=request.seed, on_layer=on_layer,
    )  # fmt: skip
    for job in jobs:
        tensors = result.encoded.pop(job.weight.name, None)
        if tensors is not None:
            job.encoding = Precomputed(tensors, request.algorithm)
    return {**request.to_json(), **result.to_json()}
