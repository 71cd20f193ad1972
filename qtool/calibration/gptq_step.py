"""GPTQ's layer step (`qtool.calibration.layers.LayerStep`): each calibrated Linear of a decoder
layer quantized by `qtool.calibration.gptq` on the Hessian X^T X of its inputs, the quantized
layer's outputs the next layer's inputs.

By default as llm-compressor does (`_gptq_layer_in_two_passes`): the Hessians over the float
layer's run, GPTQ per Linear, then the quantized layer's run (the float outputs kept for the
error, over every sample). With `true_sequential` each Linear on the inputs the layer gives it
with the Linears before it already quantized (`qtool.calibration.true_sequential`), in one run
of the layer, the error on the first samples (`layers.ERROR_SHARE`), which a float run of
those samples gives first; that run also finds the order the layer calls its Linears in, and a
layer that has none (a Linear called twice) is done in two passes.

Linears called one after another on the same input tensor (q/k/v on the normed hidden states,
gate/up) share one Hessian and GPTQ's factor of it (`gptq.factor`; in true sequential, the
`Order`'s followers). There the Gram of an input as large as a sample's hidden states or larger
is taken as each pass arrives, and the input waits in the step's `spill.Parking`. A weight no
token reached (an MoE expert the router never chose) is rounded to nearest: GPTQ would zero
every column of a weight whose inputs it never saw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from qtool.libc import trim_heap

if TYPE_CHECKING:
    import torch

    from qtool.calibration.codes import Calibration
    from qtool.calibration.layers import CaughtLayer, LayerMade
    from qtool.scheme import QScheme
    from qtool.weight import Weight

__all__ = ["GptqStep"]


class GptqStep:
    """GPTQ of the weights of `schemes`, one layer at a time, into `result`."""

    def __init__(
        self,
        schemes: dict[str, QScheme],
        by_name: dict[str, Weight],
        result: Calibration,
        *,
        dampening: float,
        block: int,
        actorder: str | None,
        true_sequential: bool,
        on_statistics: Callable[[int, str, torch.Tensor], None] | None = None,
    ) -> None:
        from qtool.calibration.spill import Parking

        self.schemes, self.by_name, self.result = schemes, by_name, result
        self.dampening, self.block, self.actorder, self.true_sequential = dampening, block, actorder, true_sequential
        self.on_statistics = on_statistics
        self.parking = (
            Parking() if true_sequential else None
        )  # where true sequential's waiting passes park what they hold

    def layer(self, caught: CaughtLayer) -> LayerMade:
        from qtool.calibration.layers import LayerKwargs, LayerMade

        linears = {name: module for name, module in caught.linears.items() if name in self.schemes}
        layer, hidden = caught.module, caught.hidden
        own = caught.kwargs.for_layer(layer) if isinstance(caught.kwargs, LayerKwargs) else caught.kwargs
        if self.true_sequential:
            unrouted, error = _gptq_layer_in_one_run(caught.index, layer, linears, hidden, own, self)
        else:
            unrouted, error = _gptq_layer_in_two_passes(caught.index, layer, linears, hidden, own, self)
        return LayerMade(hidden, sorted(linears), error, unrouted)

    def close(self) -> None:
        if self.parking is not None:
            self.parking.close()

    def quantize(self, name: str, module, hessian: torch.Tensor, prepared) -> None:
        """GPTQ of one weight on `hessian` (or its `prepared` factor), stored."""
        from qtool.calibration.codes import rounding, store
        from qtool.calibration.gptq import gptq

        dtype = self.by_name[name].dtype
        codes = gptq(
            module.weight.data, hessian, **rounding(self.schemes[name], dtype),
            dampening=self.dampening, block=self.block, actorder=self.actorder, prepared=prepared,
        )  # fmt: skip
        store(name, module, codes, self.schemes[name], dtype, self.result)

    def round(self, name: str, module) -> None:
        """One weight rounded to nearest (no input reached it), stored."""
        from qtool.calibration.codes import round_to_nearest

        round_to_nearest(name, module, self.schemes[name], self.by_name[name].dtype, self.result)

    def factor(self, hessian: torch.Tensor, dtype: torch.dtype):
        from qtool.calibration.gptq import factor

        return factor(hessian, dtype=dtype, dampening=self.dampening, actorder=self.actorder)


def _gptq_layer_in_one_run(
    index: int, layer, linears: dict[str, Any], hidden: torch.Tensor, kwargs: dict[str, Any], step: GptqStep
) -> tuple[list[str], float]:
    """True sequential GPTQ of the layer: the names no token reached and the output error on
    the first samples; the quantized layer's outputs written over `hidden`."""
    import torch

    from qtool.calibration import true_sequential
    from qtool.calibration.gram import hessian as gram_hessian
    from qtool.calibration.gram import upper_gram
    from qtool.calibration.layers import ERROR_SHARE, relative_error

    measured = -(-hidden.shape[0] // ERROR_SHARE)
    reference = torch.empty_like(hidden[:measured])
    found = true_sequential.order(layer, hidden[:measured], kwargs, linears, reference)
    if found is None:
        return _gptq_layer_in_two_passes(index, layer, linears, hidden, kwargs, step)
    sums: dict[str, torch.Tensor] = {}  # Linear: the upper blocks of the Grams taken as passes arrived
    sample_size = hidden[0].numel()

    def take(name: str, x: torch.Tensor) -> bool:
        """An input as large as a sample's hidden states or larger (a dense layer's, each
        Linear's): its Gram now, so the input waits on disk; a smaller one's (an expert's
        few routed tokens, whose Gram can outweigh them) at quantize time."""
        if x.numel() < sample_size:
            return False
        flat = x.reshape(-1, x.shape[-1]).float()
        if name not in sums:
            sums[name] = torch.zeros((flat.shape[1], flat.shape[1]), dtype=torch.float32, device=flat.device)
        upper_gram(flat, sums[name], add=True)
        return True

    def quantize(group: list[str], inputs: list[torch.Tensor]) -> None:
        trim_heap()  # the passes' freed temporaries, not resident beside every pass's kept tensors
        hessian = gram_hessian(inputs, sums.pop(group[0], None))
        prepared = None
        for name in group:
            if step.on_statistics is not None:
                step.on_statistics(index, name, hessian)
            if not hessian.any():
                step.round(name, linears[name])
                continue
            if prepared is None:
                prepared = step.factor(hessian, linears[name].weight.dtype)
            step.quantize(name, linears[name], hessian, prepared)

    parking = step.parking
    if parking is not None:
        parking.reset()
    chosen = {name: linears[name] for name in found.names}
    done = true_sequential.run(
        layer, hidden, kwargs, chosen, quantize, followers=found.followers, take=take, parking=parking
    )
    unrouted = [name for name in linears if name not in done]
    for name in unrouted:
        step.round(name, linears[name])
    return unrouted, relative_error(hidden[:measured], reference)


def _gptq_layer_in_two_passes(
    index: int, layer, linears: dict[str, Any], hidden: torch.Tensor, kwargs: dict[str, Any], step: GptqStep
) -> tuple[list[str], float]:
    """GPTQ of the layer as llm-compressor does it: Hessians X^T X of each Linear's inputs over
    the float layer's run, GPTQ per Linear, then the quantized layer's run for the next layer's
    inputs, written over `hidden` (the float outputs kept for the error, over every sample)."""
    import torch

    from qtool.calibration.gram import mirror, upper_gram
    from qtool.calibration.layers import relative_error, run

    device = hidden.device
    hessians = {
        name: torch.zeros((m.weight.shape[1], m.weight.shape[1]), dtype=torch.float32, device=device)
        for name, m in linears.items()
    }
    grams: dict[int, torch.Tensor] = {}  # by width: the upper block triangle of one sample's X^T X
    last: list = [None, None]  # the input tensor the last hook saw, and its X^T X
    hooks = []
    for name, module in linears.items():

        def accumulate(module, args, name=name):
            if args[0] is not last[0]:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                gram = grams.get(x.shape[1])
                if gram is None:
                    gram = grams[x.shape[1]] = torch.zeros((x.shape[1], x.shape[1]), dtype=torch.float32, device=device)
                last[0], last[1] = args[0], upper_gram(x, gram)
            hessians[name].add_(last[1])

        hooks.append(module.register_forward_pre_hook(accumulate))
    outputs = torch.empty_like(hidden)
    try:
        run(layer, hidden, kwargs, outputs)  # float outputs, and the statistics
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
        mirror(hessian)
        if step.on_statistics is not None:
            step.on_statistics(index, name, hessian)
        if not hessian.any():
            unrouted.append(name)
            step.round(name, module)
            continue
        if shared is None or shared[0].shape != hessian.shape or not torch.equal(shared[0], hessian):
            shared = (hessian, step.factor(hessian, module.weight.dtype))
        step.quantize(name, module, hessian, shared[1])
    run(layer, hidden, kwargs, hidden)  # the quantized layer's outputs feed the next
    return unrouted, relative_error(hidden, outputs)
