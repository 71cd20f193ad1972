"""The Python API; the CLI is a thin layer over these functions.

    >>> import qtool
    >>> report = qtool.inspect("sample_models/tiny-llama")
    >>> report.summary()["parameters"]
    722176
"""

from __future__ import annotations

import os
from typing import Callable

from qtool.formats import Checkpoint
from qtool.formats import open_checkpoint as _open_checkpoint
from qtool.inspection import Inspection, inspect_checkpoint

__all__ = ["open_checkpoint", "inspect", "collect_stats"]


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint's headers and side files. No tensor data is read."""
    return _open_checkpoint(path)


def inspect(path: str | os.PathLike[str]) -> Inspection:
    """Every weight of a checkpoint with its shape, dtype and scheme, from the headers alone."""
    return inspect_checkpoint(_open_checkpoint(path))


def collect_stats(inspection: Inspection, on_bytes: Callable[[int], None] | None = None) -> None:
    """Stream every plain weight's data and fill `inspection.stats`. Imports torch."""
    from qtool.stats import weight_stats

    checkpoint = inspection.checkpoint
    try:
        for weight in inspection.weights:
            if not weight.quantized:
                inspection.stats[weight.name] = weight_stats(checkpoint, weight, on_bytes)
    finally:
        checkpoint.close()
