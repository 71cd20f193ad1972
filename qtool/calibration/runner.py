"""The sequential calibration runner: one decoder layer in memory, the activations of the
calibration samples carried from layer to layer (DESIGN.md, "Calibration").

    tokens [samples, seq_len]
      --embeddings (the base model's own forward, stopped at the first layer)--> hidden [samples, seq_len, hidden]
      --for each layer: read its weights (qtool's readers)
        -> run it, its statistics caught by hooks (GPTQ: H = X^T X in float32 per Linear)
        -> GPTQ per Linear (AWQ: scales searched and folded, then round to nearest), each
           weight set to its dequantized codes -> run it again
        (GPTQ with `true_sequential`: one run, each Linear quantized when every sample's pass
         waits before it, on the inputs the quantized Linears before it gave)
        -> the QUANTIZED layer's outputs feed the next layer -> back to meta
        (AWQ: the FLOAT layer's outputs, as AutoAWQ and llm-compressor feed it: the smoothing
         keeps the float function, the scales of each layer are searched against the float
         model's activations, and the quantized layer runs on one sample in 16 only, for its
         error; SmolLM2-135M int4 g64 at 32 samples: perplexity 14.12 against 14.41 when fed
         the quantized outputs)

The layer keyword arguments (causal mask, rotary position embeddings, positions) are the ones
the base model's own forward passes each layer, caught there by stand-ins, so each
architecture's conventions (Gemma's scaled embeddings, sliding windows alternating with global
attention) are transformers' own. Peak memory: one layer, the activations twice (inputs, float
outputs; true sequential: once, and every sample's tensors inside the layer while a Linear
waits, less the inputs parked on disk), the layer's Hessians, and the packed codes of the
layers done so far (spilled to disk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from qtool.errors import SchemeError, UsageError
from qtool.libc import trim_heap

if TYPE_CHECKING:
    import torch

    from qtool.formats.checkpoint import Checkpoint
    from qtool.scheme import QScheme
    from qtool.weight import Weight

__all__ = ["ALGORITHMS", "RunnerOptions", "LayerResult", "Calibration", "LayerKwargs", "calibrate", "check_scheme"]

ALGORITHMS = ("gptq", "awq", "rtn")


@dataclass(frozen=True)
class RunnerOptions:
    algorithm: str = "gptq"
    device: str = "cpu"
    dampening: float = 0.01
    block: int = 128
    actorder: str | None = None  # GPTQ's column order ("weight" / "static"), or None
    true_sequential: bool = False  # GPTQ: each Linear on its quantized predecessors' outputs, one run a layer


@dataclass
class LayerResult:
    index: int
    seconds: float
    output_error: float  # sum (y_quantized - y_float)^2 / sum y_float^2 over the calibration samples
    weights: list[str]
    unrouted: list[str] = field(default_factory=list)  # experts no calibration token reached: rounded to nearest

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.index, "seconds": round(self.seconds, 3), "output_rel_mse": self.output_error,
            "weights": list(self.weights), "unrouted": list(self.unrouted),
        }  # fmt: skip


@dataclass
class Calibration:
    """What calibration produced: each calibrated weight's layout tensors, and per layer its
    time and output error."""

    algorithm: str
    samples: int
    seq_len: int
    seed: int
    encoded: dict[str, dict[str, Any]] = field(default_factory=dict)
    # float tensors the calibration changed but does not quantize (AWQ's smoothed norms), float32 on the CPU
    replaced: dict[str, "torch.Tensor"] = field(default_factory=dict)
    layers: list[LayerResult] = field(default_factory=list)
    seconds: float = 0.0
    spill: Any = None  # qtool.calibration.spill.Spill: where `encoded`'s tensors wait, on disk; None: in memory

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
    """GPTQ and AWQ here write int2..int8 per channel or per group."""
    if scheme.qtype.kind != "int" or not 2 <= scheme.qtype.bits <= 8 or scheme.granularity not in ("channel", "group"):
        raise SchemeError(f"GPTQ and AWQ calibrate int2..int8 per channel or per group, not {scheme.label} ({name})", hint="use e.g. W4A16, int4:g64:asym or int8:channel")


class _Stop(Exception):
    """Raised by the stand-in for the last layer once every layer has its arguments."""


class LayerKwargs(dict):
    """The keyword arguments the base model passes its first layer (the dict itself), and each
    layer's own (`for_layer`): Gemma 2/3 alternate sliding-window and global attention, with a
    different mask (and Gemma 3 a different rotary embedding) per layer type. `_run` picks the
    layer's own, so a caller that hands the same object to every layer gets the right ones."""

    def __init__(self, first: dict[str, Any], by_layer: dict[int, dict[str, Any]]) -> None:
        super().__init__(first)
        self.by_layer = by_layer  # id(layer module) -> its kwargs

    def for_layer(self, layer) -> dict[str, Any]:
        return self.by_layer.get(id(layer), self)


