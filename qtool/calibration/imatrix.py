"""llama.cpp's importance matrix of a Hugging Face model, computed as `llama-imatrix` computes it
(tools/imatrix/imatrix.cpp), on the sequential runner's layers (one decoder layer in memory):

    text --the model's tokenizer, whole, BOS first if it adds one--> tokens
         --consecutive chunks of `chunk_size` tokens, each one's first token BOS--> [chunks, chunk_size]
         --embeddings, then each decoder layer in float32: every Linear's input x [tokens, columns]
           adds sum(x^2) per column to its sums and its token count to its count--> the next layer
         --> per weight, by its GGUF name (qtool.llamacpp.names): in_sum2 [columns], counts [1]

llama-imatrix collects the matrix multiplications of `blk.*` weights only (the output head only
with --process-output), and so does this: every Linear of a decoder layer. The layers run on
float weights (nothing is quantized here), so each layer's float outputs feed the next, as in
llama.cpp's one forward pass per chunk (each layer runs over a batch of chunks at once, which
gives the same values, `ImatrixStep`). Each chunk's sum over its tokens is float32 (squared once
for the Linears that share an input, q/k/v and gate/up), the running sums float64, stored as
float32 (llama.cpp adds float32 token by token: the last bits differ, nothing else).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from qtool.errors import UsageError

if TYPE_CHECKING:
    import torch

    from qtool.calibration.layers import CaughtLayer, LayerMade
    from qtool.calibration.samples import CalibrationText
    from qtool.calibration.skeleton import Skeleton
    from qtool.formats.checkpoint import Checkpoint
    from qtool.plan import Calibrated, Plan
    from qtool.weight import Weight

__all__ = [
    "ImatrixLayer",
    "ImatrixStatistics",
    "ImatrixStep",
    "chunk_tokens",
    "collect_imatrix",
    "ImatrixRequest",
    "apply_request",
]


@dataclass
class ImatrixLayer:
    index: int
    seconds: float
    weights: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.index, "seconds": round(self.seconds, 3), "weights": list(self.weights)}


@dataclass
class ImatrixStatistics:
    """Per weight (GGUF name): float32 sums of squared inputs [columns] and the tokens counted."""

    chunks: int
    chunk_size: int
    sums: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    layers: list[ImatrixLayer] = field(default_factory=list)
    seconds: float = 0.0


def chunk_tokens(text: CalibrationText, tokenizer, chunk_size: int, chunks: int | None, where: str) -> torch.Tensor:
    """[chunks, chunk_size] int64: the text tokenized a piece at a time (BOS first where the
    tokenizer adds one) and joined, cut into consecutive chunks from the start, each chunk's
    first token BOS where the tokenizer adds one (llama-imatrix's `compute_imatrix`); all of
    them, or `chunks` (reading stops once they are full)."""
    from array import array

    import torch

    from qtool.calibration.samples import token_pieces, tokenized

    if chunk_size < 16:
        raise UsageError(
            f"chunk size {chunk_size}: llama-imatrix ignores batches of fewer than 16 tokens", option="chunk_size"
        )
    if chunks is not None and chunks < 1:
        raise UsageError(f"chunks {chunks} must be at least 1", option="chunks")
    tokenizer.model_max_length = 1 << 62
    bos = tokenizer.bos_token_id
    probe_with, probe_without = tokenized(tokenizer, "a"), tokenized(tokenizer, "a", add_special_tokens=False)
    add_bos = bos is not None and len(probe_with) > len(probe_without) and probe_with[0] == bos
    ids = array("q", [bos] if add_bos else [])
    wanted = None if chunks is None else chunks * chunk_size
    for piece in token_pieces(text, tokenizer):
        ids.extend(piece if wanted is None else piece[: wanted - len(ids)])
        if wanted is not None and len(ids) >= wanted:
            break
    available = len(ids) // chunk_size
    if available < 1:
        raise UsageError(
            f"{where}: the calibration text has {len(ids)} tokens, fewer than one chunk of {chunk_size}",
            hint="give more text, or a smaller chunk size",
            option="calibrate",
        )
    count = available if chunks is None else min(chunks, available)
    tokens = torch.frombuffer(ids, dtype=torch.int64)[: count * chunk_size].clone().view(count, chunk_size)
    if add_bos:
        tokens[:, 0] = bos
    return tokens


class _Unbatched(Exception):
    """A Linear's input is not [chunks, chunk size, columns] (a mixture's experts see their
    routed tokens): the layer is run again a chunk at a time."""


class ImatrixStep:
    """The importance matrix's `LayerStep` (`qtool.calibration.layers`): each decoder Linear
    that `gguf_name` names, its squared inputs summed per column over the float layer's run
    into `result` by GGUF name; the float layer's outputs feed the next layer. Nothing is
    quantized.

    The layer runs over `batch` chunks at once (one forward of [batch, chunk size, hidden]
    rather than one per chunk: the same values, as each token's arithmetic does not depend on
    its neighbours in the batch, with a batch's fixed costs paid once). Each chunk's sums are
    still its own float32 sum over its tokens, added to the float64 running sums chunk by
    chunk in order, so the file is the one a chunk-at-a-time run writes, byte for byte. A
    layer whose Linears do not all see [chunks, chunk size, columns] (a mixture of experts)
    runs a chunk at a time, as do the layers after it."""

    def __init__(self, gguf_name: Callable[[str], str | None], result: ImatrixStatistics, batch: int = 1) -> None:
        self.gguf_name, self.result = gguf_name, result
        self.batch = max(1, batch)
        self.spare: torch.Tensor | None = None  # the buffer the float outputs go to

    def layer(self, caught: CaughtLayer) -> LayerMade:
        import torch

        from qtool.calibration.layers import LayerMade

        hidden = caught.hidden
        linears = {}
        for weight_name, module in caught.linears.items():
            if isinstance(module, torch.nn.Linear):
                out_name = self.gguf_name(weight_name)
                if out_name is not None:
                    linears[out_name] = module
        outputs = self.spare if self.spare is not None else torch.empty_like(hidden)
        if self.batch > 1:
            try:
                sums, seen = self._run(caught, linears, outputs, self.batch)
            except (_Unbatched, RuntimeError):  # RuntimeError: kwargs that do not broadcast, memory
                self.batch = 1
        if self.batch == 1:
            sums, seen = self._run(caught, linears, outputs, 1)
        for name in linears:
            values = sums[name].float().cpu().numpy()
            if not (values == values).all() or (abs(values) == float("inf")).any():
                raise UsageError(
                    f"{name}: its inputs hold NaN or inf on this text (llama-imatrix stops too)", option="calibrate"
                )
            self.result.sums[name], self.result.counts[name] = values, seen[name]
        self.spare = hidden  # the float layer's outputs feed the next
        return LayerMade(outputs, sorted(linears))

    def _run(self, caught: CaughtLayer, linears: dict[str, Any], outputs: torch.Tensor, batch: int):
        """The layer over every chunk, `batch` at a time, into `outputs` (never `caught.hidden`,
        which a batch that turns out `_Unbatched` runs again from); the sums and counts."""
        import torch

        from qtool.calibration.layers import LayerKwargs

        hidden = caught.hidden
        sums = {
            name: torch.zeros(m.in_features, dtype=torch.float64, device=hidden.device) for name, m in linears.items()
        }
        seen = dict.fromkeys(linears, 0)
        hooks = []
        last: list[Any] = [None, [], 0]  # q, k and v (gate and up) see one input tensor: squared once

        for name, module in linears.items():

            def accumulate(module, args, name=name):
                x = args[0]
                if last[0] is not x:
                    if batch > 1 and (x.dim() != 3 or x.shape[:2] != current[0].shape[:2]):
                        raise _Unbatched
                    per_chunk = x if batch > 1 else x.reshape(1, -1, x.shape[-1])
                    # each chunk's float32 sum over its tokens: the values `sum(dim=0)` of that
                    # chunk alone gives (tests/test_imatrix_compute.py checks they are equal)
                    chunk_sums = per_chunk.float().square().sum(dim=1).double()
                    last[:] = [x, list(chunk_sums.unbind(0)), per_chunk.shape[1]]
                for chunk_sum in last[1]:
                    sums[name] += chunk_sum
                seen[name] += last[2] * len(last[1])

            hooks.append(module.register_forward_pre_hook(accumulate))
        kwargs = caught.kwargs.for_layer(caught.module) if isinstance(caught.kwargs, LayerKwargs) else caught.kwargs
        current: list[Any] = [None]
        try:
            with torch.no_grad():
                for start in range(0, hidden.shape[0], batch):
                    current[0] = hidden[start : start + batch]
                    result = caught.module(current[0], **kwargs)
                    outputs[start : start + batch] = result[0] if isinstance(result, tuple) else result
        finally:
            for hook in hooks:
                hook.remove()
            last[:] = [None, [], 0]
        return sums, seen

    def close(self) -> None:
        self.spare = None


def collect_imatrix(
    checkpoint: Checkpoint,
    weights: list[Weight],
    gguf_name: Callable[[str], str | None],
    tokens: torch.Tensor,
    device: str = "cpu",
    on_layer: Callable[[ImatrixLayer, int], None] | None = None,
    *,
    skeleton: Skeleton | None = None,
) -> ImatrixStatistics:
    """Run the model layer by layer over `tokens` (the runner, `ImatrixStep`) and sum each
    decoder Linear's squared inputs per column. `gguf_name` maps a weight's name to its GGUF
    tensor name (None: not written). `skeleton`: the checkpoint's, where the caller has built
    it already (built here otherwise)."""
    from qtool.calibration.layers import per_batch, token_values
    from qtool.calibration.runner import run_layers
    from qtool.calibration.skeleton import Skeleton

    started = time.perf_counter()
    by_name = {w.name: w for w in weights}
    if skeleton is None:
        skeleton = Skeleton.build(checkpoint)
    result = ImatrixStatistics(int(tokens.shape[0]), int(tokens.shape[1]))
    step = ImatrixStep(
        gguf_name,
        result,
        per_batch(result.chunks, result.chunk_size, token_values(skeleton, result.chunk_size)),
    )

    def done(index: int, seconds: float, made: LayerMade, count: int) -> None:
        layer_result = ImatrixLayer(index, seconds, made.weights)
        result.layers.append(layer_result)
        if on_layer is not None:
            on_layer(layer_result, count)

    try:
        run_layers(skeleton, checkpoint, by_name, tokens, device, step, done)
    finally:
        step.close()
    result.seconds = time.perf_counter() - started
    return result


# -- the imatrix as a file, and as a stage of `quantize --calibrate` to GGUF ----------------------


def statistics_entries(stats: ImatrixStatistics) -> dict[str, tuple[Any, list[int]]]:
    """What `formats.imatrix.imatrix_gguf_bytes` writes: name -> (sums, [count])."""
    return {name: (stats.sums[name], [stats.counts[name]]) for name in stats.sums}


def as_imatrix(stats: ImatrixStatistics, path: str, dataset: str) -> Any:
    """The statistics as an in-memory `Imatrix`, as reading the file written from them gives."""
    import numpy as np

    from qtool.formats.imatrix import Imatrix, ImatrixEntry

    entries = {
        name: ImatrixEntry(name, np.asarray(stats.sums[name], dtype=np.float32), (stats.counts[name],))
        for name in sorted(stats.sums, key=lambda n: n.encode("utf-8"))
    }
    return Imatrix(path, "gguf", entries, (dataset.encode("utf-8", "surrogateescape"),), stats.chunks, stats.chunk_size)


@dataclass(frozen=True)
class ImatrixRequest:
    """`quantize --calibrate` to GGUF: an importance matrix computed on the text before the
    executor runs, then used as `--imatrix` would use its file (the plan's mix deciding, as
    llama-quantize does, which types need it). Made by `qtool.planning.calibration`."""

    text: str
    tokens: torch.Tensor  # [chunks, chunk_size]
    notes: tuple[str, ...] = ()  # what transformers said while the model and tokenizer were read, for the warnings
    mix: str | None = None  # the llama.cpp file type the plan follows, if any
    skeleton: Skeleton | None = field(default=None, compare=False, repr=False)  # planning's, built once

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "algorithm": "imatrix",
            "chunks": int(self.tokens.shape[0]),
            "chunk_size": int(self.tokens.shape[1]),
        }


def apply_request(
    plan: Plan, request: ImatrixRequest, device: str, on_layer: Callable[[Any, int], None] | None = None
) -> Calibrated:
    """Compute the importance matrix; what it makes for the plan: each GGUF job's importance
    rows, and the plan's metadata with it recorded (`quantize.imatrix.*`, the text as the file
    and the dataset); with the calibration document for the report. The caller sets the
    threads (`qtool.pipeline.kernel_threads`)."""
    from qtool.formats.transformers_boundary import collected
    from qtool.llamacpp.importance import IMATRIX_KEYS, attach_importance, imatrix_metadata
    from qtool.llamacpp.names import tensor_names
    from qtool.plan import Calibrated

    said: list[str] = []
    names = tensor_names(plan.source, True)
    with collected(said, "calibration: "):
        stats = collect_imatrix(
            plan.source,
            [job.weight for job in plan.jobs],
            names.tensor_name,
            request.tokens,
            device,
            on_layer,
            skeleton=request.skeleton,
        )
    imatrix = as_imatrix(stats, request.text, request.text)
    weighted, notes = attach_importance(plan.jobs, imatrix, request.mix)
    encodings = {
        new.weight.name: new.encoding
        for old, new in zip(plan.jobs, weighted)
        if new is not old and new.encoding is not None
    }
    arch, entries = plan.metadata
    metadata = (arch, [e for e in entries if e[0] not in IMATRIX_KEYS] + imatrix_metadata(imatrix, request.text))
    document = {
        **request.to_json(),
        "seconds": round(stats.seconds, 3),
        "entries": len(imatrix.entries),
        "notes": notes,
        "layers": [layer.to_json() for layer in stats.layers],
    }
    return Calibrated(document | ({"warnings": said} if said else {}), encodings, metadata=metadata)
