"""`qtool eval` and `compare --text`: open the model (and its base), check that they can be
compared, cut the text into windows, run them in lockstep and return the document.

Two models compare when their decoder stacks agree (layers, hidden size, vocabulary) and their
tokenizers give the text the same tokens; else one line naming what differs (for tokens: the
first one, in both models' spellings).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from qtool.errors import UsageError
from qtool.evaluation.report import OutputGates, eval_document

if TYPE_CHECKING:
    import torch

    from qtool.evaluation.model import EvalModel

__all__ = ["evaluate", "EvalStart"]

EvalStart = Callable[[int, int, int], None]  # (windows, ctx, steps): before the first layer runs


def _same_stack(candidate: EvalModel, base: EvalModel) -> None:
    for field in ("num_hidden_layers", "hidden_size", "vocab_size"):
        a, b = getattr(candidate.config, field, None), getattr(base.config, field, None)
        if a != b:
            raise UsageError(
                f"{candidate.path} and {base.path} are not two versions of one model: {field} is {a} and {b}",
                hint="compare a model with its own quantized version",
            )


def _same_tokens(candidate: EvalModel, base: EvalModel, mine: torch.Tensor, theirs: torch.Tensor) -> None:
    """The first position where the two tokenizers' windows differ, in one line."""
    import torch

    rows = min(mine.shape[0], theirs.shape[0])
    a, b = mine[:rows].reshape(-1), theirs[:rows].reshape(-1)
    differ = torch.nonzero(a != b)
    if not differ.numel() and mine.shape[0] == theirs.shape[0]:
        return
    if not differ.numel():
        raise UsageError(
            f"the tokenizers of {candidate.path} and {base.path} cut the text into {mine.shape[0]} and {theirs.shape[0]} windows",
            hint="compare models that share a tokenizer",
        )
    at = int(differ[0])

    def shown(model: EvalModel, token: int) -> str:
        try:
            piece = model.tokenizer.convert_ids_to_tokens(token)
        except Exception:  # an id its vocabulary lacks
            piece = None
        return f"{token} ({piece!r})" if piece is not None else str(token)

    raise UsageError(
        f"the tokenizers of {candidate.path} and {base.path} disagree on the text: token {at} is "
        f"{shown(candidate, int(a[at]))} and {shown(base, int(b[at]))}",
        hint="compare models that share a tokenizer",
    )


def evaluate(
    model: str | os.PathLike[str],
    text: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    ctx: int = 512,
    windows: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    gates: OutputGates | None = None,
    pass_bytes: int = 1 << 30,
    on_start: EvalStart | None = None,
    on_layer: Callable[[int, int, float], None] | None = None,
) -> dict[str, Any]:
    """What `qtool.api.evaluate` documents; returns the `--json` document."""
    from qtool.calibration.samples import read_text
    from qtool.evaluation.lockstep import EvalOptions, passes, run_models
    from qtool.evaluation.model import open_model
    from qtool.evaluation.scores import Scores
    from qtool.evaluation.windows import WindowOptions, text_windows
    from qtool.formats.transformers_boundary import collected
    from qtool.pipeline import kernel_threads, resolve_device

    gates = gates or OutputGates()
    gates.check()
    if gates.any_set and base is None:
        raise UsageError("the output gates compare with a base model, and none is given", option="base")
    if threads is not None and threads < 1:
        raise UsageError(f"threads {threads} must be at least 1", option="threads")
    window_options = WindowOptions(ctx, windows)
    window_options.check()
    device = resolve_device(device)
    source = read_text(text, option="text")
    started = time.perf_counter()
    opened: list[EvalModel] = []
    try:
        with kernel_threads(threads):
            candidate = open_model(model, dtype=dtype)
            opened.append(candidate)
            reference = None
            if base is not None:
                reference = open_model(base, dtype=dtype)
                opened.append(reference)
                _same_stack(candidate, reference)
            said = [note for m in opened for note in m.notes]
            with collected(said, "transformers: "):
                cut = text_windows(source, candidate.tokenizer, window_options)
                if reference is not None:
                    _same_tokens(
                        candidate,
                        reference,
                        cut.tokens,
                        text_windows(source, reference.tokenizer, window_options).tokens,
                    )
            import torch

            itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            steps = len(passes(cut, int(candidate.config.hidden_size), itemsize, pass_bytes)) * (
                len(candidate.skeleton.layers) + 1
            )
            if on_start is not None:
                on_start(int(cut.tokens.shape[0]), cut.ctx, steps)
            scores = Scores()
            with collected(said, "transformers: "):
                sums = run_models(candidate, reference, cut, scores, EvalOptions(device, pass_bytes), on_layer)
    finally:
        for m in opened:
            m.close()
    return eval_document(
        model=os.fspath(model),
        base=None if base is None else os.fspath(base),
        text=os.fspath(text),
        windows=cut,
        scores=scores,
        layer_sums=sums,
        device=device,
        dtype=dtype,
        seconds=time.perf_counter() - started,
        gates=gates,
        warnings=said,
    )
