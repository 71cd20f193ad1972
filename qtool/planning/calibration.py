"""A plan's calibration stage: prepared when the plan is made (every precondition checked, the
token windows drawn, so `--dry-run` and a bad input fail the same way with nothing written),
and run before the executor into a `qtool.plan.Calibrated`, which the executor applies beside
the plan. Which stage runs is the request's tagged calibration value, read here and nowhere
else: GPTQ, AWQ and RTN on token windows (`qtool.calibration.request`), or llama.cpp's
importance matrix on chunks of the text (`qtool.calibration.imatrix`)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from qtool.errors import UsageError
from qtool.plan import QUANTIZE, Calibrated, Plan
from qtool.planning.preconditions import ready, require_float_model
from qtool.planning.request import Awq, Calibration, Gptq, ImatrixText, Rtn

if TYPE_CHECKING:
    from qtool.calibration.imatrix import ImatrixRequest
    from qtool.calibration.request import CalibrationRequest

__all__ = ["prepare", "run"]


def prepare(plan: Plan, calibration: Calibration) -> Plan:
    """The plan with its calibration stage (a new value); the plan as it is when there is none
    to run (an importance-matrix file is weighed in planning, by the GGUF layout)."""
    if isinstance(calibration, ImatrixText):
        stage: CalibrationRequest | ImatrixRequest = _imatrix_request(plan, calibration)
    elif isinstance(calibration, (Gptq, Awq, Rtn)):
        stage = _calibration_request(plan, calibration)
        if stage.actorder is not None:
            plan = replace(plan, config=_with_actorder(plan.config, stage.actorder))
    else:
        return plan
    return replace(plan, calibration=stage, warnings=plan.warnings + stage.notes)


def run(plan: Plan, device: str, threads: int | None, on_layer: Callable[[Any, int], None] | None) -> Calibrated | None:
    """Run the plan's calibration stage (with `threads` kernel threads, restored after) and
    return what it made; None without one."""
    stage = plan.calibration
    if stage is None:  # before the imports: a plain run never loads the calibration modules
        return None
    from qtool.calibration import imatrix, request
    from qtool.pipeline import kernel_threads

    with kernel_threads(threads):
        if isinstance(stage, imatrix.ImatrixRequest):
            return imatrix.apply_request(plan, stage, device, on_layer)
        return request.apply(plan, stage, device, on_layer)


def _imatrix_request(plan: Plan, calibration: ImatrixText) -> ImatrixRequest:
    from qtool.calibration.imatrix import ImatrixRequest, chunk_tokens

    require_float_model(plan.source, [job.weight for job in plan.jobs])
    readied = ready(plan.source, calibration.text)
    tokens = chunk_tokens(readied.text, readied.tokenizer, calibration.chunk_size, calibration.chunks, calibration.text)
    return ImatrixRequest(calibration.text, tokens, readied.notes, calibration.mix, readied.skeleton)


def _calibration_request(plan: Plan, calibration: Gptq | Awq | Rtn) -> CalibrationRequest:
    from qtool.calibration.request import CalibrationRequest
    from qtool.calibration.runner import check_scheme
    from qtool.calibration.samples import SampleOptions, draw_samples

    require_float_model(plan.source, [job.weight for job in plan.jobs])
    if plan.layout.name != "compressed-tensors":
        raise UsageError(
            f"calibrated quantization writes compressed-tensors, not {plan.layout.name}", option="calibrate"
        )
    samples = SampleOptions(calibration.samples, calibration.seq_len, calibration.seed)
    samples.check()
    if isinstance(calibration, (Gptq, Awq)):
        for job in plan.jobs:
            if job.action == QUANTIZE and job.scheme is not None:
                check_scheme(job.weight.name, job.scheme)
    readied = ready(plan.source, calibration.text)
    tokens = draw_samples(readied.text, readied.tokenizer, samples, calibration.text)
    actorder = calibration.actorder if isinstance(calibration, Gptq) else None
    true_sequential = calibration.true_sequential if isinstance(calibration, Gptq) else False
    return CalibrationRequest(
        calibration.text,
        calibration.algorithm,
        tokens,
        calibration.seed,
        actorder,
        true_sequential,
        readied.notes,
        readied.skeleton,
    )


def _with_actorder(config: dict[str, Any] | None, actorder: str) -> dict[str, Any] | None:
    """config.json with GPTQ's column order recorded, as compressed-tensors records it: in each
    config group's int weight arguments. A new dict; the layout's is not changed."""
    config = copy.deepcopy(config)
    quantization = (config or {}).get("quantization_config")
    for group in (quantization or {}).get("config_groups", {}).values():
        if group.get("weights") is not None and group["weights"].get("type") == "int":
            group["weights"]["actorder"] = actorder
    return config
