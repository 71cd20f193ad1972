"""The sequential calibration runner: one decoder layer in memory, the activations of the
calibration samples carried from layer to layer (DESIGN.md, "Calibration"). It knows no
algorithm: each is a `LayerStep` (`qtool.calibration.layers`) that `algorithms` names.

    tokens [samples, seq_len]
      --embeddings (the base model's own forward, stopped at the first layer)--> hidden [samples, seq_len, hidden]
      --for each layer: read its weights (qtool's readers)
        -> the step: the layer and its caught inputs (`CaughtLayer`); it runs the layer with
           its hooks (GPTQ's Hessians, AWQ's means, the importance matrix's sums), quantizes
           or accumulates, and gives the next layer's inputs (the quantized layer's outputs,
           or the float layer's where the algorithm feeds those: AWQ, the importance matrix)
        -> back to meta

The layer keyword arguments (causal mask, rotary position embeddings, positions) are the ones
the base model's own forward passes each layer, caught there by stand-ins, so each
architecture's conventions (Gemma's scaled embeddings, sliding windows alternating with global
attention) are transformers' own. Peak memory: one layer, the activations twice (inputs, float
outputs; GPTQ's true sequential: once, and every sample's tensors inside the layer while a
Linear waits, less the inputs parked on disk), the step's statistics, and the packed codes of
the layers done so far (spilled to disk).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from qtool.calibration.algorithms import ALGORITHMS, RunnerOptions
from qtool.calibration.codes import Calibration, LayerResult, check_scheme
from qtool.calibration.layers import LayerKwargs
from qtool.errors import UsageError
from qtool.libc import trim_heap

if TYPE_CHECKING:
    import torch

    from qtool.calibration.layers import LayerMade, LayerStep
    from qtool.calibration.skeleton import Skeleton
    from qtool.formats.checkpoint import Checkpoint
    from qtool.scheme import QScheme
    from qtool.weight import Weight

# ALGORITHMS, RunnerOptions, Calibration, LayerResult, check_scheme, LayerKwargs: where the
# calibration request and its callers have always found them
__all__ = [
    "ALGORITHMS",
    "RunnerOptions",
    "LayerResult",
    "Calibration",
    "LayerKwargs",
    "calibrate",
    "check_scheme",
    "embed",
    "run_layers",
]


class _Stop(Exception):
    """Raised by the stand-in for the last layer once every layer has its arguments."""


_DROPPED = ("cache", "past_key_values", "past_key_value", "use_cache")


class _Catcher:
    """Stand-ins for every layer: each records the arguments it is called with and passes the
    hidden states through; the last stops the forward."""

    def __init__(self, count: int) -> None:
        self.hidden: torch.Tensor | None = None
        self.kwargs: list[dict[str, Any] | None] = [None] * count

    def module(self, index: int):
        import torch

        catcher = self
        last = len(self.kwargs) - 1

        class LayerInputs(torch.nn.Module):
            def forward(self, hidden_states, *args, **kwargs):
                if args:
                    raise UsageError(
                        "the architecture's layers take positional arguments besides the hidden states; qtool cannot calibrate it",
                        option="calibrate",
                    )
                if index == 0:
                    catcher.hidden = hidden_states
                catcher.kwargs[index] = {key: value for key, value in kwargs.items() if key not in _DROPPED}
                if index == last:
                    raise _Stop
                return hidden_states

        return LayerInputs()


def embed(skeleton, tokens: torch.Tensor, weights, checkpoint, device: str):
    """[samples, seq_len, hidden] hidden states in the skeleton's dtype (float32 for
    calibration) and the layers' kwargs (`LayerKwargs`: the first layer's, each layer's by
    `for_layer`), from the base model's forward with every part but the layers materialized."""
    import torch

    count = len(skeleton.layers)
    catcher = _Catcher(count)
    originals = list(skeleton.layers)
    for index in range(count):
        skeleton.layers[index] = catcher.module(index)
    layers_name = skeleton.layers_prefix.rpartition(".")[2]
    embedding = skeleton.input_embedding()
    skip = (layers_name,) if embedding is None else (layers_name, embedding[0])
    skeleton.materialize(skeleton.base, skeleton.base_prefix, weights, checkpoint, device, skip=skip)
    if embedding is not None:  # only the rows of the tokens the samples use; ids renumbered into them
        rows, tokens = torch.unique(tokens, return_inverse=True)
        restore = skeleton.materialize_rows(
            embedding[1],
            f"{skeleton.base_prefix}.{embedding[0]}" if skeleton.base_prefix else embedding[0],
            rows,
            weights,
            checkpoint,
            device,
        )
    hidden = None
    try:
        with torch.no_grad():
            for index in range(tokens.shape[0]):
                try:
                    if embedding is None:
                        skeleton.base(input_ids=tokens[index : index + 1].to(device), use_cache=False)
                    else:  # the embedding module itself (Gemma 3's scale included), on the renumbered ids
                        skeleton.base(inputs_embeds=embedding[1](tokens[index : index + 1].to(device)), use_cache=False)
                except _Stop:
                    pass
                if catcher.hidden is None:
                    raise UsageError(
                        f"the {skeleton.config.model_type} model's forward never reached its first layer",
                        option="calibrate",
                    )
                if hidden is None:
                    hidden = torch.empty(
                        (tokens.shape[0], *catcher.hidden.shape[1:]),
                        dtype=getattr(torch, skeleton.dtype),
                        device=device,
                    )
                hidden[index] = catcher.hidden[0]
    finally:
        if embedding is not None:
            restore()
        for index, layer in enumerate(originals):
            skeleton.layers[index] = layer
        for name, child in skeleton.base.named_children():
            if name != layers_name:
                skeleton.release(child)
    if any(kwargs is None for kwargs in catcher.kwargs):
        raise UsageError(
            f"the {skeleton.config.model_type} model's forward does not call each of its layers once in order; qtool cannot calibrate it",
            option="calibrate",
        )
    by_layer = {id(layer): kwargs for layer, kwargs in zip(originals, catcher.kwargs)}
    return hidden, LayerKwargs(catcher.kwargs[0], by_layer)


