"""A checkpoint opened for evaluation: its logical weights by Hugging Face name, transformers'
skeleton of its architecture (`qtool.calibration.skeleton`, built from the weights' logical
shapes, so a quantized checkpoint's packed tensors do not stand in the way) and its tokenizer.

Any convention qtool reads works: the skeleton's reader decodes each weight when its layer's
turn comes (`qtool.conventions.decoder_for`), in the compute dtype. A GGUF is read through its
Hugging Face view (`qtool.evaluation.gguf_model`): the names and config.json its metadata
gives, q/k rows put back in Hugging Face's order after decoding, its tokenizer from its
vocabulary. A head tied to the token embedding, and stored once, reads the embedding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qtool.errors import UsageError

if TYPE_CHECKING:
    import torch

    from qtool.calibration.skeleton import Skeleton
    from qtool.formats.checkpoint import Checkpoint
    from qtool.llamacpp.names import RotaryRows
    from qtool.weight import Weight

__all__ = ["EvalModel", "open_model", "DTYPES"]

DTYPES = ("float32", "bfloat16", "float16")  # the compute dtypes `--dtype` offers


@dataclass
class EvalModel:
    path: str  # as the user named it
    checkpoint: Checkpoint  # what the skeleton reads (a GGUF's Hugging Face view)
    weights: dict[str, Weight]  # by Hugging Face name; a tied head's name maps to the embedding
    skeleton: Skeleton
    tokenizer: Any
    notes: list[str] = field(default_factory=list)  # transformers' talk, for the user's warnings
    batch: int = 1  # windows each decoder layer runs over at once (set by the run, from its sizes)

    @property
    def config(self):
        return self.skeleton.config

    def close(self) -> None:
        self.checkpoint.close()


def _reader(rows_back: dict[str, RotaryRows]):
    """The skeleton's reader: a weight to float values on the device, in its logical shape (a
    quantized one decoded by its own convention; a GGUF's q/k rows put back)."""

    def read(weight: Weight, checkpoint: Checkpoint, device: str) -> torch.Tensor:
        from qtool.buffers import tensor_from_bytes
        from qtool.conventions import decoder_for

        if weight.quantized:
            values = decoder_for(weight).decode(checkpoint, weight, device)
        else:
            values = tensor_from_bytes(checkpoint.read_bytes(weight.data), weight.data.dtype, tuple(weight.data.shape))
        rows = rows_back.get(weight.name)
        if rows is not None:
            values = rows.apply(values, int(values.shape[0]))
        return values.to(device)

    return read


def _tie_head(skeleton: Skeleton, weights: dict[str, Weight]) -> None:
    """Where the architecture ties its head to the token embedding and the checkpoint stores the
    embedding only, the head's name reads the embedding's weight."""
    model = skeleton.model
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    if head is None or embedding is None or getattr(head, "weight", None) is not getattr(embedding, "weight", 0):
        return
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    head_name, embedding_name = f"{names.get(id(head))}.weight", f"{names.get(id(embedding))}.weight"
    if head_name not in weights and embedding_name in weights:
        weights[head_name] = weights[embedding_name]


def open_model(path: str | os.PathLike[str], *, dtype: str = "float32") -> EvalModel:
    """The checkpoint at `path` ready to run layer by layer: refused in one line where qtool
    cannot build its architecture, or it has no tokenizer."""
    from qtool.calibration.samples import load_tokenizer
    from qtool.calibration.skeleton import Skeleton
    from qtool.conventions import resolve
    from qtool.formats import open_checkpoint

    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}", option="dtype")
    shown = os.fspath(path)
    checkpoint = open_checkpoint(path)
    notes: list[str] = []
    try:
        checkpoint.require_local()
        rows_back: dict[str, RotaryRows] = {}
        tokenizer = None
        if checkpoint.format == "gguf":
            from qtool.evaluation.gguf_model import gguf_as_hugging_face

            view = gguf_as_hugging_face(checkpoint)
            checkpoint.close()  # the view reads the same files through descriptors of its own
            checkpoint, rows_back = view.checkpoint, dict(view.rows_back)
            tokenizer = view.tokenizer(notes)
        elif not checkpoint.config:
            raise UsageError(
                f"{shown}: evaluation needs the model's config.json beside its weights",
                hint="evaluate a Hugging Face model folder, or a GGUF",
                option="path",
            )
        weights = {weight.name: weight for weight in resolve(checkpoint)}
        skeleton = Skeleton.build(checkpoint, shapes={name: weight.shape for name, weight in weights.items()})
        notes.extend(skeleton.notes)
        skeleton.reader = _reader(rows_back)
        skeleton.dtype = dtype
        _tie_head(skeleton, weights)
        if tokenizer is None:
            folder = (
                checkpoint.path if os.path.isdir(checkpoint.path) else os.path.dirname(os.path.abspath(checkpoint.path))
            )
            tokenizer = load_tokenizer(folder, notes, option="text")
    except BaseException:
        checkpoint.close()
        raise
    return EvalModel(shown, checkpoint, weights, skeleton, tokenizer, notes)
