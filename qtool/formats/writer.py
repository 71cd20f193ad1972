"""Write a container as a stream: the header first, from a plan, then each tensor's bytes.

No library does this: `safetensors.save_file` needs the whole state dict in memory. Here the
plan fixes every tensor's byte range up front, so the header is written before any data exists
and each tensor is written (in pieces, in any order) straight to its place. `LaidOutFile` does
this for any container whose layout is fixed up front; `safetensors_layout` builds the header
and ranges of a safetensors file, and a GGUF writer builds its own (header, kv, tensor infos,
padding, then data at aligned offsets).

Outputs are atomic (see `qtool.formats.staging`): everything goes to a staging name beside the
target, is fsynced, and is renamed into place only when complete, never over anything that
appeared meanwhile. An interrupted run leaves nothing under the final name, and its staging is
removed: by `abort()`, at exit, or by the next run after a SIGKILL. `--overwrite` replaces only
a previous checkpoint.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

from qtool import libc
from qtool.dtypes import nbytes_for, storage_dtype
from qtool.errors import CheckpointError, QtoolError, UsageError
from qtool.formats import staging
from qtool.formats.staging import abort_all, cleanup_stale

__all__ = [
    "OutTensor",
    "LaidOutFile",
    "ShardWriter",
    "Output",
    "INDEX_NAME",
    "safetensors_layout",
    "shard_name",
    "write_json_atomic",
    "stage_json",
    "StagedJson",
    "stage_file",
    "StagedFile",
    "cleanup_stale",
    "abort_all",
    "fsync_dir",
    "write_error",
]

INDEX_NAME = "model.safetensors.index.json"
_ALIGN = 8  # header padded to 8 bytes, as the reference writer does, so data is aligned
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


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
    glibc's posix_fallocate would emulate by writing every block) a sparse ftruncate. Either
    way the gaps between ranges (alignment padding) read as zeros. A size past off_t (a plan
    made from a stranger's shape) is the file system's "file too large", not an overflow."""
    if size >= 2**63:
        raise OSError(errno.EFBIG, f"{os.strerror(errno.EFBIG)} ({size} bytes)")
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
    return CheckpointError(
        f"cannot write: {exc.strerror or exc}",
        path=path,
        hint="check free space and permissions; nothing was left behind",
    )


def safetensors_layout(
    tensors: list[OutTensor], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The safetensors header of `tensors` in this order, each one's absolute byte range in the
    file, and the file's size: what `LaidOutFile` takes."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    relative: dict[str, tuple[int, int]] = {}
    offset = 0
    for tensor in tensors:
        end = offset + tensor.nbytes
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, end]}
        relative[tensor.name] = (offset, end)
        offset = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    head = struct.pack("<Q", len(raw)) + raw
    data_start = len(head)  # safetensors' data_offsets count from here
    ranges = {name: (data_start + begin, data_start + end) for name, (begin, end) in relative.items()}
    return head, ranges, data_start + offset


