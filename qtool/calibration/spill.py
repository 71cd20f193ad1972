"""The codes of the layers calibrated so far, kept on disk rather than in memory until the
executor writes them: a calibrated run's memory is then one layer, not one layer plus the whole
model's packed codes (SmolLM2-135M at int4: 1.9 MB a layer, 57 MB by the last; a 70B model:
tens of GB). One unlinked temporary file, appended to; each weight's tensors read back with
pread when the executor asks for them (the page cache holds them, not the process's memory)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

__all__ = ["Spill", "SpilledTensors"]


class Spill:
    """An append-only temporary file of tensors' bytes; `store` gives the mapping that reads them back."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="qtool-calibration-")
        self._end = 0

    def store(self, tensors: dict[str, "torch.Tensor"]) -> "SpilledTensors":
        from qtool.buffers import tensor_bytes

        where: dict[str, tuple[int, int, Any, tuple[int, ...]]] = {}
        fd = self._file.fileno()
        for name, tensor in tensors.items():
            data = tensor_bytes(tensor.detach().cpu().contiguous())
            view, offset = memoryview(data).cast("B"), self._end
            while view.nbytes:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
            where[name] = (self._end, memoryview(data).nbytes, tensor.dtype, tuple(tensor.shape))
            self._end = offset
        return SpilledTensors(self._file, where)


class SpilledTensors(Mapping):
    """A weight's layout tensors by name, each read back from the spill file when asked for."""

    def __init__(self, file, where: dict[str, tuple[int, int, Any, tuple[int, ...]]]) -> None:
        self._file, self._where = file, where  # the file: open as long as a mapping needs it

    def __getitem__(self, name: str) -> "torch.Tensor":
        import torch

        offset, size, dtype, shape = self._where[name]
        if not size:
            return torch.empty(shape, dtype=dtype)
        buffer = bytearray(size)
        view, fd = memoryview(buffer), self._file.fileno()
        while view.nbytes:
            got = os.preadv(fd, [view], offset)
            if got == 0:
                raise OSError(f"the calibration spill file ended before {name}'s bytes")
            view, offset = view[got:], offset + got
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
