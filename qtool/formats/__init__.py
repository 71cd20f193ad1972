"""Containers: read stored tensors lazily from checkpoint files. Knows no quantization conventions."""

from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.loader import open_checkpoint

__all__ = ["Checkpoint", "StoredTensor", "open_checkpoint"]