_DROPPED = ("cache", "past_key_values", "past_key_value", "use_cache")


class _Catcher:
    """Stand-ins for every layer: each records the arguments it is called with and passes the
    hidden states through; the last stops the forward."""

    def __init__(self, count: int) -> None:
        self.hidden: "torch.Tensor | None" = None
        self.kwargs: list[dict[str, Any] | None] = [None] * count

    def module(self, index: int):
        import torch

        catcher = self
        last = len(self.kwargs) - 1

        class LayerInputs(torch.nn.Module):
            def forward(self, hidden_states, *args, **kwargs):
                if args:
                    raise UsageError("the architecture's layers take positional arguments besides the hidden states; qtool cannot calibrate it", option="calibrate")
                if index == 0:
                    catcher.hidden = hidden_states
                catcher.kwargs[index] = {key: value for key, value in kwargs.items() if key not in _DROPPED}
                if index == last:
                    raise _Stop
                return hidden_states

        return LayerInputs()


def _embed(skeleton, tokens: "torch.Tensor", weights, checkpoint, device: str):
    """[samples, seq_len, hidden] float32 hidden states and the layers' kwargs (`LayerKwargs`:
    the first layer's, each layer's by `for_layer`), from the base model's forward with every
    part but the layers materialized."""
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
        restore = skeleton.materialize_rows(embedding[1], f"{skeleton.base_prefix}.{embedding[0]}" if skeleton.base_prefix else embedding[0], rows, weights, checkpoint, device)
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
                    raise UsageError(f"the {skeleton.config.model_type} model's forward never reached its first layer", option="calibrate")
                if hidden is None:
                    hidden = torch.empty((tokens.shape[0], *catcher.hidden.shape[1:]), dtype=torch.float32, device=device)
                hidden[index] = catcher.hidden[0].float()
    finally:
        if embedding is not None:
            restore()
        for index, layer in enumerate(originals):
            skeleton.layers[index] = layer
        for name, child in skeleton.base.named_children():
            if name != layers_name:
                skeleton.release(child)
    if any(kwargs is None for kwargs in catcher.kwargs):
        raise UsageError(f"the {skeleton.config.model_type} model's forward does not call each of its layers once in order; qtool cannot calibrate it", option="calibrate")
    by_layer = {id(layer): kwargs for layer, kwargs in zip(originals, catcher.kwargs)}
    return hidden, LayerKwargs(catcher.kwargs[0], by_layer)


def _run(layer, hidden: "torch.Tensor", kwargs: dict[str, Any], out: "torch.Tensor") -> None:
    """The layer over each sample; with `LayerKwargs`, the layer's own arguments."""
    import torch

    from qtool.calibration.true_sequential import forward

    if isinstance(kwargs, LayerKwargs):
        kwargs = kwargs.for_layer(layer)
    with torch.no_grad():
        for index in range(hidden.shape[0]):
            out[index] = forward(layer, hidden[index : index + 1], kwargs)


def _scale_dtype(scheme: "QScheme", dtype: str):
    from qtool.dtypes import storage_dtype
    from qtool.layouts.compressed_tensors import scale_storage

    return storage_dtype(scale_storage(scheme, dtype)).torch_dtype()


def _store(name: str, module, codes, scheme: "QScheme", dtype: str, result: Calibration) -> None:
    """The codes into the layer (the next layer sees the quantized outputs) and the layout's tensors."""
    from qtool.layouts.compressed_tensors import pack_int_codes

    module.weight.data = codes.dequantized().to(module.weight.device)
    packed = pack_int_codes(name, codes.codes, codes.scale, codes.zero_point, scheme, dtype)
    if result.spill is not None:
        try:
            result.encoded[name] = result.spill.store(packed)
            return
        except OSError:  # the temporary directory full: the codes from here on stay in memory
            result.spill = None
    result.encoded[name] = {k: v.cpu() for k, v in packed.items()}


