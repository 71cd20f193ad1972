"""One decoder layer's calibration pass, each Linear quantized on the inputs the Linears quantized
before it give it ("true sequential" GPTQ: q/k/v, then o, then gate/up, then down), with the
layer run once per sample.

Each sample's pass through the layer runs in a greenlet of its own, suspended before every
Linear not yet quantized. When every pass waits or is done, the first Linear in the layer's
order at which some wait has all the inputs it will get: `quantize(name, inputs)` sets its
weight to its quantized values, and the passes waiting there go on, one at a time in sample
order, to their next Linear. A mixture-of-experts expert waits only for the passes whose tokens
the router sends it; an expert no pass reaches is never quantized here (the caller rounds it).

The passes run one at a time on the calling thread: deterministic, and torch's thread pool and
grad mode are the caller's. What it costs is memory: while a Linear waits, every pass holds the
layer's intermediate tensors up to it (at a LLaMA down_proj, the MLP's [seq, intermediate]
product, its input and the residual: about 4.7 times the hidden states).

`order` finds beforehand, on a float pass of a few samples, the order in which the layer calls
its Linears, each at most once, as this needs: a Linear called again after it is quantized
would have had inputs its Hessian never saw. A pass that finds one anyway raises `OutOfOrder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from qtool.errors import InternalError, UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["OutOfOrder", "forward", "order", "run"]


class OutOfOrder(InternalError):
    """A Linear called after it was quantized, which `order` did not foresee."""


def forward(layer, sample: "torch.Tensor", kwargs: dict[str, Any]) -> "torch.Tensor":
    """The layer's output for one sample [1, seq, hidden], [seq, hidden]."""
    result = layer(sample, **kwargs)
    return (result[0] if isinstance(result, tuple) else result)[0]


def order(layer, hidden: "torch.Tensor", kwargs: dict[str, Any], linears: dict[str, Any], out: "torch.Tensor") -> list[str] | None:
    """The float layer over `hidden`'s samples into `out`, and the order `run` can take the
    Linears of `linears` in: their modules' order where each sample called them, each at most
    once, in it (an MoE expert is called by some samples only); else the one order in which
    every sample called every one of them once (Phi-3 registers o_proj before qkv_proj); None
    where neither holds."""
    import torch

    names = list(linears)
    rank = {id(module): position for position, module in enumerate(linears.values())}
    calls: list[int] = []
    sequences = []
    hooks = [module.register_forward_pre_hook(lambda module, args: calls.append(rank[id(module)])) for module in linears.values()]
    try:
        with torch.no_grad():
            for index in range(hidden.shape[0]):
                calls.clear()
                out[index] = forward(layer, hidden[index : index + 1], kwargs)
                sequences.append(tuple(calls))
    finally:
        for hook in hooks:
            hook.remove()
    if all(a < b for sequence in sequences for a, b in zip(sequence, sequence[1:])):
        return names
    first = sequences[0]
    if sorted(first) == list(range(len(names))) and all(sequence == first for sequence in sequences):
        return [names[position] for position in first]
    return None


def run(layer, hidden: "torch.Tensor", kwargs: dict[str, Any], linears: dict[str, Any], quantize: Callable[[str, list["torch.Tensor"]], None]) -> list[str]:
    """Every sample of `hidden` [samples, seq, hidden] through `layer`, each Linear of
    `linears` (name: module, in the layer's order) quantized by `quantize(name, the inputs of
    the passes that reached it, in sample order)` once no pass can still reach it; each
    sample's output written over its input in `hidden`. The names quantized, in order."""
    import torch

    try:
        from greenlet import getcurrent, greenlet
    except ImportError:
        raise UsageError("GPTQ calibration needs the greenlet package, which is not installed", hint="pip install 'qtool[calibrate]'", option="calibrate") from None
    names = list(linears)
    rank = {id(module): position for position, module in enumerate(linears.values())}
    quantized: set[int] = set()
    scheduler = getcurrent()

    def wait(module, args):
        position = rank[id(module)]
        if position in quantized:
            raise OutOfOrder(f"the layer called {names[position]} again after it was quantized")
        scheduler.switch((position, args[0]))

    def one(index: int) -> None:
        hidden[index] = forward(layer, hidden[index : index + 1], kwargs)

    passes = [greenlet(lambda index=index: one(index), parent=scheduler) for index in range(hidden.shape[0])]
    waiting: dict[int, list[tuple[int, "torch.Tensor"]]] = {}  # Linear's position: (sample, its input)

    def advance(index: int) -> None:
        state = passes[index].switch()
        if state is not None:  # suspended before a Linear; None: the pass is done
            waiting.setdefault(state[0], []).append((index, state[1]))

    done = []
    hooks = [module.register_forward_pre_hook(wait) for module in linears.values()]
    try:
        with torch.no_grad():
            for index in range(len(passes)):
                advance(index)
            while waiting:
                position = min(waiting)
                arrived = sorted(waiting.pop(position), key=lambda entry: entry[0])
                quantize(names[position], [x for _, x in arrived])
                quantized.add(position)
                done.append(names[position])
                resumed = [index for index, _ in arrived]
                del arrived  # the inputs: each pass's own from here on
                for index in resumed:
                    advance(index)
    finally:
        for hook in hooks:
            hook.remove()
        for g in passes:  # after an error: unwind the passes still suspended
            if not g.dead:
                g.throw()
    return done
