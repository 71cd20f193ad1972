"""Calibration's bytes kept on disk rather than in memory, each in one unlinked temporary file
(the page cache holds them, not the process's memory):

- `Spill`: the codes of the layers calibrated so far, until the executor writes them: a
  calibrated run's memory is then one layer, not one layer plus the whole model's packed codes
  (SmolLM2-135M at int4: 1.9 MB a layer, 57 MB by the last; a 70B model: tens of GB). Appended
  to; each weight's tensors read back with pread when the executor asks for them.
- `Parking`: a tensor's memory while the computation that owns it is suspended (a true
  sequential pass waiting at a down_proj holds the MLP's [seq, intermediate] product, 2.7 times
  a sample's hidden states at SmolLM2's width, 3.5 at LLaMA-3's): its storage is written out
  and freed, the tensor and every view of that storage kept, and read back into the same
  storage before the computation goes on."""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

if TYPE_CHECKING:
    import torch

__all__ = ["Parked", "Parking", "Spill", "SpilledTensors"]


class Spill:
    """An append-only temporary file of tensors' bytes; `store` gives the mapping that reads them back."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="qtool-calibration-")
        self._end = 0

    def store(self, tensors: dict[str, torch.Tensor]) -> SpilledTensors:
        from qtool.buffers import tensor_bytes

        where: dict[str, tuple[int, int, Any, tuple[int, ...]]] = {}
        fd = self._file.fileno()
        for name, tensor in tensors.items():
            data = tensor_bytes(tensor.detach().cpu().contiguous())
            offset = _write_all(fd, memoryview(data).cast("B"), self._end)
            where[name] = (self._end, memoryview(data).nbytes, tensor.dtype, tuple(tensor.shape))
            self._end = offset
        return SpilledTensors(self._file, where)


class SpilledTensors(Mapping):
    """A weight's layout tensors by name, each read back from the spill file when asked for."""

    def __init__(self, file, where: dict[str, tuple[int, int, Any, tuple[int, ...]]]) -> None:
        self._file, self._where = file, where  # the file: open as long as a mapping needs it

    def __getitem__(self, name: str) -> torch.Tensor:
        import torch

        offset, size, dtype, shape = self._where[name]
        if not size:
            return torch.empty(shape, dtype=dtype)
        buffer = bytearray(size)
        _read_all(self._file.fileno(), memoryview(buffer), offset, name)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


@dataclass(frozen=True)
class Parked:
    """A parked storage: where its bytes are in the parking file, and how many."""

    storage: Any  # torch.UntypedStorage, resized to 0 bytes while parked
    offset: int
    nbytes: int


class Parking:
    """Storages parked in one temporary file, made at the first `park`; `reset` starts writing
    it from its start again (once nothing parked is still to be restored: each layer), so the
    file's pages are rewritten rather than new ones allocated (the first write of a page costs
    ten times a rewrite's)."""

    def __init__(self) -> None:
        self._file = None
        self._end = 0
        self._failed = False  # no temporary file could be made or written: nothing is parked

    def reset(self) -> None:
        self._end = 0

    def park(self, tensor: torch.Tensor) -> Parked | None:
        """`tensor`'s whole storage written out and freed; None (nothing done) where torch
        cannot free it (a storage it does not own, not resizable), it is empty, or the
        temporary directory cannot take it (full: the tensor stays in memory, as without)."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if not nbytes or not storage.resizable() or self._failed:
            return None
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="qtool-parking-")
            host = _bytes_of(storage).cpu()  # on the CPU the storage's own bytes, no copy
            _write_all(self._file.fileno(), _buffer(host), self._end)
        except OSError:
            self._failed = True
            return None
        del host
        parked = Parked(storage, self._end, nbytes)
        self._end += nbytes
        storage.resize_(0)
        return parked

    def restore(self, parked: Parked) -> None:
        """The parked bytes back in their storage (at a new address, which every tensor on it follows)."""
        import torch

        parked.storage.resize_(parked.nbytes)
        data = _bytes_of(parked.storage)
        host = data if data.device.type == "cpu" else torch.empty(parked.nbytes, dtype=torch.uint8)
        _read_all(self._file.fileno(), _buffer(host), parked.offset, "a parked tensor")
        if host is not data:
            data.copy_(host)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _bytes_of(storage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _buffer(host: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor as a writable buffer, without the numpy view
    that would leave its storage unresizable."""
    return memoryview((ctypes.c_char * host.numel()).from_address(host.data_ptr())).cast("B")


def _write_all(fd: int, view: memoryview, offset: int) -> int:
    """All of `view` at `offset`; the offset after it."""
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    return offset


def _read_all(fd: int, view: memoryview, offset: int, what: str) -> None:
    while view.nbytes:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise OSError(f"the calibration spill file ended before {what}'s bytes")
        view, offset = view[got:], offset + got