ERROR_SHARE = 16  # true sequential GPTQ and AWQ measure a layer's output error on one calibration sample in 16 (at least one)


def _gptq_layer(index, layer, linears, schemes, by_name, hidden, kwargs, result: Calibration, options: RunnerOptions, on_statistics, parking=None) -> tuple[list[str], float]:
    """GPTQ for each Linear of the layer, the quantized layer's outputs over `hidden`; the names
    no token reached (an MoE expert the router never chose), which are rounded to nearest:
    GPTQ would zero every column of a weight whose inputs it never saw; and the layer's output
    error against the float layer's.

    By default as llm-compressor does (`_gptq_layer_in_two_passes`). With
    `options.true_sequential` each Linear on the inputs the layer gives it with the Linears
    before it already quantized (`true_sequential`), in one run of the layer, the error on the
    first samples (`ERROR_SHARE`), which a float run of those samples gives first; that run
    also finds the order the layer calls its Linears in, and a layer that has none (a Linear
    called twice) is done in two passes.

    Linears called one after another on the same input tensor (q/k/v on the normed hidden
    states, gate/up) share one Hessian and GPTQ's factor of it (`gptq.factor`; in true
    sequential, the `Order`'s followers). There the Gram of an input as large as a sample's
    hidden states or larger is taken as each pass arrives, and the input waits in `parking`
    (a `spill.Parking`; None: in memory)."""
    import torch

    from qtool.calibration import true_sequential
    from qtool.calibration.gptq import factor

    own = kwargs.for_layer(layer) if isinstance(kwargs, LayerKwargs) else kwargs
    if not options.true_sequential:
        return _gptq_layer_in_two_passes(index, layer, linears, schemes, by_name, hidden, own, result, options, on_statistics)
    measured = -(-hidden.shape[0] // ERROR_SHARE)
    reference = torch.empty_like(hidden[:measured])
    found = true_sequential.order(layer, hidden[:measured], own, linears, reference)
    if found is None:
        return _gptq_layer_in_two_passes(index, layer, linears, schemes, by_name, hidden, own, result, options, on_statistics)
    sums: dict[str, "torch.Tensor"] = {}  # Linear: the upper blocks of the Grams taken as passes arrived
    sample_size = hidden[0].numel()

    def take(name: str, x: "torch.Tensor") -> bool:
        """An input as large as a sample's hidden states or larger (a dense layer's, each
        Linear's): its Gram now, so the input waits on disk; a smaller one's (an expert's
        few routed tokens, whose Gram can outweigh them) at quantize time."""
        if x.numel() < sample_size:
            return False
        flat = x.reshape(-1, x.shape[-1]).float()
        if name not in sums:
            sums[name] = torch.zeros((flat.shape[1], flat.shape[1]), dtype=torch.float32, device=flat.device)
        _upper_gram(flat, sums[name], add=True)
        return True

    def quantize(group: list[str], inputs: list["torch.Tensor"]) -> None:
        trim_heap()  # the passes' freed temporaries, not resident beside every pass's kept tensors
        hessian = _hessian(inputs, sums.pop(group[0], None))
        prepared = None
        for name in group:
            if on_statistics is not None:
                on_statistics(index, name, hessian)
            if not hessian.any():
                _round_to_nearest(name, linears[name], schemes[name], by_name[name].dtype, result)
                continue
            if prepared is None:
                prepared = factor(hessian, dtype=linears[name].weight.dtype, dampening=options.dampening, actorder=options.actorder)
            _gptq_one(name, linears[name], hessian, prepared, schemes[name], by_name[name].dtype, result, options)

    if parking is not None:
        parking.reset()
    chosen = {name: linears[name] for name in found.names}
    done = true_sequential.run(layer, hidden, own, chosen, quantize, followers=found.followers, take=take, parking=parking)
    unrouted = [name for name in linears if name not in done]
    for name in unrouted:
        _round_to_nearest(name, linears[name], schemes[name], by_name[name].dtype, result)
    return unrouted, _relative_error(hidden[:measured], reference)


def _hessian(inputs: list["torch.Tensor"], taken: "torch.Tensor | None" = None) -> "torch.Tensor":
    """X^T X in float32 of the inputs' rows, summed in their order (after `taken`'s, the upper
    blocks of a sum begun before), made symmetric."""
    import torch

    total = taken
    for x in inputs:
        width = x.shape[-1]
        if total is None:
            total = torch.zeros((width, width), dtype=torch.float32, device=x.device)
        _upper_gram(x.reshape(-1, width).float(), total, add=True)
    _mirror(total)
    return total


def _gptq_one(name: str, module, hessian, prepared, scheme: "QScheme", dtype: str, result: Calibration, options: RunnerOptions) -> None:
    from qtool.calibration.gptq import gptq

    codes = gptq(
        module.weight.data, hessian, **_rounding(scheme, dtype),
        dampening=options.dampening, block=options.block, actorder=options.actorder, prepared=prepared,
    )  # fmt: skip
    _store(name, module, codes, scheme, dtype, result)


def _round_to_nearest(name: str, module, scheme: "QScheme", dtype: str, result: Calibration) -> None:
    from qtool.calibration import awq

    _store(name, module, awq.rtn(module.weight.data, **_rounding(scheme, dtype)), scheme, dtype, result)


def _error_on_a_share(layer, hidden: "torch.Tensor", kwargs, reference: "torch.Tensor") -> float:
    """The quantized layer's output error against `reference` (the float layer's outputs) on
    the first samples (`ERROR_SHARE`)."""
    import torch

    measured = -(-hidden.shape[0] // ERROR_SHARE)
    quantized = torch.empty_like(hidden[:measured])
    _run(layer, hidden[:measured], kwargs, quantized)
    return _relative_error(quantized, reference[:measured])


def _relative_error(quantized: "torch.Tensor", reference: "torch.Tensor") -> float:
    """sum (quantized - reference)^2 / sum reference^2 over the samples [samples, ...], in
    float64 one sample at a time."""
    error = total = 0.0
    for q, r in zip(quantized, reference):
        error += float((q.double() - r.double()).pow(2).sum())
        total += float(r.double().pow(2).sum())
    return error / total if total else 0.0


def _gptq_layer_in_two_passes(index, layer, linears, schemes, by_name, hidden, kwargs, result: Calibration, options: RunnerOptions, on_statistics) -> tuple[list[str], float]:
    """`_gptq_layer` as llm-compressor does it: Hessians X^T X of each Linear's inputs over the
    float layer's run, GPTQ per Linear, then the quantized layer's run for the next layer's
    inputs (the float outputs kept for the error, over every sample)."""
    import torch

    from qtool.calibration.gptq import factor

    device = hidden.device
    hessians = {name: torch.zeros((m.weight.shape[1], m.weight.shape[1]), dtype=torch.float32, device=device) for name, m in linears.items()}
    grams: dict[int, "torch.Tensor"] = {}  # by width: the upper block triangle of one sample's X^T X
    last: list = [None, None]  # the input tensor the last hook saw, and its X^T X
    hooks = []
    for name, module in linears.items():

        def accumulate(module, args, name=name):
            if args[0] is not last[0]:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                gram = grams.get(x.shape[1])
                if gram is None:
                    gram = grams[x.shape[1]] = torch.zeros((x.shape[1], x.shape[1]), dtype=torch.float32, device=device)
                last[0], last[1] = args[0], _upper_gram(x, gram)
            hessians[name].add_(last[1])

        hooks.append(module.register_forward_pre_hook(accumulate))
    outputs = torch.empty_like(hidden)
    try:
        _run(layer, hidden, kwargs, outputs)  # float outputs, and the statistics
    finally:
        for hook in hooks:
            hook.remove()
        last.clear()
        grams.clear()
    trim_heap()  # the forward's temporaries (attention scores), before the factors' matrices
    shared: tuple | None = None  # (Hessian, its factor): the last one factored
    unrouted = []
    for name, module in linears.items():
        hessian = hessians.pop(name)
        _mirror(hessian)
        if on_statistics is not None:
            on_statistics(index, name, hessian)
        if not hessian.any():
            unrouted.append(name)
            _round_to_nearest(name, module, schemes[name], by_name[name].dtype, result)
            continue
        if shared is None or shared[0].shape != hessian.shape or not torch.equal(shared[0], hessian):
            shared = (hessian, factor(hessian, dtype=module.weight.dtype, dampening=options.dampening, actorder=options.actorder))
        _gptq_one(name, module, hessian, shared[1], schemes[name], by_name[name].dtype, result, options)
    _run(layer, hidden, kwargs, hidden)  # the quantized layer's outputs feed the next
    return unrouted, _relative_error(hidden, outputs)


GRAM_STEP = 192  # columns per block of X^T X: small enough to skip most of the lower half, large enough for a fast matmul
NARROW_GRAM_STEP = 64  # ... and for inputs this narrow or narrower: 0.92x the time of 192 at 576 columns, one thread (BENCHMARKS.md)
NARROW = 768  # columns: at 576 the step of 64 wins, at 1536 192 does


def _upper_gram(x: "torch.Tensor", out: "torch.Tensor", *, add: bool = False) -> "torch.Tensor":
    """X^T X's blocks on and above the diagonal (of `GRAM_STEP` columns) into `out` [in, in]
    (`add`: added to it), each block's matmul written in place; the blocks below stay as they
    are (zeros): X^T X is symmetric, so they are never computed (at 1536 columns, 36 of 64
    blocks) and `_mirror` fills them at the end."""
    width = x.shape[1]
    step = NARROW_GRAM_STEP if width <= NARROW else GRAM_STEP
    for start in range(0, width, step):
        out[start : start + step, start:].addmm_(x[:, start : start + step].T, x[:, start:], beta=1 if add else 0)
    return out


MIRROR_STEP = 64  # columns per band: a band's transpose stays in cache


def _mirror(total: "torch.Tensor") -> None:
    """A sum of `_upper_gram`s made symmetric: its upper triangle mirrored below the diagonal, a
    band of `MIRROR_STEP` columns at a time (one whole transpose at 1536 columns: 21 -> 1.5 ms)."""
    import torch

    width = total.shape[0]
    for start in range(0, width, MIRROR_STEP):
        end = min(start + MIRROR_STEP, width)
        block = total[start:end, start:end]
        block.copy_(torch.triu(block) + torch.triu(block, diagonal=1).T)
        total[end:, start:end].copy_(total[start:end, end:].T)


def _group(scheme: "QScheme") -> int | None:
    return scheme.group_size if scheme.granularity == "group" else None


def _rounding(scheme: "QScheme", dtype: str) -> dict[str, Any]:
    """What GPTQ and round to nearest take of `scheme` (a weight of `dtype`): the integer
    width, the group, symmetry, the stored scale dtype and the observer that chooses the scales."""
    return {
        "bits": scheme.qtype.bits, "group_size": _group(scheme), "symmetric": scheme.symmetric,
        "scale_dtype": _scale_dtype(scheme, dtype), "observer": scheme.observer,
    }  # fmt: skip


def _awq_layer(skeleton, layer, prefix: str, linears, schemes, by_name, hidden, kwargs, outputs, result: Calibration, *, smooth: bool = True) -> None:
    """AWQ (qtool.calibration.awq): over the float layer's run, the mean |x| of each mapping's
    inputs and its parent's inputs are kept; each mapping's scales are searched and folded in
    turn (the float function unchanged, so the kept inputs stay valid); then every Linear is
    clipped (`awq.clip`, on X^T X of its inputs, the smoothing's 1 / s applied to it; not the
    queries and keys) and rounded to nearest. The smoothed tensors that are not quantized
    (norms, an unquantized smooth Linear's weight and bias) go to `result.replaced`. `smooth` False: round to nearest
    only (the runner's "rtn", AWQ's baseline)."""
    import functools

    import torch

    from qtool.calibration import awq

    def full(relative: str) -> str:
        return f"{prefix}.{relative}.weight"

    mappings = awq.layer_mappings(layer, skeleton.config.model_type, lambda relative: full(relative) in linears) if smooth else []
    modules = dict(layer.named_modules())
    relative_of = {id(module): relative for relative, module in modules.items()}
    sums = {m.smooth: [None, 0] for m in mappings}
    # X^T X of a Linear's inputs, by the Linear that sees them first: for a parent that is its one
    # balance Linear (awq.search's `gram`), and for each Linear the clipping search takes
    # (awq.clip); the balance Linears of one mapping read one input, so share one
    lone = {m.parent for m in mappings if m.balance == (m.parent,)}
    to_clip = {relative_of[id(module)] for module in linears.values() if awq.clipped(relative_of[id(module)])} if smooth else set()
    shared = {name: mapping.balance[0] for mapping in mappings for name in mapping.balance}
    gram_of = {name: shared.get(name, name) for name in to_clip | lone}
    inputs: dict[str, list] = {m.parent: [] for m in mappings if m.parent not in lone}
    grams: dict[str, list] = {source: [None, 0] for source in gram_of.values()}
    input_scales: dict[str, "torch.Tensor"] = {}  # each smoothed balance Linear's s: its inputs are now x / s
    hooks = []

    def statistics(module, args, smooth):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        total = x.abs().sum(dim=0)
        sums[smooth][0] = total if sums[smooth][0] is None else sums[smooth][0] + total
        sums[smooth][1] += x.shape[0]

    def keep(module, args, kw, parent):
        inputs[parent].append((args, kw))

    def keep_output(module, args, kw, output, parent):
        references[parent].append(output[0] if isinstance(output, tuple) else output)

    def gram(module, args, source):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        entry = grams[source]
        if entry[0] is None:
            entry[0] = torch.zeros((x.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
        _upper_gram(x, entry[0], add=True)
        entry[1] += x.shape[0]

    for mapping in mappings:
        hooks.append(modules[mapping.balance[0]].register_forward_pre_hook(functools.partial(statistics, smooth=mapping.smooth)))
    # the parents' float outputs: each mapping's search runs before any fold touches its parent
    # (the mappings' parents come in the layer's order, each folding only into its own
    # balance Linears and the module before them), so these are the outputs its search would
    # compute first
    references: dict[str, list] = {parent: [] for parent in inputs}
    for parent in inputs:
        hooks.append(modules[parent].register_forward_pre_hook(functools.partial(keep, parent=parent), with_kwargs=True))
        hooks.append(modules[parent].register_forward_hook(functools.partial(keep_output, parent=parent), with_kwargs=True))
    for source in grams:
        hooks.append(modules[source].register_forward_pre_hook(functools.partial(gram, source=source)))
    try:
        _run(layer, hidden, kwargs, outputs)  # float outputs, and the statistics
    finally:
        for hook in hooks:
            hook.remove()
    trim_heap()
    for entry in grams.values():
        if entry[0] is not None:
            _mirror(entry[0])
    changed: set[str] = set()
    for mapping in mappings:
        total, count = sums[mapping.smooth]
        if total is None or not count:
            continue  # no token reached it (an MoE expert)
        balance = [modules[name] for name in mapping.balance]
        quantizers, groups = [], []
        for name, module in zip(mapping.balance, balance):
            scheme = schemes.get(full(name))
            if scheme is None:
                quantizers.append(lambda w: w)
                groups.append(module.in_features)
                continue
            dtype = by_name[full(name)].dtype
            quantizers.append(functools.partial(_rtn_values, **_rounding(scheme, dtype)))
            groups.append(_group(scheme) or module.in_features)
        if mapping.parent in lone:
            hessian, tokens = grams[gram_of[mapping.parent]][:2]
            found = awq.search(modules[mapping.parent], [], balance, quantizers, total / count, groups, gram=(hessian, tokens))
        else:
            found = awq.search(modules[mapping.parent], inputs[mapping.parent], balance, quantizers, total / count, groups, reference=references.pop(mapping.parent, None))
        awq.fold(modules[mapping.smooth], balance, found.scales)
        changed.add(mapping.smooth)
        for name in mapping.balance:
            input_scales[name] = found.scales
    inputs.clear()
    references.clear()
    for relative in changed:
        module = modules[relative]
        for name, param in module.named_parameters(recurse=False):
            full_name = f"{prefix}.{relative}.{name}"
            if full_name not in schemes:
                result.replaced[full_name] = param.data.detach().float().cpu().clone()
    for name, module in linears.items():
        relative = relative_of[id(module)]
        hessian = grams[gram_of[relative]][0] if relative in to_clip else None
        if hessian is not None:
            scales = input_scales.get(relative)
            if scales is not None:  # the smoothed Linear sees x / s
                inverse = 1 / scales.to(hessian.dtype)
                hessian = hessian * inverse.unsqueeze(0) * inverse.unsqueeze(1)
            rounding = _rounding(schemes[name], by_name[name].dtype)
            module.weight.data = awq.clip(module.weight.data, hessian, functools.partial(_rtn_values, **rounding), _group(schemes[name]) or module.in_features)
        _round_to_nearest(name, module, schemes[name], by_name[name].dtype, result)
    grams.clear()


def _spill():
    """A spill file for the codes, or None (kept in memory) where no temporary file can be made."""
    from qtool.calibration.spill import Spill

    try:
        return Spill()
    except OSError:
        return None


def _rtn_values(weight, **rounding):
    from qtool.calibration import awq

    return awq.rtn(weight, **rounding).dequantized(weight.dtype)


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
    on_statistics: Callable[[int, str, "torch.Tensor"], None] | None = None,
) -> Calibration:
    """GPTQ (or AWQ) codes for every weight in `schemes` that is a Linear of a decoder layer,
    encoded in `layout`'s tensors (AWQ's smoothed float tensors in `replaced`).
    `on_layer(result, layers)` after each layer; `on_statistics(layer index, weight name, its
    Hessian)` before GPTQ quantizes each weight (for tests)."""
    import torch

    from qtool.calibration.skeleton import Skeleton
    from qtool.calibration.spill import Parking

    if options.algorithm not in ALGORITHMS:
        raise UsageError(f"algorithm {options.algorithm!r} is not one of {', '.join(ALGORITHMS)}", option="algorithm")
    started = time.perf_counter()
    by_name = {w.name: w for w in weights}
    skeleton = Skeleton.build(checkpoint)
    device = options.device
    for name, scheme in schemes.items():
        check_scheme(name, scheme)
    result = Calibration(options.algorithm, int(tokens.shape[0]), int(tokens.shape[1]), seed, spill=_spill())
    hidden, kwargs = _embed(skeleton, tokens, by_name, checkpoint, device)
    outputs = torch.empty_like(hidden) if options.algorithm in ("awq", "rtn") else None  # the float layer's, for AWQ
    trim_heap()  # the tokenizer's and the embedding step's freed memory
    count = len(skeleton.layers)
    parking = Parking() if options.true_sequential else None  # where true sequential's waiting passes park what they hold
    try:
        for index in range(count):
            layer_started = time.perf_counter()
            prefix = f"{skeleton.layers_prefix}.{index}"
            layer = skeleton.layers[index]
            skeleton.materialize(layer, prefix, by_name, checkpoint, device)
            routers = {block.router for block in skeleton.moe[index] if block.router is not None}
            linears = {
                f"{prefix}.{name}.weight": module
                for name, module in layer.named_modules()
                if (isinstance(module, torch.nn.Linear) or name in routers) and f"{prefix}.{name}.weight" in schemes
            }
            unrouted: list[str] = []
            if outputs is not None:
                _awq_layer(skeleton, layer, prefix, linears, schemes, by_name, hidden, kwargs, outputs, result, smooth=options.algorithm == "awq")
                if options.algorithm == "awq":
                    error = _error_on_a_share(layer, hidden, kwargs, outputs)
                    hidden, outputs = outputs, hidden  # the float layer's outputs feed the next (AWQ as published)
                else:
                    _run(layer, hidden, kwargs, hidden)  # the quantized layer's outputs feed the next
                    error = _relative_error(hidden, outputs)
            else:
                unrouted, error = _gptq_layer(index, layer, linears, schemes, by_name, hidden, kwargs, result, options, on_statistics, parking)
            skeleton.release(layer)
            trim_heap()  # the layer's freed blocks, not resident through the next layer
            layer_result = LayerResult(index, time.perf_counter() - layer_started, error, sorted(linears), unrouted)
            result.layers.append(layer_result)
            if on_layer is not None:
                on_layer(layer_result, count)
    finally:
        if parking is not None:
            parking.close()
    result.seconds = time.perf_counter() - started
    return result
