"""What every container reader produces: stored tensors plus the side files beside them.

A `StoredTensor` is a name, a storage dtype, a shape and a byte range in a file: physical
facts only. Which stored tensors make up one logical weight is decided later, by
`qtool.conventions`.

A `Checkpoint` reads each file through one descriptor, opened on first use and kept until
`close()`, so every byte comes from the file whose header was parsed, even if the path is
replaced meanwhile (an `hf download` or a training job writing over it). Each file's identity
(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) is taken when the checkpoint is built, checked when the
file is opened, and again by `verify_unchanged()`, which a writer calls before it commits: an
output is never built from a file that changed while it was read.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator

from qtool.dtypes import StorageDType
from qtool.errors import CheckpointError

__all__ = ["StoredTensor", "Checkpoint", "SMALL_TENSOR_LIMIT", "SIDE_FILES", "dims_fit_int64"]

# the side files read beside the weights: the model config and the toolchains' own configs
SIDE_FILES = ("config.json", "quantize_config.json", "quanto_qmap.json", "quantization_map.json")

# Tensors this small may be read while inspecting: they hold metadata (compressed-tensors'
# `weight_shape`, bitsandbytes' quant-state JSON), not weights.
SMALL_TENSOR_LIMIT = 64 * 1024

_OPEN_LOCK = threading.Lock()  # one open per file, though the reader thread and the main thread both read
_Identity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def dims_fit_int64(dims) -> bool:
    """Whether the product of the non-zero dims fits in int64. A 0 makes a tensor empty, yet
    torch and numpy still multiply the other dims ([0, 64, 2^62] overflows their stride
    arithmetic), so the readers refuse such a shape rather than let a decoder meet it."""
    product = 1
    for dim in dims:
        if dim:
            product *= dim
    return product < 2**63


def _identity_of(st: os.stat_result) -> _Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _how_changed(before: _Identity, after: _Identity | None) -> str | None:
    """What happened to a file, in words; None if nothing did."""
    if after is None:
        return "removed"
    if after[:2] != before[:2]:
        return "replaced by another file"
    if after[2] < before[2]:
        return f"truncated from {before[2]} to {after[2]} bytes"
    if after[2] != before[2]:
        return f"grown from {before[2]} to {after[2]} bytes"
    if after[3:] != before[3:]:  # ctime too: a writer can restore the mtime, never the ctime
        return "modified"
    return None


@dataclass(frozen=True, slots=True)  # slots: a header may list 1.6M of them
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
    # What a reader wants the user to know about how the checkpoint was found (a folder holding
    # other weights files than the model's); the CLI shows them as warnings, inspect's JSON too.
    notes: list[str] = field(default_factory=list)
    _fds: dict[str, int] = field(default_factory=dict, repr=False, compare=False)  # file -> open descriptor
    _identity: dict[str, _Identity] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The readers parsed each header just before: this is the file that was parsed.
        for file in self.files:
            try:
                self._identity[file] = _identity_of(os.stat(file))
            except OSError:
                pass  # reading it will say why

    @property
    def config(self) -> dict[str, Any]:
        config = self.side_files.get("config.json")
        return config if isinstance(config, dict) else {}

    # -- data access: lazy, and only where a command needs it ------------------------------------

    def require_local(self) -> None:
        """Raise CheckpointError if the tensor data can't be read here (a remote checkpoint);
        commands that read data call it before they plan anything."""

    def _fd(self, file: str) -> int:
        """The descriptor every read of `file` goes through, opened once."""
        fd = self._fds.get(file)
        if fd is not None:
            return fd
        with _OPEN_LOCK:
            fd = self._fds.get(file)
            if fd is not None:
                return fd
            try:
                fd = os.open(
                    file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
                )  # swapped for a FIFO: no wait, and refused as changed
                seen = _identity_of(os.fstat(fd))
            except OSError as exc:
                if fd is not None:
                    os.close(fd)
                raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=file) from None
            how = _how_changed(self._identity.setdefault(file, seen), seen)
            if how is not None:
                os.close(fd)
                raise _changed(file, how)
            os.set_blocking(fd, True)
            self._fds[file] = fd
            return fd

    def verify_unchanged(self) -> None:
        """Raise CheckpointError if any file changed since the checkpoint was built: the open
        descriptor's file was modified or truncated, or the path now names another file. A
        writer calls this before it commits, so a changed input leaves no output."""
        for file, before in self._identity.items():
            try:  # the path first: a replaced file also changes the old one's ctime (its links)
                now: _Identity | None = _identity_of(os.stat(file))
            except FileNotFoundError:
                now = None
            except OSError as exc:
                raise CheckpointError(f"cannot check whether it changed: {exc.strerror or exc}", path=file) from None
            how = _how_changed(before, now)
            fd = self._fds.get(file)
            if how is None and fd is not None:
                how = _how_changed(before, _identity_of(os.fstat(fd)))
            if how is not None:
                raise _changed(file, how)

    def _cut_short(self, tensor: StoredTensor) -> CheckpointError:
        size = self._identity.get(tensor.file, (0, 0, -1, 0))[2]
        try:
            size = os.fstat(self._fds[tensor.file]).st_size
        except (KeyError, OSError):
            pass
        return CheckpointError(
            f"tensor {tensor.name!r} is cut short: it ends at byte {tensor.end}, the file at {size} (truncated while it was read?)",
            path=tensor.file,
        )

    def read_small(self, tensor: StoredTensor) -> bytes:
        """The raw bytes of a small metadata tensor, read with pread: no mmap, no torch."""
        if tensor.nbytes > SMALL_TENSOR_LIMIT:
            raise CheckpointError(
                f"tensor {tensor.name!r} is {tensor.nbytes} bytes, too large to read as metadata",
                path=tensor.file,
            )
        try:
            data = os.pread(self._fd(tensor.file), tensor.nbytes, tensor.begin)
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=tensor.file) from None
        if len(data) != tensor.nbytes:
            raise self._cut_short(tensor)
        return data

    def read_bytes(
        self, tensor: StoredTensor, start: int = 0, size: int | None = None
    ) -> bytes | bytearray | memoryview:
        """`size` bytes of the tensor's data from byte `start` within it (all of it by default),
        with pread: no mmap pages stay resident. The one way to read a tensor's raw bytes that
        every container supports; containers whose tensors are not byte ranges of a file (see
        `StoredTensor.in_file`) override it."""
        from qtool.buffers import allocate  # here: listing a header reads no data

        size = tensor.nbytes - start if size is None else size
        if start < 0 or size < 0 or start + size > tensor.nbytes:
            raise ValueError(
                f"bytes [{start}, {start + size}) are outside tensor {tensor.name!r} of {tensor.nbytes} bytes"
            )
        buffer = allocate(size)
        view, offset = buffer, tensor.begin + start
        fd = self._fd(tensor.file)
        while view.nbytes:
            try:
                got = os.preadv(fd, [view], offset)
            except OSError as exc:
                raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=tensor.file) from None
            if got == 0:
                raise self._cut_short(tensor)
            view, offset = view[got:], offset + got
        return buffer

    def load(self, tensor: StoredTensor):  # -> torch.Tensor
        """The tensor's bytes as a torch tensor of its dtype and shape; sub-byte dtypes come back
        as raw uint8. Read with pread into a buffer of its own, not viewed through mmap: a page
        of a mapped file that shrank meanwhile is SIGBUS, which kills the process with no
        message, where a short read is a CheckpointError naming the file (`read_bytes`)."""
        import torch

        if tensor.nbytes == 0:
            dtype = torch.uint8 if tensor.dtype.torch_name is None else tensor.dtype.torch_dtype()
            return torch.empty(tensor.shape if tensor.dtype.torch_name else (0,), dtype=dtype)
        raw = torch.frombuffer(self.read_bytes(tensor), dtype=torch.uint8)
        if tensor.dtype.torch_name is None:
            return raw
        return raw.view(tensor.dtype.torch_dtype()).reshape(tensor.shape)

    def release(self, tensor: StoredTensor) -> None:
        """Done with a tensor's data. Reads are pread into buffers that go with their last
        reference, so there is nothing to give back here; containers that map may override."""

    def close(self) -> None:
        self._close_fds()

    def _close_fds(self) -> None:
        fds = getattr(self, "_fds", None) or {}
        while fds:
            _, fd = fds.popitem()
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:  # a checkpoint dropped without close() must not leak descriptors
        self._close_fds()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[StoredTensor]:
        return iter(self.tensors.values())


def _changed(file: str, how: str) -> CheckpointError:
    return CheckpointError(
        f"changed while it was read ({how}); nothing was written",
        path=file,
        hint="let whatever is writing it finish, then run qtool again",
    )