class LaidOutFile:
    """One file whose layout is fixed at construction: `header` at byte 0, then each tensor's
    bytes at `ranges[name] = (begin, end)`, ABSOLUTE byte offsets in the file, `size` bytes in
    all. Ranges lie after the header and do not overlap; gaps between them read as zeros.

    The file is created exclusively (mode 0o666 less the umask), its full size reserved up
    front, pieces are pwritten in any order and their write-back started at once; `finish()`
    checks every tensor got all its bytes, then fsyncs."""

    def __init__(self, path: str, header: bytes, ranges: dict[str, tuple[int, int]], size: int) -> None:
        self.path = path
        self.header = bytes(header)
        self.ranges = dict(ranges)
        self.size = size
        self.data_start = len(self.header)
        previous_end, previous = self.data_start, "the header"
        for name, (begin, end) in sorted(self.ranges.items(), key=lambda item: item[1]):
            if begin < previous_end or end < begin or end > size:
                raise ValueError(
                    f"{path}: tensor {name!r} at [{begin}, {end}) overlaps {previous} or lies outside the {size} bytes"
                )
            previous_end, previous = end, f"tensor {name!r}"
        if self.data_start > size:
            raise ValueError(f"{path}: a {self.data_start}-byte header does not fit in {size} bytes")
        self.written: dict[str, int] = {name: 0 for name in self.ranges}
        self.fd = -1
        try:
            self.fd = os.open(path, _CREATE, 0o666)
            _reserve(self.fd, size)
            self._pwrite(self.header, 0)
        except OSError as exc:
            self.close()
            raise write_error(path, exc) from None

    @property
    def finished(self) -> bool:
        return self.fd < 0

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    def write(self, name: str, data, at: int = 0) -> None:
        """Write `data` (bytes-like) at byte `at` of tensor `name`."""
        try:
            begin, end = self.ranges[name]
        except KeyError:
            raise RuntimeError(f"{self.path}: no tensor {name!r} in this file's layout") from None
        size = memoryview(data).nbytes
        if at < 0 or begin + at + size > end:
            raise RuntimeError(f"{name}: write of {size} bytes at {at} overruns its {end - begin} bytes")
        try:
            self._pwrite(data, begin + at)
        except OSError as exc:
            raise write_error(self.path, exc) from None
        _start_writeback(self.fd, begin + at, size)
        self.written[name] += size

    def finish(self) -> None:
        for name, got in self.written.items():
            begin, end = self.ranges[name]
            if got != end - begin:
                raise RuntimeError(f"{self.path}: tensor {name!r} got {got} of its {end - begin} bytes")
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise write_error(self.path, exc) from None
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShardWriter(LaidOutFile):
    """One safetensors file: `LaidOutFile` with the layout of `safetensors_layout`."""

    def __init__(self, path: str, tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> None:
        super().__init__(path, *safetensors_layout(tensors, metadata))


class Output:
    """A checkpoint being written: a folder (shards, index, side files) or one file.

    Everything is staged under a staging name beside the target and moved into place by
    `commit()`; `abort()` removes it. Checks at construction, before anything is written: an
    existing target is refused without `overwrite`, and with it, unless it is a previous
    checkpoint (`staging.check_replaceable`). Missing parent folders are created (and removed
    again by `abort()`), and stale staging entries of dead runs in the parent are removed.
    Usable as a context manager: an exception inside aborts.
    """

    def __init__(self, target: str, *, single_file: bool, overwrite: bool) -> None:
        self.shown = os.fspath(target)
        self.target = os.path.abspath(target)
        self.single_file = single_file
        self.overwrite = overwrite
        self.writers: list[LaidOutFile] = []
        self._done = False
        self._replacing = _existing(
            self.target, self.shown, single_file=single_file, overwrite=overwrite, what="output"
        )
        parent = os.path.dirname(self.target)
        self._created = staging.make_parents(parent, self.shown)
        cleanup_stale(parent)
        self.staging = staging.staging_path(self.target)
        staging.register(self.staging)  # before mkdir: an interrupt in between leaks nothing
        try:
            os.mkdir(self.staging, 0o777)  # an ordinary folder: the umask decides, as for any folder
        except OSError as exc:
            self.abort()
            raise write_error(self.target, exc) from None

    def _path(self, filename: str) -> str:
        if not filename or filename in (".", "..") or os.path.basename(filename) != filename:
            raise ValueError(f"{filename!r} is not a plain file name")
        return os.path.join(self.staging, filename)

    def file(self, filename: str, header: bytes, ranges: dict[str, tuple[int, int]], size: int) -> LaidOutFile:
        """A file of this output with a fixed layout (ranges are absolute offsets)."""
        writer = LaidOutFile(self._path(filename), header, ranges, size)
        self.writers.append(writer)
        return writer

    def shard(self, filename: str, tensors: list[OutTensor], metadata: dict[str, str] | None) -> ShardWriter:
        writer = ShardWriter(self._path(filename), tensors, metadata)
        self.writers.append(writer)
        return writer

    def side_file(self, filename: str, content: dict[str, Any]) -> None:
        path = self._path(filename)
        text = json.dumps(content, indent=2, ensure_ascii=False) + "\n"
        try:
            _write_new(path, text.encode("utf-8"))
        except OSError as exc:
            raise write_error(path, exc) from None

    def carry_side_file(self, filename: str, content: bytes) -> None:
        """Carry a small file (tokenizer, generation config) over unchanged: its bytes, read by
        the caller through one checked descriptor (qtool.side_files.read_carried), never
        opened here again by a path that may have been swapped meanwhile."""
        path = self._path(filename)
        try:
            _write_new(path, content)
        except OSError as exc:
            raise write_error(path, exc) from None

    def commit(self) -> None:
        """Finish every file, fsync, and move the output into place without replacing anything
        but the checkpoint checked at construction. On failure nothing is left but what was
        there before."""
        try:
            for writer in self.writers:
                if not writer.finished:
                    writer.finish()
            if self.single_file:
                if len(self.writers) != 1:
                    raise RuntimeError(f"a single-file output holds one file, not {len(self.writers)}")
                source = self.writers[0].path
            else:
                fsync_dir(self.staging)
                source = self.staging
            check_name = self.target if self.single_file else None

            def check(path: str) -> None:
                staging.check_replaceable(path, self.shown, single_file=self.single_file, name=check_name)

            old = staging.place(source, self.target, shown=self.shown, replacing=self._replacing, check=check)
            self._done = True
            fsync_dir(os.path.dirname(self.target))
        except OSError as exc:
            self.abort()
            raise write_error(self.target, exc) from None
        except BaseException:
            self.abort()
            raise
        if old is not None and old != self.staging:
            staging.remove(old)
        staging.remove(self.staging)  # emptied (one file), the old output (exchanged), or gone

    def abort(self) -> None:
        """Remove the staging (and the parent folders this output created). Idempotent; after
        a successful commit it only tidies up."""
        for writer in self.writers:
            writer.close()
        staging.remove(self.staging)
        if not self._done:
            staging.remove_created(self._created)
            self._created = []

    def __enter__(self) -> Output:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()


def _existing(target: str, shown: str, *, single_file: bool, overwrite: bool, what: str) -> tuple[int, int] | None:
    """The (st_dev, st_ino) of what `overwrite` will replace at `target`, None if nothing is
    there; raises UsageError when something is there that may not be replaced."""
    try:
        st = os.lstat(target)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: make_parents names the file
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot check {what} {shown}: {exc.strerror or exc}") from None
    if not overwrite:
        raise UsageError(
            f"{what} {shown} already exists",
            hint="allow overwriting to replace it, or choose another output path",
            option="overwrite",
        )
    staging.check_replaceable(target, shown, single_file=single_file)
    return st.st_dev, st.st_ino


def _write_new(path: str, data: bytes) -> None:
    """Create `path` (exclusively, mode 0o666 less the umask), write `data` and fsync it."""
    fd = os.open(path, _CREATE, 0o666)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class StagedFile:
    """A report file (JSON, HTML) written in full beside its target (fsynced), but not yet in
    place: `commit()` renames it there (never replacing anything that appeared meanwhile; with
    `overwrite`, an existing file is replaced, never a folder), `abort()` removes it. A report is
    staged before the output is committed, so a full disk fails the run, not the report."""

    def __init__(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        self.shown = os.fspath(path)
        self.target = os.path.abspath(path)
        self.overwrite = overwrite
        if os.path.lexists(self.target):
            if not overwrite:
                raise UsageError(
                    f"report {self.shown} already exists",
                    hint="allow overwriting to replace it, or choose another path",
                    option="overwrite",
                )
            if not stat.S_ISREG(os.lstat(self.target).st_mode):  # a folder, a link, a device, a FIFO
                raise UsageError(
                    f"report {self.shown} is not a regular file; refusing to replace it",
                    hint="choose another path",
                    option="report",
                )
        self.parent = os.path.dirname(self.target)
        self.created = staging.make_parents(self.parent, self.shown, "report")
        cleanup_stale(self.parent)
        self.temp = staging.staging_path(self.target)
        staging.register(self.temp)
        try:
            _write_new(self.temp, data)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise write_error(self.shown, exc) from None
            raise

    def commit(self) -> None:
        try:
            if self.overwrite:
                os.replace(self.temp, self.target)
            else:
                try:
                    staging.rename_noreplace(self.temp, self.target)
                except FileExistsError:
                    raise UsageError(
                        f"report {self.shown} appeared while writing; nothing was replaced", hint="choose another path"
                    ) from None
            staging.remove(self.temp)  # gone already: this only forgets it
            fsync_dir(self.parent)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise write_error(self.shown, exc) from None
            raise

    def abort(self) -> None:
        staging.remove(self.temp)
        staging.remove_created(self.created)


class StagedJson(StagedFile):
    """A JSON document, staged as a `StagedFile`."""

    def __init__(self, path: str, document: Any, *, overwrite: bool = False) -> None:
        super().__init__(path, (json.dumps(document, indent=2) + "\n").encode("utf-8"), overwrite=overwrite)


def stage_json(path: str, document: Any, *, overwrite: bool = False) -> StagedJson:
    """Write `document` beside `path`, ready to `commit()` into place (see StagedJson)."""
    return StagedJson(path, document, overwrite=overwrite)


def stage_file(path: str, data: bytes, *, overwrite: bool = False) -> StagedFile:
    """Write `data` beside `path`, ready to `commit()` into place (see StagedFile)."""
    return StagedFile(path, data, overwrite=overwrite)


def write_json_atomic(path: str, document: Any, *, overwrite: bool = False) -> None:
    """Write a JSON report: a staging file beside `path`, fsynced, then renamed into place
    without replacing anything (with `overwrite`, an existing report file is replaced, never a
    folder). Missing parent folders are created. On any error, including a full disk, nothing is
    left behind and `path` is as it was."""
    stage_json(path, document, overwrite=overwrite).commit()


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