def run_layers(
    skeleton: Skeleton,
    checkpoint: Checkpoint,
    by_name: dict[str, Weight],
    tokens: torch.Tensor,
    device: str,
    step: LayerStep,
    done: Callable[[int, float, LayerMade, int], None] | None = None,
) -> None:
    """`tokens` embedded, then each decoder layer materialized, handed to `step` with its
    inputs, its outputs the next layer's inputs, and released; `done(layer index, seconds,
    what the step made, layers)` after each. The step is not closed here."""
    import torch

    from qtool.calibration.layers import CaughtLayer

    hidden, kwargs = embed(skeleton, tokens, by_name, checkpoint, device)
    trim_heap()  # the tokenizer's and the embedding step's freed memory
    count = len(skeleton.layers)
    for index in range(count):
        layer_started = time.perf_counter()
        prefix = f"{skeleton.layers_prefix}.{index}"
        layer = skeleton.layers[index]
        skeleton.materialize(layer, prefix, by_name, checkpoint, device)
        routers = {block.router for block in skeleton.moe[index] if block.router is not None}
        linears = {
            f"{prefix}.{name}.weight": module
            for name, module in layer.named_modules()
            if isinstance(module, torch.nn.Linear) or name in routers
        }
        made = step.layer(CaughtLayer(index, prefix, layer, linears, hidden, kwargs))
        hidden = made.outputs
        skeleton.release(layer)
        trim_heap()  # the layer's freed blocks, not resident through the next layer
        if done is not None:
            done(index, time.perf_counter() - layer_started, made, count)


def calibrate(
    checkpoint: Checkpoint,
    weights: list[Weight],
    schemes: dict[str, QScheme],
    layout,
    tokens: torch.Tensor,
    options: RunnerOptions,
    *,
    seed: int = 0,
    on_layer: Callable[[LayerResult, int], None] | None = None,
    on_statistics: Callable[[int, str, torch.Tensor], None] | None = None,
    skeleton: Skeleton | None = None,
) -> Calibration:
    """`options.algorithm`'s codes (`algorithms.layer_step`) for every weight in `schemes` that
    is a Linear of a decoder layer, encoded in compressed-tensors' tensors (AWQ's smoothed float
    tensors in `replaced`). `on_layer(result, layers)` after each layer; `on_statistics(layer
    index, weight name, its Hessian)` before GPTQ quantizes each weight (for tests). `skeleton`:
    the checkpoint's, where the caller has built it already (built here otherwise)."""
    from qtool.calibration.algorithms import check_algorithm, layer_step
    from qtool.calibration.codes import new_spill
    from qtool.calibration.skeleton import Skeleton

    check_algorithm(options.algorithm)
    started = time.perf_counter()
    by_name = {w.name: w for w in weights}
    if skeleton is None:
        skeleton = Skeleton.build(checkpoint)
    result = Calibration(options.algorithm, int(tokens.shape[0]), int(tokens.shape[1]), seed)
    step = layer_step(options, skeleton, schemes, by_name, result, on_statistics)
    result.spill = new_spill()

    def done(index: int, seconds: float, made: LayerMade, count: int) -> None:
        layer_result = LayerResult(index, seconds, made.error, made.weights, made.unrouted)
        result.layers.append(layer_result)
        if on_layer is not None:
            on_layer(layer_result, count)

    try:
        run_layers(skeleton, checkpoint, by_name, tokens, options.device, step, done)
    finally:
        step.close()
    result.seconds = time.perf_counter() - started
    return result
