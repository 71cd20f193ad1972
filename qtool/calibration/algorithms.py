"""The calibration algorithms `quantize --calibrate` runs, by name, each as the `LayerStep` the
sequential runner hands every decoder layer (`qtool.calibration.layers`): the one place that
names them, so the runner knows none and a new algorithm is its step and a row here.

    gptq  GptqStep (qtool.calibration.gptq_step): Hessians over the float layer's run, GPTQ
          per Linear, the quantized outputs feed the next layer; with `true_sequential`
          each Linear on its quantized predecessors' outputs, in one run of the layer
    awq   AwqStep (qtool.calibration.awq_step): scales searched and folded, clipping, round
          to nearest; the float outputs feed the next layer
    rtn   RtnStep (qtool.calibration.awq_step): round to nearest, AWQ's baseline

(The importance matrix, `qtool.calibration.imatrix`, is a step too, of its own command: it
quantizes nothing and reports sums, not codes.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Callable

from qtool.errors import UsageError

if TYPE_CHECKING:
    import torch

    from qtool.calibration.codes import Calibration
    from qtool.calibration.layers import LayerStep
    from qtool.calibration.skeleton import Skeleton
    from qtool.scheme import QScheme
    from qtool.weight import Weight

__all__ = ["ALGORITHMS", "STEPS", "RunnerOptions", "check_algorithm", "layer_step"]


@dataclass(frozen=True)
class RunnerOptions:
    algorithm: str = "gptq"
    device: str = "cpu"
    dampening: float = 0.01
    block: int = 128
    actorder: str | None = None  # GPTQ's column order ("weight" / "static"), or None
    true_sequential: bool = False  # GPTQ: each Linear on its quantized predecessors' outputs, one run a layer


def _gptq(options: RunnerOptions, skeleton, schemes, by_name, result, on_statistics) -> LayerStep:
    from qtool.calibration.gptq_step import GptqStep

    return GptqStep(
        schemes,
        by_name,
        result,
        dampening=options.dampening,
        block=options.block,
        actorder=options.actorder,
        true_sequential=options.true_sequential,
        on_statistics=on_statistics,
    )


def _awq(options: RunnerOptions, skeleton, schemes, by_name, result, on_statistics) -> LayerStep:
    from qtool.calibration.awq_step import AwqStep

    return AwqStep(skeleton.config.model_type, schemes, by_name, result)


def _rtn(options: RunnerOptions, skeleton, schemes, by_name, result, on_statistics) -> LayerStep:
    from qtool.calibration.awq_step import RtnStep

    return RtnStep(schemes, by_name, result)


# each algorithm's step, made from (options, skeleton, schemes, weights by name, result, on_statistics)
STEPS: dict[str, Callable[..., LayerStep]] = {"gptq": _gptq, "awq": _awq, "rtn": _rtn}
ALGORITHMS = tuple(STEPS)


def check_algorithm(algorithm: str) -> None:
    """`algorithm` one of `ALGORITHMS`, else a one-line refusal (exit 2)."""
    if algorithm not in ALGORITHMS:
        raise UsageError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}", option="algorithm")


def layer_step(
    options: RunnerOptions,
    skeleton: Skeleton,
    schemes: dict[str, QScheme],
    by_name: dict[str, Weight],
    result: Calibration,
    on_statistics: Callable[[int, str, torch.Tensor], None] | None = None,
) -> LayerStep:
    """The step of `options.algorithm` that quantizes the weights of `schemes` (each checked:
    int2..int8 per channel or group) into `result`; `on_statistics(layer, weight, Hessian)`
    where the algorithm has Hessians (GPTQ; for tests)."""
    from qtool.calibration.codes import check_scheme

    check_algorithm(options.algorithm)
    for name, scheme in schemes.items():
        check_scheme(name, scheme)
    return STEPS[options.algorithm](options, skeleton, schemes, by_name, result, on_statistics)
