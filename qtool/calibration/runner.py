"""The sequential calibration runner: one decoder layer in memory, the activations of the
calibration samples carried from layer to layer (DESIGN.md, "Calibration").

    tokens [samples, seq_len]
      --embeddings (the base model's own forward, stopped at the first layer)--> hidden [samples, seq_len, hidden]
      --for each layer: read its weights (qtool's readers) -> run it, each quantized Linear's
        inputs summed into H = X^T X (float32) -> GPTQ per Linear -> its weight set to the
        dequantized codes -> run it again: the QUANTIZED layer's outputs feed the next layer
        -> back to meta

The layer keyword arguments (causal mask, rotary position embeddings, positions) are the ones
the base model's own forward passes its first layer, caught there, so each architecture's
conventions (Gemma's scaled embeddings, sliding windows) are transformers' own. Peak memory: one
layer, the activations twice (inputs, outputs), one Hessian per Linear of the layer, and the
packed codes of the layers done so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from qtool.errors import SchemeError, UsageError

if TYPE_CHECKING:
    import torch

    from qtool.formats.checkpoint import Checkpoint
    from qtool.scheme import QScheme
    from qtool.weight import Weight

__all__ = ["ALGORITHMS", "RunnerOptions", "LayerResult", "Calibration", "calibrate", "check_scheme"]

ALGORITHMS = ("gptq", "rtn")


@dataclass(frozen=True)
class RunnerOptions:
    algorithm: str = "gptq"
    device: str = "cpu"
    dampening: float = 0.01
    block: int = 128


@dataclass
class LayerResult:
    index: int
    seconds: float
    output_error: float  # sum (y_quantized - y_float)^2 / sum y_float^2 over the calibration samples
    weights: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.index, "seconds": round(self.seconds, 3), "output_rel_mse": self.output_error, "weights": list(self.weights)}


@dataclass
class Calibration:
    """What calibration produced: each calibrated weight's layout tensors, and per layer its
    time and output error."""

    algorithm: str
    samples: int
    seq_len: int
    seed: int
    encoded: dict[str, dict[str, Any]] = field(default_factory=dict)
    layers: list[LayerResult] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "samples": self.samples,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "seconds": round(self.seconds, 3),
            "layers": [layer.to_json() for layer in self.layers],
        }


def check_scheme(name: str, scheme: "QScheme") -> None:
    """GPTQ here writes int2..int8 per channel or per group."""
    if scheme.qtype.kind != "int" or not 2 <= scheme.qtype.bits <= 8 or scheme.granularity not in ("channel", "group"):
        raise SchemeError(f"GPTQ calibrates int2..int8 per channel or per group, not {scheme.label} ({name})", hint="use e.g. W4A16, int4:g64:asym or int8:channel")


class _Stop(Exception):
    """Raised by the stand-in for the first layer once it has its inputs."""


class _Catcher:
    def __init__(self) -> None:
        self.hidden: "torch.Tensor | None" = None
        self.kwargs: dict[str, Any] = {}

    def module(self):
        import torch

        catcher = self

        class FirstLayerInputs(torch.nn.Module):
            def forward(self, hidden_states, *args, **kwargs):
                if args:
                    raise UsageError("the architecture's layers take positional arguments besides the hidden states; qtool cannot calibrate it", option="calibrate")
                catcher.hidden, catcher.kwargs = hidden_states, kwargs
                raise _Stop

        return FirstLayerInputs()


def _embed(skeleton, tokens: "torch.Tensor", weights, checkpoint, device: str):
    """[samples, seq_len, hidden] float32 hidden states and the layer kwargs, from the base
    model's forward with every part but the layers materialized."""
    import torch

    catcher = _Catcher()
    first = skeleton.layers[0]
    skeleton.layers[0] = catcher.module()
    layers_name = skeleton.layers_prefix.rpartition(".")[2]
    skeleton.materialize(skeleton.base, skeleton.base_prefix, weights, checkpoint, device, skip=layers_name)
    hidden = None
    try:
        with torch.no_grad():
            for index in range(tokens.shape[0]):
                try:
                    skeleton.base(input_ids=tokens[index : index + 1].to(device), use_cache=False)
                except _Stop:
                    pass
                if catcher.hidden is None:
                    raise UsageError(f"the {skeleton.config.model_type} model's forward never reached its first layer", option="calibrate")
                if hidden is None:
                    hidden = torch.empty((tokens.shape[0], *catcher.hidden.shape[1:]), dtype=torch.float32, device=device)
                hidden[index] = catcher.hidden[0].float()
    finally:
        skeleton.layers[0] = first
        for name, child in skeleton.base.named_children():
            if name != layers_name:
                skeleton.release(child)
    kwargs = {key: value for key, value in catcher.kwargs.items() if key not in ("cache", "past_key_values", "past_key_value", "use_cache")}
    return hidden, kwargs


