"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): scale each input channel of a group of Linears by s before rounding to nearest,
and divide the layer that feeds them (a norm, or a Linear) by s, so the float function is
unchanged and the channels that carry large activations lose less to rounding.

    s(r) = x_mean^r / (w_mean^(1-r) + 1e-4), clamped at 1e-4, divided by sqrt(max(s) min(s))

x_mean: the mean |x| of each input channel over the calibration tokens; w_mean: the mean of each
input channel of |W| normalized by its quantization group's max, over the balance layers' rows.
r runs over a grid of 20 points (llm-compressor's `AWQModifier` defaults, duo scaling: r = 0
without the weight term, then 19 ratios 0..1 with it); the s whose Q(W s) / s gives the
smallest mean squared error of the parent module's output (the lowest common ancestor of the
balance layers: the attention for q/k/v, the MLP for gate/up, the Linear itself alone) on the
calibration inputs wins, the grid raced: every point on the first eighth of the samples, the
best five there (and s = 1) on all (`_raced_errors`). Where the parent is the lone balance
Linear (o_proj, down_proj) that error is computed from X^T X of its inputs instead of a
forward per grid point: the same quantity, summed in another order (`search`'s `gram`), for
every point.

The mappings are llm-compressor's for LLaMA-like layers (by module name inside a decoder layer):

    input_layernorm            -> q_proj, k_proj, v_proj   (Phi-3: qkv_proj)   parent self_attn
    v_proj                     -> o_proj                    (Phi-3: qkv_proj's last rows)
    post_attention_layernorm   -> gate_proj, up_proj        (Gemma 2/3: pre_feedforward_layernorm; Phi-3: gate_up_proj)
    up_proj                    -> down_proj                 (Phi-3: gate_up_proj's last rows)

and in a mixture-of-experts layer each expert's up -> down (its w3 -> w2 in Mixtral's names);
the norm before the experts is not smoothed there, since the router reads its output too. And
with Gemma 3's input_layernorm mapping left out (its q/k norms undo the smoothing, as
llm-compressor notes), v_proj -> o_proj only where the shapes agree (no grouped-query
attention), and a mapping whose balance layers are all left unquantized skipped. A norm that
computes x * (1 + w) (Gemma's) folds as (1 + w) / s - 1, found by probing the module.

Once every mapping is folded, each quantized Linear but the queries' and keys' is clipped
before rounding (`clip`): llm-awq's `auto_clip`, part of the published method, which
llm-compressor's AWQModifier leaves out. Each group's range shrinks to the ratio of its max
that rounds with the least output error on the Linear's (smoothed) inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from qtool.errors import KernelError

if TYPE_CHECKING:
    import torch

    from qtool.calibration.gptq import GptqResult

__all__ = [
    "Mapping",
    "layer_mappings",
    "grid",
    "candidate_scales",
    "weight_means",
    "rtn",
    "fold",
    "search",
    "clip",
    "clipped",
]

N_GRID = 20  # llm-compressor's n_grid
CLIP_GRID = 20  # llm-awq's auto_clip: n_grid ...
CLIP_MAX_SHRINK = 0.5  # ... and max_shrink: clipping ratios 1, 0.95, ..., 0.55
CLIP_SKIPPED = ("q_proj", "k_proj", "qkv_proj")  # llm-awq's auto_clip leaves the queries and keys as they are


@dataclass(frozen=True)
class Mapping:
    """Names relative to the decoder layer."""

    smooth: str
    balance: tuple[str, ...]
    parent: str


def _parent(balance: tuple[str, ...]) -> str:
    """The lowest common ancestor of the balance layers; a lone balance layer is its own."""
    if len(balance) == 1:
        return balance[0]
    parts = [name.split(".") for name in balance]
    common = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return ".".join(common)


def layer_mappings(layer, model_type: str, quantized: Callable[[str], bool]) -> list[Mapping]:
    """The mappings of one decoder layer whose modules exist, whose shapes agree, and with at
    least one balance layer that `quantized(relative name)` says is quantized."""
    import torch

    modules = dict(layer.named_modules())
    mlp_norm = "pre_feedforward_layernorm" if "pre_feedforward_layernorm" in modules else "post_attention_layernorm"
    if "self_attn.qkv_proj" in modules:
        candidates = [("input_layernorm", ("self_attn.qkv_proj",)), ("self_attn.qkv_proj", ("self_attn.o_proj",))]
    else:
        candidates = [
            ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("self_attn.v_proj", ("self_attn.o_proj",)),
        ]
    if model_type.startswith("gemma3"):
        candidates = candidates[1:]
    if "mlp.gate_up_proj" in modules:
        candidates += [(mlp_norm, ("mlp.gate_up_proj",)), ("mlp.gate_up_proj", ("mlp.down_proj",))]
    else:
        candidates += [(mlp_norm, ("mlp.gate_proj", "mlp.up_proj")), ("mlp.up_proj", ("mlp.down_proj",))]
    for name, module in modules.items():  # each unfused expert (qtool.calibration.experts): its up -> its down
        names = getattr(module, "names", None)
        if (
            isinstance(names, tuple)
            and len(names) == 3
            and all(isinstance(module._modules.get(n), torch.nn.Linear) for n in names)
        ):
            candidates.append((f"{name}.{names[1]}", (f"{name}.{names[2]}",)))
    found = []
    for smooth, balance in candidates:
        if smooth not in modules or any(not isinstance(modules.get(name), torch.nn.Linear) for name in balance):
            continue
        smooth_module = modules[smooth]
        if isinstance(smooth_module, torch.nn.Linear):
            width = modules[balance[0]].in_features
            fused = smooth.endswith("qkv_proj")
            if (fused and smooth_module.out_features != 3 * width) or (
                not fused and smooth_module.out_features < width
            ):
                continue  # grouped-query attention: v_proj's outputs are not o_proj's inputs
        elif getattr(smooth_module, "weight", None) is None or smooth_module.weight.dim() != 1:
            continue
        if not any(quantized(name) for name in balance):
            continue
        found.append(Mapping(smooth, balance, _parent(balance)))
    return found


def grid(points: int = N_GRID) -> list[tuple[float, bool]]:
    """(ratio, with the weight term): r = 0 without it, then points - 1 ratios 0..1 with it."""
    return [(0.0, False)] + [(index / (points - 2), True) for index in range(points - 1)]


def weight_means(weights: list[torch.Tensor], groups: list[int]) -> torch.Tensor:
    """[in] mean over the balance layers' rows of |W| normalized by each quantization group's
    max (a group of `in` columns: per channel)."""
    import torch

    total = None
    rows = 0
    for weight, group in zip(weights, groups):
        normalized = weight.abs().reshape(-1, group)
        normalized = (normalized / (normalized.amax(dim=1, keepdim=True) + 1e-6)).reshape(weight.shape)
        summed = normalized.sum(dim=0, dtype=torch.float64)
        total = summed if total is None else total + summed
        rows += weight.shape[0]
    return (total / rows).float()


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo: bool) -> torch.Tensor:
    import torch

    if duo:
        scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        scales = x_mean.pow(ratio).clamp(min=1e-4)
    scales = scales / (scales.max() * scales.min()).sqrt()
    scales[torch.isinf(scales) | torch.isnan(scales)] = 1
    return scales


def rtn(
    weight: torch.Tensor,
    *,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    scale_dtype: torch.dtype,
    observer: str = "minmax",
) -> GptqResult:
    """Round to nearest with min-max scales per group (or row), as compressed-tensors does:
    GPTQ's observer (`observer` "mse": its search) and rounding, without the error feedback."""
    import torch

    from qtool.calibration.gptq import GptqResult, observe

    rows, cols = weight.shape
    group = group_size or cols
    if cols % group:
        raise KernelError(f"awq: group size {group} does not divide in_features {cols}")
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    grouped = weight.reshape(rows * (cols // group), group)  # not -1: a weight may have no rows
    scale, zero_point = observe(grouped, bits, symmetric, scale_dtype, observer)
    scaled = grouped / scale.to(weight.dtype).unsqueeze(1)
    if zero_point is not None:
        scaled = scaled + zero_point.to(weight.dtype).unsqueeze(1)
    codes = scaled.clamp(qmin, qmax).round().to(torch.int8).reshape(rows, cols)
    shape = (rows, cols // group)
    return GptqResult(codes, scale.reshape(shape), None if zero_point is None else zero_point.reshape(shape), 0.0)


def clipped(name: str) -> bool:
    """Whether AWQ's clipping search applies to the Linear `name`: all but the queries' and
    keys' (llm-awq: their error reaches the output through the attention's softmax, which a
    Linear's own output error does not measure)."""
    return name.removesuffix(".weight").rpartition(".")[2] not in CLIP_SKIPPED


def clip(
    weight: torch.Tensor, hessian: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor], group: int
) -> torch.Tensor:
    """`weight` [out, in] with each group clamped to +-r max|w| of that group, r on llm-awq's
    clipping grid (1, 0.95, ..., 0.55: `CLIP_GRID`, `CLIP_MAX_SHRINK`), the r whose rounding
    (`quantize`: the rounded values of a whole weight) gives the group's smallest output error
    on the calibration inputs: d H_gg d^T for the group's difference d = Q(clamped) - w and
    H_gg its block of X^T X (`hessian` [in, in], of the Linear's inputs as it will see them).
    llm-awq's auto_clip measures the same on 512 sampled tokens; X^T X takes every token, at
    out x in x group per ratio. r = 1 (no clipping) is on the grid, so no group gets worse."""
    import torch

    rows, cols = weight.shape
    if cols % group or tuple(hessian.shape) != (cols, cols):
        raise KernelError(
            f"awq: clipping {list(weight.shape)} in groups of {group} needs a hessian [{cols}, {cols}], got {list(hessian.shape)}"
        )
    groups = cols // group
    blocks = torch.stack([hessian[g * group : (g + 1) * group, g * group : (g + 1) * group] for g in range(groups)]).to(
        weight.dtype
    )
    grouped = weight.reshape(rows, groups, group)
    peak = grouped.abs().amax(dim=2, keepdim=True)
    best = best_error = None
    for step in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
        limit = peak * (1 - step / CLIP_GRID)
        difference = (
            quantize(torch.clamp(grouped, -limit, limit).reshape(rows, cols)).reshape(rows, groups, group) - grouped
        ).transpose(0, 1)
        error = (torch.bmm(difference, blocks) * difference).sum(dim=2).T  # [rows, groups]
        if best is None:
            best, best_error = limit, error
            continue
        better = error < best_error
        best = torch.where(better.unsqueeze(2), limit, best)
        best_error = torch.where(better, error, best_error)
    return torch.clamp(grouped, -best, best).reshape(rows, cols)


def _is_offset_norm(module) -> bool:
    """Whether the norm computes x * (1 + w) (Gemma) rather than x * w: its output with w = 0."""
    import torch

    weight = module.weight.data
    module.weight.data = torch.zeros_like(weight)
    try:
        with torch.no_grad():
            probe = module(torch.ones((1, weight.shape[0]), dtype=weight.dtype, device=weight.device))
    finally:
        module.weight.data = weight
    return bool(probe.abs().sum() > 0)


def fold(smooth, balance: list, scales: torch.Tensor) -> None:
    """W s into each balance Linear (its input channels), and 1/s into the smooth module's
    outputs: a norm's weight, or a Linear's last rows (and bias) where it feeds more rows than
    the balance layers take (Phi-3's fused qkv and gate_up)."""
    import torch

    for module in balance:
        module.weight.data = module.weight.data * scales.to(module.weight.dtype).unsqueeze(0)
    if isinstance(smooth, torch.nn.Linear):
        rows = scales.shape[0]
        weight = smooth.weight.data.clone()
        weight[-rows:] = weight[-rows:] / scales.to(weight.dtype).unsqueeze(1)
        smooth.weight.data = weight
        if smooth.bias is not None:
            bias = smooth.bias.data.clone()
            bias[-rows:] = bias[-rows:] / scales.to(bias.dtype)
            smooth.bias.data = bias
    elif _is_offset_norm(smooth):
        smooth.weight.data = (1 + smooth.weight.data) / scales.to(smooth.weight.dtype) - 1
    else:
        smooth.weight.data = smooth.weight.data / scales.to(smooth.weight.dtype)


@dataclass
class SearchResult:
    scales: torch.Tensor
    ratio: float
    duo: bool
    error: float  # the parent's output mean squared error with the chosen scales
    identity_error: float  # ... with s = 1 (round to nearest)


def search(
    parent,
    inputs: list[tuple[tuple, dict[str, Any]]],
    balance: list,
    quantizers: list[Callable[[torch.Tensor], torch.Tensor]],
    x_mean: torch.Tensor,
    groups: list[int],
    points: int = N_GRID,
    *,
    gram: tuple[torch.Tensor, int] | None = None,
    reference: list[torch.Tensor] | None = None,
) -> SearchResult:
    """The grid's best scales for one mapping: `parent` run on each cached (args, kwargs) with
    every balance Linear's weight set to quantizer(W s) / s, against its float outputs, the
    grid raced (`_raced_errors`: every point on the first samples, the best few on all). The
    balance weights are left as they were.

    `gram` (X^T X of the parent's inputs [in, in], the number of input rows): for a parent that
    is the lone balance Linear (v_proj -> o_proj, up_proj -> down_proj), whose output error is
    (W_q - W) x per token, the same mean squared error is sum((D X^T X) * D) / (rows * out)
    with D = W_q - W: out x in x in per grid point instead of rows x in x out, and no inputs
    kept. (`inputs` is then unused.)

    `reference`: the parent's float outputs on `inputs` where the caller has them (caught in the
    layer's own float run, with the parent's weights as they are now): one forward fewer."""
    import torch

    originals = [module.weight.data for module in balance]
    w_mean = weight_means(originals, groups)
    if gram is not None and (len(balance) != 1 or balance[0] is not parent):
        raise KernelError("awq: the X^T X shortcut is for a parent that is its one balance Linear")
    points_ = grid(points)
    candidates = [candidate_scales(x_mean, w_mean, ratio, duo) for ratio, duo in points_]

    def set_weights(scales: torch.Tensor) -> None:
        for module, original, quantize in zip(balance, originals, quantizers):
            scaled = original * scales.to(original.dtype).unsqueeze(0)
            module.weight.data = quantize(scaled) / scales.to(original.dtype).unsqueeze(0)

    try:
        if gram is None:
            errors = _raced_errors(parent, inputs, reference, set_weights, candidates)
        else:
            hessian, tokens = gram
            count = tokens * originals[0].shape[0]
            errors = []
            for scales in candidates:
                set_weights(scales)
                difference = balance[0].weight.data.float() - originals[0].float()
                errors.append(float(((difference @ hessian) * difference).sum(dtype=torch.float64)) / count)
    finally:
        for module, original in zip(balance, originals):
            module.weight.data = original
    best, errors_best = None, float("inf")  # both bound before the loop: no read behind a short-circuit
    for index, error in enumerate(errors):  # in grid order: the first of equal errors wins
        if error is None:
            continue  # shown unable to win
        error = error if error == error else float("inf")  # NaN never wins
        if best is None or error < errors_best:
            best, errors_best = index, error
    identity = errors[0] if errors and errors[0] == errors[0] else float("inf")
    if best is None or errors_best == float("inf"):
        raise KernelError("awq: no finite output error on the grid (the layer's outputs hold inf or NaN)")
    ratio, duo = points_[best]
    return SearchResult(candidates[best].clone(), ratio, duo, errors_best, identity)


RACE_SHARE = 8  # every grid point is first run on this share of the samples (at least one) ...
RACE_FINALISTS = 5  # ... and the best this many of them, with s = 1, on all of them


def _raced_errors(parent, inputs, reference, set_weights, candidates) -> list[float | None]:
    """Each grid point's mean squared error of the parent's outputs over the samples, or None for
    a point that did not reach the final: every point is run on the first 1/`RACE_SHARE` of the
    samples; the `RACE_FINALISTS` with the least error there, and point 0 (s = 1, the reported
    baseline), go on to every sample. A few samples rank the points well: on SmolLM2-135M's first
    8 layers (32 samples, int4 g64) the winner was the whole grid's in all 16 mappings searched
    by forwards (BENCHMARKS.md), at about 40% of the forwards (the search is most of AWQ's
    time, as in llm-compressor, which runs the whole grid on every sample).

    Among the finalists the argmin (first of equals) is exact: each one's error is its samples'
    squared errors summed in sample order, then divided by the element count; adding a
    non-negative float never lowers a float sum, so once a finalist's partial sum is above the
    best full sum so far (or equal to it, for a later point) its remaining samples are skipped.
    Point 0 is summed in full, then the others by increasing first-share error."""
    import torch

    def outputs(index: int) -> torch.Tensor:
        args, kwargs = inputs[index]
        with torch.no_grad():
            out = parent(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    if reference is None:
        reference = [outputs(index) for index in range(len(inputs))]
    elif len(reference) != len(inputs):
        raise KernelError(f"awq: {len(reference)} reference outputs for {len(inputs)} inputs")
    count = sum(r.numel() for r in reference)

    def squared(index: int) -> float:
        return float((outputs(index).double() - reference[index].double()).pow(2).sum())

    partial: list = [0] * len(candidates)  # int 0 first, as sum() starts
    if not inputs:
        return [total / count if count else float("nan") for total in partial]
    first = max(1, len(inputs) // RACE_SHARE)
    for point, scales in enumerate(candidates):
        set_weights(scales)
        for sample in range(first):
            partial[point] = partial[point] + squared(sample)
    finite = [p if p == p else float("inf") for p in partial]
    order = [0] + sorted(range(1, len(candidates)), key=lambda point: (finite[point], point))[:RACE_FINALISTS]
    errors: list = [None] * len(candidates)
    best: tuple | None = None  # (error, point) of the best full sum so far

    def beaten(point: int) -> bool:
        if best is None or point == 0:  # point 0's error (s = 1) is reported: summed in full
            return False
        error = partial[point] / count
        return error > best[0] or (error == best[0] and point > best[1])

    for point in order:
        if beaten(point):
            continue
        set_weights(candidates[point])
        sample = first
        while sample < len(inputs) and not beaten(point):
            partial[point] = partial[point] + squared(sample)
            sample += 1
        if sample < len(inputs):
            continue
        error = partial[point] / count
        errors[point] = error
        error = error if error == error else float("inf")
        if best is None or error < best[0] or (error == best[0] and point < best[1]):
            best = (error, point)
    return errors
