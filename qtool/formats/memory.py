"""A checkpoint held in memory: tensors a codec just produced, read back through the same
conventions as a file. The pipeline measures each weight's error by decoding what it is about
to write, so the numbers describe the bytes on disk, not a side computation."""

from __future__ import annotations

from typing import Any

from qtool.dtypes import from_torch
from qtool.formats.checkpoint import Checkpoint, StoredTensor

__all__ = ["MemoryCheckpoint"]


class MemoryCheckpoint(Checkpoint):
    def __init__(self, tensors: dict[str, Any], side_files: dict[str, Any] | None = None) -> None:
        stored = {}
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            stored[name] = StoredTensor(name, from_torch(tensor.dtype), tuple(tensor.shape), 0, size, "<memory>")
        super().__init__(path="<memory>", format="memory", files=[], tensors=stored, side_files=side_files or {})
        self.data = tensors

    def load(self, tensor: StoredTensor):
        return self.data[tensor.name]

    def read_small(self, tensor: StoredTensor) -> bytes:
        import torch

        value = self.data[tensor.name].detach().to("cpu").contiguous().reshape(-1)
        return value.view(torch.uint8).numpy().tobytes()

    def release(self, tensor: StoredTensor) -> None:
        pass