def _run(layer, hidden: "torch.Tensor", kwargs: dict[str, Any], out: "torch.Tensor", on_sample: Callable[[int, "torch.Tensor"], None] | None = None) -> None:
    import torch

    with torch.no_grad():
        for index in range(hidden.shape[0]):
            result = layer(hidden[index : index + 1], **kwargs)
            result = result[0] if isinstance(result, tuple) else result
            if on_sample is not None:
                on_sample(index, result[0])
            out[index] = result[0]


def calibrate(
    checkpoint: "Checkpoint",
    weights: list["Weight"],
    schemes: dict[str, "QScheme"],
    layout,
    tokens: "torch.Tensor",
    options: RunnerOptions,
    *,
    seed: int = 0,
    on_layer: Callable[[LayerResult, int], None] | None = None,
    on_statistics: Callable[[int, dict[str, "torch.Tensor"], "torch.Tensor"], None] | None = None,
) -> Calibration:
    """GPTQ codes for every weight in `schemes` that is a Linear of a decoder layer, encoded in
    `layout`'s tensors. `on_layer(result, layers)` after each layer; `on_statistics(index,
    hessians by weight name, the layer's input hidden states)` before its weights are quantized
    (for tests)."""
    import torch

    from qtool.calibration.gptq import gptq
    from qtool.calibration.skeleton import Skeleton
    from qtool.dtypes import storage_dtype
    from qtool.layouts.compressed_tensors import pack_int_codes, scale_storage

    if options.algorithm not in ALGORITHMS:
        raise UsageError(f"algorithm {options.algorithm!r} is not one of {', '.join(ALGORITHMS)}", option="algorithm")
    started = time.perf_counter()
    by_name = {w.name: w for w in weights}
    skeleton = Skeleton.build(checkpoint)
    device = options.device
    for name, scheme in schemes.items():
        check_scheme(name, scheme)
    result = Calibration(options.algorithm, int(tokens.shape[0]), int(tokens.shape[1]), seed)
    hidden, kwargs = _embed(skeleton, tokens, by_name, checkpoint, device)
    outputs = torch.empty_like(hidden)
    count = len(skeleton.layers)
    for index in range(count):
        layer_started = time.perf_counter()
        prefix = f"{skeleton.layers_prefix}.{index}"
        layer = skeleton.layers[index]
        skeleton.materialize(layer, prefix, by_name, checkpoint, device)
        linears = {
            f"{prefix}.{name}.weight": module
            for name, module in layer.named_modules()
            if isinstance(module, torch.nn.Linear) and f"{prefix}.{name}.weight" in schemes
        }
        hessians = {name: torch.zeros((m.in_features, m.in_features), dtype=torch.float32, device=device) for name, m in linears.items()}
        hooks = []
        for name, module in linears.items():

            def accumulate(module, args, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                hessians[name].addmm_(x.T, x)

            hooks.append(module.register_forward_pre_hook(accumulate))
        try:
            _run(layer, hidden, kwargs, outputs)  # float outputs, and the statistics
        finally:
            for hook in hooks:
                hook.remove()
        if on_statistics is not None:
            on_statistics(index, hessians, hidden)
        for name, module in linears.items():
            scheme = schemes[name]
            dtype = by_name[name].dtype
            scale_dtype = storage_dtype(scale_storage(scheme, dtype)).torch_dtype()
            codes = gptq(
                module.weight.data, hessians.pop(name), bits=scheme.qtype.bits, group_size=scheme.group_size if scheme.granularity == "group" else None,
                symmetric=scheme.symmetric, scale_dtype=scale_dtype, dampening=options.dampening, block=options.block,
            )  # fmt: skip
            module.weight.data = codes.dequantized().to(device)
            result.encoded[name] = {k: v.cpu() for k, v in pack_int_codes(name, codes.codes, codes.scale, codes.zero_point, scheme, dtype).items()}
        error = [0.0, 0.0]

        def measure(sample: int, quantized: "torch.Tensor") -> None:
            reference = outputs[sample]
            error[0] += float((quantized.double() - reference.double()).pow(2).sum())
            error[1] += float(reference.double().pow(2).sum())

        _run(layer, hidden, kwargs, hidden, measure)  # the quantized layer's outputs feed the next
        skeleton.release(layer)
        layer_result = LayerResult(index, time.perf_counter() - layer_started, error[0] / error[1] if error[1] else 0.0, sorted(linears))
        result.layers.append(layer_result)
        if on_layer is not None:
            on_layer(layer_result, count)
    result.seconds = time.perf_counter() - started
    return result
