"""One decoder layer's calibration pass, each Linear quantized on the inputs the Linears quantized
before it give it ("true sequential" GPTQ: q/k/v, then o, then gate/up, then down), with the
layer run once per sample.

Each sample's pass through the layer runs in a greenlet of its own, suspended before every
Linear not yet quantized. When every pass waits or is done, the first Linear in the layer's
order at which some wait has all the inputs it will get: `quantize(names, inputs)` sets its
weight to its quantized values, with those of the Linears that follow it on the same input
(`Order.followers`: k and v after q, up after gate, which need not wait, as their inputs are
there already), and the passes waiting there go on, one at a time in sample order, to their
next Linear. A mixture-of-experts expert waits only for the passes whose tokens the router
sends it; an expert no pass reaches is never quantized here (the caller rounds it).

The passes run one at a time on the calling thread: deterministic, and torch's thread pool and
grad mode are the caller's. What it costs is memory: while a Linear waits, every pass holds the
layer's intermediate tensors up to it. So with a `parking` (`spill.Parking`), each tensor a
suspended pass's frames hold (`_held`: the attention's queries, keys and values at o_proj, the
MLP's input at down_proj) and the input it waits with, once the caller has `take`n what it
needs of it (its Gram), are written to disk and their storages freed while it waits, and read
back just before it goes on; what stays is what torch's frames hold beyond Python's reach (a
temporary on the interpreter's stack). Without followers up_proj's wait would hold gate_proj's
activated [seq, intermediate] output there. SmolLM2-135M, int4 g64, 32 x 512: peak RSS 0.72 GB
without either, 0.61 GB with both (0.42 GB of it torch and transformers themselves).

`order` finds beforehand, on a float pass of a few samples, the order in which the layer calls
its Linears, each at most once, as this needs (a Linear called again after it is quantized
would have had inputs its Hessian never saw), and the followers. A pass that breaks either
anyway raises `OutOfOrder`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from qtool.calibration.layers import forward
from qtool.errors import InternalError, UsageError

if TYPE_CHECKING:
    import torch

    from qtool.calibration.spill import Parking

__all__ = ["Order", "OutOfOrder", "forward", "order", "run"]


class OutOfOrder(InternalError):
    """A Linear called after it was quantized, which `order` did not foresee."""


@dataclass(frozen=True)
class Order:
    """The order `run` takes a layer's Linears in, and the followers: each called, by every
    sample that calls the Linear before it in `names`, right after that one on the same input
    tensor (and by no other sample), so quantized with it on the same Hessian."""

    names: list[str]
    followers: frozenset[str] = frozenset()


def order(
    layer, hidden: torch.Tensor, kwargs: dict[str, Any], linears: dict[str, Any], out: torch.Tensor
) -> Order | None:
    """The float layer over `hidden`'s samples into `out`, and the `Order` `run` can take the
    Linears of `linears` in: their modules' order where each sample called them, each at most
    once, in it (an MoE expert is called by some samples only); else the one order in which
    every sample called every one of them once (Phi-3 registers o_proj before qkv_proj); None
    where neither holds."""
    import torch

    names = list(linears)
    rank = {id(module): position for position, module in enumerate(linears.values())}
    calls: list[tuple[int, Any]] = []
    sequences = []  # per sample: (position, whether its input was the call before's) in call order
    hooks = [
        module.register_forward_pre_hook(lambda module, args: calls.append((rank[id(module)], args[0])))
        for module in linears.values()
    ]
    try:
        with torch.no_grad():
            for index in range(hidden.shape[0]):
                calls.clear()
                out[index] = forward(layer, hidden[index : index + 1], kwargs)
                sequences.append(
                    tuple((position, i > 0 and x is calls[i - 1][1]) for i, (position, x) in enumerate(calls))
                )
                calls.clear()
    finally:
        for hook in hooks:
            hook.remove()
    ranks = [tuple(position for position, _ in sequence) for sequence in sequences]
    if all(a < b for sequence in ranks for a, b in zip(sequence, sequence[1:])):
        found = list(range(len(names)))
    elif sorted(ranks[0]) == list(range(len(names))) and all(sequence == ranks[0] for sequence in ranks):
        found = list(ranks[0])
    else:
        return None
    calls_at = [{position: (i, same) for i, (position, same) in enumerate(sequence)} for sequence in sequences]
    followers = frozenset(names[b] for a, b in zip(found, found[1:]) if _follows(calls_at, a, b))
    return Order([names[position] for position in found], followers)


def _follows(calls_at: list[dict[int, tuple[int, bool]]], before: int, after: int) -> bool:
    """Whether some sample calls `after`, and every sample that calls either calls `after`
    right after `before`, on the same input (`calls_at`, per sample: each Linear's position in
    its calls, and whether its input was the call before's)."""
    called = False
    for at in calls_at:
        if (before in at) != (after in at):
            return False
        if after in at:
            called = True
            if at[after] != (at[before][0] + 1, True):
                return False
    return called


def run(
    layer,
    hidden: torch.Tensor,
    kwargs: dict[str, Any],
    linears: dict[str, Any],
    quantize: Callable[[list[str], list[torch.Tensor]], None],
    *,
    followers: frozenset[str] = frozenset(),
    take: Callable[[str, torch.Tensor], bool] | None = None,
    parking: Parking | None = None,
) -> list[str]:
    """Every sample of `hidden` [samples, seq, hidden] through `layer`, each Linear of
    `linears` (name: module, in the layer's order) quantized by `quantize(names, the inputs of
    the passes that reached it, in sample order)` once no pass can still reach it, `names` the
    Linear and the `followers` after it (`Order`), which read the same inputs; each sample's
    output written over its input in `hidden`. The names quantized, in order.

    `take(name, input)`, as each pass arrives at a Linear: True where the caller has taken what
    it needs of that input then (`quantize` is not given it). With `parking`, the storages a
    waiting pass holds (`_held`: its frames' tensors and, if taken, its input) are parked there
    until the pass goes on, but for those the passes share (the samples' buffer, the layer's
    arguments and weights) and an input `quantize` is to read."""
    import torch

    try:
        from greenlet import getcurrent, greenlet
    except ImportError:
        raise UsageError(
            "GPTQ calibration needs the greenlet package, which is not installed",
            hint="pip install 'qtool[calibrate]'",
            option="calibrate",
        ) from None
    names = list(linears)
    rank = {id(module): position for position, module in enumerate(linears.values())}
    group_of: dict[int, list[int]] = {}  # a Linear's position: the positions quantized with it (it, then its followers)
    groups: list[list[int]] = []
    for position, name in enumerate(names):
        if position and name in followers:
            groups[-1].append(position)
        else:
            groups.append([position])
        group_of[position] = groups[-1]
    quantized: set[int] = set()
    scheduler = getcurrent()
    expected: dict[
        int, tuple[list[int], torch.Tensor]
    ] = {}  # sample: the followers its pass is to call next, and their input

    def broken(position: int | None, index: int) -> OutOfOrder:
        following = expected[index][0][0]
        called = "did not call it" if position is None else f"called {names[position]}"
        return OutOfOrder(
            f"the layer {called} where {names[following]} was to follow {names[following - 1]} on its input"
        )

    def wait(module, args):
        position, index = rank[id(module)], current[getcurrent()]
        if index in expected:
            pending, x = expected[index]
            if pending[0] != position or args[0] is not x:
                raise broken(position, index)
            pending.pop(0)
            if not pending:
                del expected[index]
            return
        if position in quantized:
            raise OutOfOrder(f"the layer called {names[position]} again after it was quantized")
        scheduler.switch((position, args[0]))

    def one(index: int) -> None:
        hidden[index] = forward(layer, hidden[index : index + 1], kwargs)

    passes = [greenlet(lambda index=index: one(index), parent=scheduler) for index in range(hidden.shape[0])]
    current = {g: index for index, g in enumerate(passes)}
    waiting: dict[
        int, list[tuple[int, torch.Tensor, bool]]
    ] = {}  # Linear's position: (sample, its input, whether taken)
    parked: dict[int, list] = {}  # sample: its pass's parked storages

    def advance(index: int) -> None:
        state = passes[index].switch()
        if state is None:  # the pass is done
            if index in expected:
                raise broken(None, index)
            return
        position, x = state  # suspended before a Linear
        if index in expected:
            raise broken(position, index)
        taken = take is not None and take(names[position], x)
        if parking is not None:
            shared, pointer = _shared_storages(hidden, kwargs, layer), x.untyped_storage().data_ptr()
            held = ([x] if taken and pointer not in shared else []) + _held(passes[index].gr_frame, shared | {pointer})
            spots = [spot for spot in (parking.park(t) for t in held) if spot is not None]
            if spots:
                parked[index] = spots
        waiting.setdefault(position, []).append((index, x, taken))

    done = []
    hooks = [module.register_forward_pre_hook(wait) for module in linears.values()]
    try:
        with torch.no_grad():
            for index in range(len(passes)):
                advance(index)
            while waiting:
                position = min(waiting)
                group = group_of[position]
                arrived = sorted(waiting.pop(position), key=lambda entry: entry[0])
                quantize([names[member] for member in group], [x for _, x, taken in arrived if not taken])
                quantized.update(group)
                done.extend(names[member] for member in group)
                for index, x, _ in arrived:
                    if len(group) > 1:
                        expected[index] = (group[1:], x)
                resumed = [index for index, _, _ in arrived]
                del arrived  # the inputs: each pass's own from here on
                x = None
                for index in resumed:
                    for spot in parked.pop(index, ()):
                        parking.restore(spot)
                    advance(index)
    finally:
        for hook in hooks:
            hook.remove()
        try:
            for spots in parked.values():  # after an error: the passes unwind with their tensors whole
                for spot in spots:
                    parking.restore(spot)
        finally:
            for g in passes:  # after an error: unwind the passes still suspended
                if not g.dead:
                    g.throw()
    return done


PARK_AT_LEAST = 1 << 16  # bytes: smaller storages (routing indices, scalars) stay


def _held(frame, kept: set[int]) -> list[torch.Tensor]:
    """One tensor for each storage of at least `PARK_AT_LEAST` bytes that the suspended pass's
    frames hold (their locals, and the tuples, lists and dicts in them, a level deep), other
    than the `kept` ones (by data pointer): what the pass needs again only once it goes on. The
    frames of this module (the pass's entry, the hook it waits in) are passed over: their
    closures hold the scheduler's state, other passes' inputs among it."""
    import torch

    found: dict[int, torch.Tensor] = {}
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            frame = frame.f_back
            continue
        for value in list(frame.f_locals.values()):
            inner = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else (value,)
            )
            for tensor in inner:
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                    storage = tensor.untyped_storage()
                    pointer = storage.data_ptr()
                    if pointer not in kept and pointer not in found and storage.nbytes() >= PARK_AT_LEAST:
                        found[pointer] = tensor
        frame = frame.f_back
    return list(found.values())


def _shared_storages(hidden: torch.Tensor, kwargs: dict[str, Any], layer) -> set[int]:
    """The data pointers of the storages every pass reads, now: the samples' buffer, the tensors
    in the layer's arguments (masks, rotary tables; in tuples and lists), its weights and
    buffers (each quantized weight a new one, the float one's address free for another tensor)."""
    import torch

    found = {hidden.untyped_storage().data_ptr()}
    pending = list(kwargs.values())
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            found.add(value.untyped_storage().data_ptr())
        elif isinstance(value, (tuple, list)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    found.update(t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers()))
    return found
