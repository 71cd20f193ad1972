"""What every calibrated run needs of its input, checked once for all of them (`quantize
--calibrate` with GPTQ, AWQ or RTN, `quantize --calibrate` to GGUF, `qtool imatrix`): a Hugging
Face model folder of float weights, its calibration text readable, an architecture transformers
builds, and its tokenizer. Checked when the run is planned, so `--dry-run` and a bad input fail
the same way, with nothing written."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Sequence

from qtool.errors import UsageError
from qtool.formats import Checkpoint

if TYPE_CHECKING:
    from qtool.calibration.samples import CalibrationText
    from qtool.calibration.skeleton import Skeleton
    from qtool.weight import Weight

__all__ = ["Readied", "require_float_model", "ready"]


@dataclass(frozen=True)
class Readied:
    """The text read (its files checked) and the tokenizer loaded, with what transformers said
    while the model and tokenizer were read (the run's warnings)."""

    text: CalibrationText
    tokenizer: object
    notes: tuple[str, ...]
    skeleton: Skeleton  # built once, here, and handed to the run (`calibrate(skeleton=)`)

    @property
    def layers(self) -> int:
        """The model's decoder layers."""
        return len(self.skeleton.layers)


def require_float_model(
    source: Checkpoint, weights: Sequence[Weight], *, shown: str | None = None, imatrix_command: bool = False
) -> None:
    """A Hugging Face model folder (safetensors) of float weights, or a one-line refusal naming
    `shown` (the path as given; the checkpoint's own path by default)."""
    shown = source.path if shown is None else shown
    reads, needs, option = (
        ("the importance matrix is computed from", "the importance matrix needs", "path")
        if imatrix_command
        else ("calibration reads", "calibration needs", "calibrate")
    )
    if source.format != "safetensors":
        raise UsageError(
            f"{shown} is a {source.format} checkpoint; {reads} a Hugging Face model folder (safetensors, config.json, tokenizer)",
            option=option,
        )
    quantized = [weight.name for weight in weights if weight.quantized]
    if quantized:
        raise UsageError(f"{shown} is already quantized ({quantized[0]}); {needs} float weights", option=option)


def ready(source: Checkpoint, text: str) -> Readied:
    """Read the calibration text (its files checked, regular and in size, before transformers is
    imported), build the model's skeleton (an architecture transformers does not know, or a
    config the weights belie, is refused here) and load its tokenizer."""
    from qtool.calibration.samples import load_tokenizer, read_text
    from qtool.calibration.skeleton import Skeleton

    folder = source.path if os.path.isdir(source.path) else os.path.dirname(os.path.abspath(source.path))
    calibration = read_text(text)
    skeleton = Skeleton.build(source)
    notes = list(skeleton.notes)
    tokenizer = load_tokenizer(folder, notes)
    return Readied(calibration, tokenizer, tuple(notes), skeleton)
