"""What every container reader produces: stored tensors plus the side files beside them.

A `StoredTensor` is a name, a storage dtype, a shape and a byte range in a file: physical
facts only. Which stored tensors make up one logical weight is decided later, by
`qtool.conventions`.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from qtool.buffers import allocate
from qtool.dtypes import StorageDType
from qtool.errors import CheckpointError

__all__ = ["StoredTensor", "Checkpoint", "SMALL_TENSOR_LIMIT"]

# Tensors this small may be read while inspecting: they hold metadata (compressed-tensors'
# `weight_shape`, bitsandbytes' quant-state JSON), not weights.
SMALL_TENSOR_LIMIT = 64 * 1024


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: StorageDType
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in `file`
    end: int
    file: str
    # Block-quantized data (GGUF): the container's own type name, e.g. "Q4_K", and the logical
    # shape in PyTorch order. The stored tensor itself is then raw bytes: dtype U8, shape (nbytes,).
    encoding: str | None = None
    logical_shape: tuple[int, ...] | None = None
    # False when the container holds the tensor in a way no byte range of `file` describes (a
    # strided view inside a PyTorch pickle): `begin`/`end` then only size it, and its bytes come
    # from `Checkpoint.read_bytes` / `Checkpoint.load`, never from reading `file` directly.
    in_file: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Checkpoint:
    """A container's contents: stored tensors in file order, metadata and side files."""

    path: str  # what the user named
    format: str  # "safetensors", ...
    files: list[str]
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str] = field(default_factory=dict)
    side_files: dict[str, Any] = field(default_factory=dict)  # "config.json" -> parsed JSON
    _maps: dict[str, mmap.mmap] = field(default_factory=dict, repr=False)

    @property
    def config(self) -> dict[str, Any]:
        config = self.side_files.get("config.json")
        return config if isinstance(config, dict) else {}

    # -- data access: lazy, and only where a command needs it ------------------------------------

    def read_small(self, tensor: StoredTensor) -> bytes:
        """The raw bytes of a small metadata tensor, read with pread: no mmap, no torch."""
        if tensor.nbytes > SMALL_TENSOR_LIMIT:
            raise CheckpointError(
                f"tensor {tensor.name!r} is {tensor.nbytes} bytes, too large to read as metadata",
                path=tensor.file,
            )
        fd = os.open(tensor.file, os.O_RDONLY)
        try:
            data = os.pread(fd, tensor.nbytes, tensor.begin)
        finally:
            os.close(fd)
        if len(data) != tensor.nbytes:
            raise CheckpointError(f"tensor {tensor.name!r} is cut short", path=tensor.file)
        return data

    def read_bytes(self, tensor: StoredTensor, start: int = 0, size: int | None = None) -> bytes | bytearray | memoryview:
        """`size` bytes of the tensor's data from byte `start` within it (all of it by default),
        with pread: no mmap pages stay resident. The one way to read a tensor's raw bytes that
        every container supports; containers whose tensors are not byte ranges of a file (see
        `StoredTensor.in_file`) override it."""
        size = tensor.nbytes - start if size is None else size
        if start < 0 or size < 0 or start + size > tensor.nbytes:
            raise ValueError(f"bytes [{start}, {start + size}) are outside tensor {tensor.name!r} of {tensor.nbytes} bytes")
        buffer = allocate(size)
        view, offset = buffer, tensor.begin + start
        fd = os.open(tensor.file, os.O_RDONLY)
        try:
            while view.nbytes:
                got = os.preadv(fd, [view], offset)
                if got == 0:
                    raise CheckpointError(f"tensor {tensor.name!r} is cut short", path=tensor.file)
                view, offset = view[got:], offset + got
        finally:
            os.close(fd)
        return buffer

    def _map(self, file: str) -> mmap.mmap:
        mapped = self._maps.get(file)
        if mapped is None:
            with open(file, "rb") as handle:
                # ACCESS_COPY: writable for torch.frombuffer, yet the file is never modified.
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[file] = mapped
        return mapped

    def load(self, tensor: StoredTensor):  # -> torch.Tensor
        """A torch view of the tensor's bytes through mmap; sub-byte dtypes come back as raw uint8."""
        import torch

        if tensor.nbytes == 0:
            dtype = torch.uint8 if tensor.dtype.torch_name is None else tensor.dtype.torch_dtype()
            return torch.empty(tensor.shape if tensor.dtype.torch_name else (0,), dtype=dtype)
        raw = torch.frombuffer(self._map(tensor.file), dtype=torch.uint8, count=tensor.nbytes, offset=tensor.begin)
        if tensor.dtype.torch_name is None:
            return raw
        return raw.view(tensor.dtype.torch_dtype()).reshape(tensor.shape)

    def release(self, tensor: StoredTensor) -> None:
        """Tell the kernel we are done with a tensor's pages, so streaming keeps RSS bounded."""
        mapped = self._maps.get(tensor.file)
        if mapped is None or tensor.nbytes == 0:
            return
        page = mmap.PAGESIZE
        start = tensor.begin - tensor.begin % page
        length = min(tensor.end, len(mapped)) - start
        if hasattr(mapped, "madvise") and length > 0:
            mapped.madvise(mmap.MADV_DONTNEED, start, length)

    def close(self) -> None:
        for mapped in self._maps.values():
            try:
                mapped.close()
            except BufferError:  # a torch view still holds it; the GC will unmap
                pass
        self._maps.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[StoredTensor]:
        return iter(self.tensors.values())
