"""One model, or a candidate and its base in lockstep, run over the windows a layer at a time.

    windows [n, ctx]
      --each model's embeddings (the calibration runner's `embed`: its own forward, stopped at
        the first layer; only the embedding rows the windows use)--> hidden [n, ctx, hidden] each
      --for each decoder layer: the candidate's layer read (decoded), run over its hidden states,
        released; then the base's; the relative error of the candidate's outputs against the
        base's added up (float64)
      --the head (final norm, output projection, any logit soft-capping: transformers' own
        forward, its layers standing in for the hidden states already computed), a window at a
        time: the scored positions' log-probabilities of both models, compared there and dropped

Memory: one decoder layer of each model at a time, the head, both models' hidden states, and a
window's logits. The hidden states of a pass are at most `EvalOptions.pass_bytes` per model: a
text with more windows runs in passes, each reading the layers again. Nothing of the size of
vocabulary x tokens outlives a window; per scored token, its loss, KL and top-1 agreement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Callable

from qtool.errors import UsageError

if TYPE_CHECKING:
    import torch

    from qtool.evaluation.model import EvalModel
    from qtool.evaluation.scores import Scores
    from qtool.evaluation.windows import Windows

__all__ = ["EvalOptions", "run_models", "passes"]


@dataclass(frozen=True)
class EvalOptions:
    device: str = "cpu"
    pass_bytes: int = 1 << 30  # hidden states one pass holds per model


def passes(windows: Windows, hidden_size: int, itemsize: int, pass_bytes: int) -> list[slice]:
    """The windows cut into passes whose hidden states fit `pass_bytes` (at least one window each)."""
    count = int(windows.tokens.shape[0])
    per_window = windows.ctx * hidden_size * itemsize
    size = max(1, pass_bytes // max(per_window, 1))
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


class _Head:
    """A model's head, materialized for a pass: the hidden states after the last layer to the
    logits of the scored positions, by transformers' own forward (its layers replaced by one
    stand-in that hands it the final hidden states, the others passing them through)."""

    def __init__(self, model: EvalModel, device: str) -> None:
        import torch

        skeleton = model.skeleton
        self.skeleton, self.device = skeleton, device
        if not skeleton.base_prefix or "." in skeleton.base_prefix:
            raise UsageError(
                f"{model.path}: the {skeleton.config.model_type} model's layers are not under a direct child of the causal LM; qtool cannot evaluate it"
            )
        layers_name = skeleton.layers_prefix.rpartition(".")[2]
        embedding = skeleton.base.get_input_embeddings()
        skip = tuple(name for name, child in skeleton.base.named_children() if child is embedding) + (layers_name,)
        skeleton.materialize(skeleton.model, "", model.weights, model.checkpoint, device, skip=(skeleton.base_prefix,))
        skeleton.materialize(skeleton.base, skeleton.base_prefix, model.weights, model.checkpoint, device, skip=skip)
        self.final: torch.Tensor | None = None
        head = self

        class Final(torch.nn.Module):
            def forward(self, hidden_states, *args, **kwargs):
                return head.final

        class Through(torch.nn.Module):
            def forward(self, hidden_states, *args, **kwargs):
                return hidden_states

        self.stand_ins = [Final(), *(Through() for _ in range(len(skeleton.layers) - 1))]
        self.hidden_size = int(getattr(skeleton.config, "hidden_size", 0))

    def logits(self, final: torch.Tensor, keep: int) -> torch.Tensor:
        """[keep, vocab] float32: the logits of the last `keep` positions of one window whose
        final hidden states are `final` [ctx, hidden]."""
        import torch

        skeleton = self.skeleton
        originals = list(skeleton.layers)
        self.final = final.unsqueeze(0)
        for index, stand_in in enumerate(self.stand_ins):
            skeleton.layers[index] = stand_in
        try:
            with torch.no_grad():
                out = skeleton.model(inputs_embeds=torch.zeros_like(self.final), use_cache=False, logits_to_keep=keep)
        finally:
            for index, layer in enumerate(originals):
                skeleton.layers[index] = layer
            self.final = None
        return out.logits[0].float()

    def release(self) -> None:
        layers_name = self.skeleton.layers_prefix.rpartition(".")[2]
        for name, child in self.skeleton.model.named_children():
            if name != self.skeleton.base_prefix:
                self.skeleton.release(child)
        for name, child in self.skeleton.base.named_children():
            if name != layers_name:
                self.skeleton.release(child)


def _layer(model: EvalModel, index: int, hidden: torch.Tensor, kwargs, device: str) -> None:
    """Decoder layer `index` of `model` read, run over `hidden` in place, released."""
    from qtool.libc import trim_heap

    skeleton = model.skeleton
    layer = skeleton.layers[index]
    skeleton.materialize(layer, f"{skeleton.layers_prefix}.{index}", model.weights, model.checkpoint, device)
    try:
        _run(layer, hidden, kwargs, model.batch)
    finally:
        skeleton.release(layer)
        trim_heap()  # the layer's freed blocks back to the system: peak memory flat in depth (without: +14% at 30 layers over 8)


def _run(layer, hidden: torch.Tensor, kwargs, batch: int) -> None:
    """The layer over the windows in place, `batch` windows a forward (one forward's fixed costs
    paid once, and larger matrix products); a layer whose arguments do not broadcast over a
    batch runs a window at a time, as the calibration runner runs it."""
    import torch

    from qtool.calibration.layers import LayerKwargs, run

    if batch > 1:
        own = kwargs.for_layer(layer) if isinstance(kwargs, LayerKwargs) else kwargs
        try:
            with torch.no_grad():
                for start in range(0, hidden.shape[0], batch):
                    result = layer(hidden[start : start + batch], **own)
                    hidden[start : start + batch] = result[0] if isinstance(result, tuple) else result
            return
        except RuntimeError:  # shapes that do not broadcast: nothing was written over yet, or it is run again
            if start:
                raise
    run(layer, hidden, kwargs, hidden)


def _error_sums(candidate: torch.Tensor, base: torch.Tensor) -> tuple[float, float]:
    """sum (candidate - base)^2 and sum base^2 over the windows, float64, a window at a time."""
    error = total = 0.0
    for c, b in zip(candidate, base):
        error += float((c.double() - b.double()).pow(2).sum())
        total += float(b.double().pow(2).sum())
    return error, total


def run_models(
    candidate: EvalModel,
    base: EvalModel | None,
    windows: Windows,
    scores: Scores,
    options: EvalOptions,
    on_layer: Callable[[int, int, float], None] | None = None,
) -> list[tuple[float, float]]:
    """Run `candidate` (and `base`, in lockstep) over `windows`, adding each scored window to
    `scores`; returns per decoder layer the hidden-state error sums (sum of squared differences,
    sum of the base's squares; zeros without a base). `on_layer(steps done, steps, seconds)`
    after each layer of each pass."""
    import torch

    from qtool.calibration.layers import per_batch, token_values
    from qtool.calibration.runner import embed

    device = options.device
    models = [candidate] if base is None else [candidate, base]
    count = len(candidate.skeleton.layers)
    itemsize = torch.empty((), dtype=getattr(torch, candidate.skeleton.dtype)).element_size()
    cuts = passes(windows, int(candidate.config.hidden_size), itemsize, options.pass_bytes)
    for model in models:
        model.batch = per_batch(windows.tokens.shape[0], windows.ctx, token_values(model.skeleton, windows.ctx))
    sums = [(0.0, 0.0)] * count
    step, steps = 0, len(cuts) * (count + 1)
    keep = windows.ctx - windows.first
    for cut in cuts:
        tokens = windows.tokens[cut]
        started = time.perf_counter()
        states = [embed(m.skeleton, tokens, m.weights, m.checkpoint, device) for m in models]
        for index in range(count):
            for model, (hidden, kwargs) in zip(models, states):
                _layer(model, index, hidden, kwargs, device)
            if base is not None:
                error, total = _error_sums(states[0][0], states[1][0])
                sums[index] = (sums[index][0] + error, sums[index][1] + total)
            step += 1
            if on_layer is not None:
                on_layer(step, steps, time.perf_counter() - started)
            started = time.perf_counter()
        heads = [_Head(m, device) for m in models]
        try:
            for row in range(int(tokens.shape[0])):
                targets = tokens[row, windows.first + 1 :].to(device)
                logits = [head.logits(hidden[row], keep)[:-1] for head, (hidden, _) in zip(heads, states)]
                scores.add(targets, logits[0], logits[1] if base is not None else None)
        finally:
            for head in heads:
                head.release()
        del states
        step += 1
        if on_layer is not None:
            on_layer(step, steps, time.perf_counter() - started)
    return sums
