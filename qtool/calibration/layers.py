"""What the sequential runner hands a calibration algorithm for each decoder layer, and what
the algorithm gives back: the contract between `qtool.calibration.runner`, which knows no
algorithm, and each algorithm's `LayerStep` (`qtool.calibration.algorithms` names them).

    runner: layer materialized, its inputs caught --CaughtLayer--> step.layer
    step:   observes (hooks on the layer's run), quantizes or accumulates, runs the layer
            for the next layer's inputs --LayerMade--> runner: the layer released

Which outputs feed the next layer is the algorithm's choice (GPTQ: the quantized layer's; AWQ
and the importance matrix: the float layer's, which only the step's own observing run has), so
the step returns them. Also here: running a layer over the samples (`run`), with each layer's
own keyword arguments (`LayerKwargs`), and the output error a step reports (`relative_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "LayerKwargs",
    "CaughtLayer",
    "LayerMade",
    "LayerStep",
    "forward",
    "run",
    "relative_error",
    "error_on_a_share",
    "ERROR_SHARE",
    "BATCH_VALUES",
    "per_batch",
    "token_values",
]


class LayerKwargs(dict):
    """The keyword arguments the base model passes its first layer (the dict itself), and each
    layer's own (`for_layer`): Gemma 2/3 alternate sliding-window and global attention, with a
    different mask (and Gemma 3 a different rotary embedding) per layer type. `run` picks the
    layer's own, so a caller that hands the same object to every layer gets the right ones."""

    def __init__(self, first: dict[str, Any], by_layer: dict[int, dict[str, Any]]) -> None:
        super().__init__(first)
        self.by_layer = by_layer  # id(layer module) -> its kwargs

    def for_layer(self, layer) -> dict[str, Any]:
        return self.by_layer.get(id(layer), self)


@dataclass
class CaughtLayer:
    """One decoder layer as the runner hands it to a step: materialized on the device, its
    inputs over every calibration sample, and its Linears (and mixture routers) by weight name."""

    index: int
    prefix: str  # "model.layers.3"
    module: Any  # the decoder layer (torch.nn.Module), its weights real
    linears: dict[str, Any]  # "model.layers.3.mlp.up_proj.weight": its module, every Linear and router in module order
    hidden: torch.Tensor  # [samples, seq_len, hidden] float32: the layer's inputs (a step may write over them)
    kwargs: dict[str, Any]  # the layer keyword arguments (`LayerKwargs`: each layer's own by `for_layer`)


@dataclass
class LayerMade:
    """What a step made of one layer: the next layer's inputs, the weights it calibrated (the
    step's own names for them), and, where it quantizes, the layer's output error and the
    weights no calibration token reached (rounded to nearest)."""

    outputs: torch.Tensor  # [samples, seq_len, hidden]: the next layer's inputs
    weights: list[str]
    error: float = 0.0  # sum (y_quantized - y_float)^2 / sum y_float^2 over the samples measured
    unrouted: list[str] = field(default_factory=list)


class LayerStep(Protocol):
    """One calibration algorithm's work on one decoder layer at a time, in layer order."""

    def layer(self, caught: CaughtLayer) -> LayerMade:
        """Observe the layer over its caught inputs, quantize (or accumulate) what the step
        calibrates, and give the next layer's inputs."""
        ...

    def close(self) -> None:
        """Free what the step held across layers (temporary files); called once, last."""
        ...


def forward(layer, sample: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The layer's output for one sample [1, seq, hidden], [seq, hidden]."""
    result = layer(sample, **kwargs)
    return (result[0] if isinstance(result, tuple) else result)[0]


def run(layer, hidden: torch.Tensor, kwargs: dict[str, Any], out: torch.Tensor) -> None:
    """The layer over each sample into `out` (which may be `hidden`); with `LayerKwargs`, the
    layer's own arguments."""
    import torch

    if isinstance(kwargs, LayerKwargs):
        kwargs = kwargs.for_layer(layer)
    with torch.no_grad():
        for index in range(hidden.shape[0]):
            out[index] = forward(layer, hidden[index : index + 1], kwargs)


def relative_error(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    """sum (quantized - reference)^2 / sum reference^2 over the samples [samples, ...], in
    float64 one sample at a time."""
    error = total = 0.0
    for q, r in zip(quantized, reference):
        error += float((q.double() - r.double()).pow(2).sum())
        total += float(r.double().pow(2).sum())
    return error / total if total else 0.0


ERROR_SHARE = 16  # a step that keeps the float outputs for the next layer measures the quantized layer on one sample in 16 (at least one)


def error_on_a_share(layer, hidden: torch.Tensor, kwargs, reference: torch.Tensor) -> float:
    """The quantized layer's output error against `reference` (the float layer's outputs) on
    the first samples (`ERROR_SHARE`)."""
    import torch

    measured = -(-hidden.shape[0] // ERROR_SHARE)
    quantized = torch.empty_like(hidden[:measured])
    run(layer, hidden[:measured], kwargs, quantized)
    return relative_error(quantized, reference[:measured])


# the most float32 values one activation of a batch of samples may hold (128 MiB): the batch's
# tokens times a token's values in the layer's widest Linear or attention scores
BATCH_VALUES = 1 << 25


def per_batch(samples: int, seq_len: int, values_per_token: int) -> int:
    """How many samples one layer run takes at once: all of them where an activation of
    `values_per_token` values a token stays within `BATCH_VALUES`, else as many as fit (at
    least one)."""
    return max(1, min(samples, BATCH_VALUES // max(1, seq_len * values_per_token)))


def token_values(skeleton, seq_len: int) -> int:
    """Values one token holds in a layer's widest activation: its widest Linear's, or its
    attention scores' (heads x seq_len, where attention materializes them)."""
    config = getattr(skeleton.config, "text_config", None) or skeleton.config

    def number(key: str) -> int:
        value = getattr(config, key, None)
        return value if isinstance(value, int) and value > 0 else 0

    widest = max(number("hidden_size"), number("intermediate_size"), number("moe_intermediate_size"))
    return max(1, widest, number("num_attention_heads") * seq_len)
