"""Write safetensors as a stream: the header first, from a plan, then each tensor's bytes.

No library does this: `safetensors.save_file` needs the whole state dict in memory. Here the
plan fixes every tensor's dtype, shape and so its byte range up front, so the header is written
before any data exists and each tensor is written (in pieces, in any order) straight to its place.

Outputs are atomic: everything goes to a temporary name beside the target, is fsynced, and is
renamed into place only when complete. An interrupted run leaves no file under the final name.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

from qtool import libc
from qtool.dtypes import nbytes_for, storage_dtype
from qtool.errors import CheckpointError, QtoolError, UsageError

__all__ = ["OutTensor", "ShardWriter", "Output", "INDEX_NAME", "shard_name", "fsync_dir", "write_error"]

INDEX_NAME = "model.safetensors.index.json"
_ALIGN = 8  # header padded to 8 bytes, as the reference writer does, so data is aligned


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        size = nbytes_for(storage_dtype(self.dtype), count)
        if size is None:
            raise ValueError(f"{self.name}: {count} elements of {self.dtype} do not fill whole bytes")
        return size


_sync_file_range = libc.function("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))
_fallocate = libc.function("fallocate", (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64))
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, size: int) -> None:
    """Start writing a range to disk now, without waiting. Called after each piece, it lets the
    disk work while qtool computes, so the final fsync waits for the tail of the file rather
    than all of it (a 2 GB output on a 500 MB/s disk: ~4 s of fsync at the end otherwise).
    Advisory: where the call is missing or fails, fsync does it all."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, size, _SYNC_FILE_RANGE_WRITE)


def _reserve(fd: int, size: int) -> None:
    """Give the file its full size. Linux's fallocate reserves the blocks too, so a disk that
    cannot hold the output fails here, before any data is written, and write-back goes to
    extents allocated in one piece. Elsewhere (or where the filesystem has no fallocate, which
    glibc's posix_fallocate would emulate by writing every block) a sparse ftruncate."""
    if _fallocate is not None and size > 0:
        if _fallocate(fd, 0, 0, size) == 0:
            return
        error = ctypes.get_errno()
        if error in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(error, os.strerror(error))
    os.ftruncate(fd, size)


def shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_error(path: str, exc: OSError) -> QtoolError:
    return CheckpointError(f"cannot write: {exc.strerror or exc}", path=path, hint="check free space and permissions; nothing was left behind")


class ShardWriter:
    """One safetensors file whose layout is fixed at construction."""

    def __init__(self, path: str, tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> None:
        self.path = path
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = metadata
        self.ranges: dict[str, tuple[int, int]] = {}
        offset = 0
        for tensor in tensors:
            end = offset + tensor.nbytes
            header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, end]}
            self.ranges[tensor.name] = (offset, end)
            offset = end
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % _ALIGN)
        self.header = struct.pack("<Q", len(raw)) + raw
        self.data_start = len(self.header)
        self.size = self.data_start + offset
        self.written: dict[str, int] = {name: 0 for name in self.ranges}
        self.fd = -1
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            _reserve(self.fd, self.size)
            self._pwrite(self.header, 0)
        except OSError as exc:
            self.close()
            raise write_error(path, exc) from None

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    def write(self, name: str, data, at: int = 0) -> None:
        """Write `data` (bytes-like) at byte `at` of tensor `name`."""
        begin, end = self.ranges[name]
        size = memoryview(data).nbytes
        if begin + at + size > end:
            raise RuntimeError(f"{name}: write of {size} bytes at {at} overruns its {end - begin} bytes")
        try:
            self._pwrite(data, self.data_start + begin + at)
        except OSError as exc:
            raise write_error(self.path, exc) from None
        _start_writeback(self.fd, self.data_start + begin + at, size)
        self.written[name] += size

    def finish(self) -> None:
        short = {n: (w, self.ranges[n][1] - self.ranges[n][0]) for n, w in self.written.items() if w != self.ranges[n][1] - self.ranges[n][0]}
        if short:
            name, (got, want) = next(iter(short.items()))
            raise RuntimeError(f"{self.path}: tensor {name!r} got {got} of its {want} bytes")
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise write_error(self.path, exc) from None
        finally:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Output:
    """A checkpoint being written: a folder (shards, index, side files) or one .safetensors file.

    Everything is staged in a temporary folder beside the target and moved into place by
    `commit()`. `abort()` removes the staging folder.
    """

    def __init__(self, target: str, *, single_file: bool, overwrite: bool) -> None:
        self.target = os.path.abspath(target)
        self.single_file = single_file
        self.overwrite = overwrite
        if os.path.lexists(self.target) and not overwrite:
            raise UsageError(f"output {target} already exists", hint="pass --overwrite to replace it, or choose another -o")
        parent = os.path.dirname(self.target)
        if not os.path.isdir(parent):
            raise UsageError(f"output folder {parent} does not exist", hint="create it first")
        try:
            self.staging = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.qtool-tmp-", dir=parent)
            os.chmod(self.staging, 0o777 & ~_umask())  # mkdtemp makes it 0700; the output is an ordinary folder
        except OSError as exc:
            raise write_error(self.target, exc) from None
        self.writers: list[ShardWriter] = []

    def shard(self, filename: str, tensors: list[OutTensor], metadata: dict[str, str] | None) -> ShardWriter:
        writer = ShardWriter(os.path.join(self.staging, filename), tensors, metadata)
        self.writers.append(writer)
        return writer

    def side_file(self, filename: str, content: dict[str, Any]) -> None:
        path = os.path.join(self.staging, filename)
        try:
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(content, handle, indent=2, ensure_ascii=False)
                handle.write("\n")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise write_error(path, exc) from None

    def copy_side_file(self, source: str, filename: str) -> None:
        """Carry a small file (tokenizer, generation config) over unchanged."""
        try:
            shutil.copyfile(source, os.path.join(self.staging, filename))
        except OSError as exc:
            raise write_error(os.path.join(self.staging, filename), exc) from None

    def commit(self) -> None:
        for writer in self.writers:
            if writer.fd >= 0:
                writer.finish()
        try:
            if self.single_file:
                (only,) = self.writers
                os.replace(only.path, self.target)  # atomic, replaces an existing file
                shutil.rmtree(self.staging, ignore_errors=True)
            else:
                fsync_dir(self.staging)
                backup = None
                if os.path.lexists(self.target):
                    backup = self.staging + ".old"
                    os.rename(self.target, backup)
                os.rename(self.staging, self.target)
                if backup:
                    (shutil.rmtree if os.path.isdir(backup) else os.remove)(backup)
            fsync_dir(os.path.dirname(self.target))
        except OSError as exc:
            self.abort()
            raise write_error(self.target, exc) from None

    def abort(self) -> None:
        for writer in self.writers:
            writer.close()
        shutil.rmtree(self.staging, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
