"""The two containers `torch.save` writes, read without torch and without running code: the
pickle interpreted (`qtool.formats.pickle_machine`, the allowlist of
`qtool.formats.torch_unpickle`) and where each storage's bytes lie in the file.

- **zip** (`torch.save` since PyTorch 1.6): `<root>/data.pkl` is the pickle, each storage an
  uncompressed record `<root>/data/<key>`, `<root>/byteorder` says "little" or "big". The
  central directory gives every member's size and place (`qtool.formats.zip_directory`);
  only `data.pkl` is inflated, with a size cap.
- **legacy** (before 1.6, or `_use_new_zipfile_serialization=False`): five pickles in a row
  (magic number, protocol 1001, sys_info, the object, the sorted storage keys), then each
  storage as an 8-byte element count and its raw bytes, in key order.

A TorchScript archive (`constants.pkl`, `code/`) is named as such from the zip listing and
refused. What the object graph means (which dict is the state dict, what each tensor is) is
`qtool.formats.torch_pickle`'s.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any

from qtool.errors import CheckpointError
from qtool.formats.pickle_machine import (
    OverLimit,
    PDict,
    PickleError,
    Truncated,
    interpret,
)
from qtool.formats.torch_unpickle import (
    ITEMSIZE,
    Refused,
    Storage,
    TorchHooks,
)
from qtool.formats.zip_directory import ZipDirectory, ZipError

__all__ = [
    "PICKLE_LIMIT",
    "MAX_ALIASES",
    "TorchArchive",
    "open_archive",
    "pickled_value",
]

PICKLE_LIMIT = 32 << 20  # bytes of pickle (data.pkl): some 250,000 tensors (about 130 bytes and 16 objects each)
# Names of a tensor already listed (tied weights: a few; ALBERT's shared layers: hundreds). A
# memoized tensor costs 7 bytes a name in the pickle and a stored-tensor record in memory, so a
# 32 MB pickle could name one tensor 4.5M times: past this many, the file is refused.
MAX_ALIASES = 65_536
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_HINT = "qtool reads PyTorch checkpoints as torch.save writes them (zip, or the legacy format before 1.6)"
_REFUSED_HINT = (
    "if you trust the file, load it yourself and re-save only its tensors: torch.save(model.state_dict(), ...)"
)


@dataclass
class TorchArchive:
    """One file's pickle, interpreted, and where each storage's bytes are."""

    path: str
    size: int
    root: Any = None
    little_endian: bool = True
    records: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (data offset, bytes)


def open_archive(path: str) -> TorchArchive:
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        )  # a FIFO opens at once, refused below
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(
                "cannot read: it is not a regular file",
                path=path,
                hint="pass the .pt/.pth/.bin file or the folder that holds it",
            )
        os.set_blocking(fd, True)
        size = info.st_size
        if size == 0:
            raise CheckpointError(
                "file is empty (0 bytes)",
                path=path,
                hint="the download or save did not finish; fetch or save it again",
            )
        head = os.pread(fd, 512, 0)
        archive = TorchArchive(path, size)
        try:
            if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
                _read_zip(fd, archive)
            elif head[:1] == b"\x80":
                _read_legacy(fd, archive)
            elif head[257:262] == b"ustar":
                raise CheckpointError(
                    "is a legacy tar-format PyTorch file (PyTorch before 0.4), which qtool does not read",
                    path=path,
                    hint="re-save it with a current torch.save, from a source you trust",
                )
            else:
                raise CheckpointError(
                    "is not a PyTorch checkpoint (neither a zip archive nor a pickle)",
                    path=path,
                    hint=_HINT,
                )
        except ZipError as exc:
            raise CheckpointError(f"cannot read the archive: {exc}", path=path, hint=_HINT) from None
        except Refused as exc:
            raise CheckpointError(
                f"refused: the pickle calls {exc.name}, which is not tensor data; qtool never runs code from a checkpoint",
                path=path,
                hint=_REFUSED_HINT,
            ) from None
        except OverLimit as exc:
            raise CheckpointError(
                f"is over qtool's limits: {exc}",
                path=path,
                hint="save each tensor once (tied weights under a few names are fine)",
            ) from None
        except PickleError as exc:
            raise CheckpointError(f"has a malformed pickle: {exc}", path=path, hint=_HINT) from None
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from None
        return archive
    finally:
        os.close(fd)


def _read_zip(fd: int, archive: TorchArchive) -> None:
    directory = ZipDirectory(fd, archive.size)
    names = directory.order
    if not names:
        raise CheckpointError("is an empty zip archive", path=archive.path, hint=_HINT)
    root = names[0].split("/", 1)[0]  # torch.save's archive name: the first member's folder
    if f"{root}/data.pkl" not in directory.members:
        root = next(
            (n[: -len("/data.pkl")] for n in names if n.endswith("/data.pkl") and n.count("/") == 1),
            root,
        )
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        raise CheckpointError(
            "a TorchScript archive: qtool reads state dicts, not scripted modules",
            path=archive.path,
            hint="in Python, load it with torch.jit.load and save its state_dict() with torch.save",
        )
    pickle_member = directory.members.get(f"{root}/data.pkl")
    if pickle_member is None:
        raise CheckpointError(
            "is a zip archive without a data.pkl: not a PyTorch checkpoint",
            path=archive.path,
            hint=_HINT,
        )
    byteorder = directory.members.get(f"{root}/byteorder")
    if byteorder is not None:
        order = directory.read_member(byteorder, 16).strip()
        if order not in (b"little", b"big"):
            raise CheckpointError(
                f"has an unknown byteorder {order[:16]!r}",
                path=archive.path,
                hint=_HINT,
            )
        archive.little_endian = order == b"little"
    data = directory.read_member(pickle_member, PICKLE_LIMIT)
    storages: dict[tuple[str, str], Storage] = {}

    def storage_for(key: str, dtype: str, numel: int, view: Any) -> Storage:
        found = storages.get((key, dtype))
        if found is not None:
            if found.numel != numel:
                raise PickleError(f"storage {key!r} is declared with {found.numel} and {numel} elements")
            return found
        if view is not None:
            raise PickleError(f"storage {key!r} is a legacy storage view inside a zip archive")
        member = directory.members.get(f"{root}/data/{key}")
        if member is None:
            raise CheckpointError(
                f"the pickle names storage {key!r}, which has no record data/{key} in the archive",
                path=archive.path,
                hint=_HINT,
            )
        if not member.stored:
            raise CheckpointError(
                f"stores tensor data compressed (record data/{key}); qtool maps only uncompressed records, as torch.save writes them",
                path=archive.path,
                hint="re-save it with torch.save",
            )
        storage = Storage(key, dtype, numel)
        if member.size != storage.nbytes:
            raise CheckpointError(
                f"storage {key!r} is declared as {numel} {dtype} elements ({storage.nbytes} bytes), but its record holds {member.size} bytes",
                path=archive.path,
                hint="the file is damaged; fetch or save it again",
            )
        archive.records[key] = (directory.data_offset(member), member.size)
        storages[(key, dtype)] = storage
        return storage

    archive.root, end = interpret(data, TorchHooks(storage_for), max_references=MAX_ALIASES)
    if end != len(data):
        raise PickleError(f"data.pkl holds {len(data) - end} bytes after the pickle's STOP")


def _read_legacy(fd: int, archive: TorchArchive) -> None:
    """The pre-1.6 format: pickles in a row, then the storages, each after an 8-byte count."""
    roots: dict[str, Storage] = {}
    views: dict[tuple[str, str, int, int], Storage] = {}

    def storage_for(key: str, dtype: str, numel: int, view: Any) -> Storage:
        root = roots.get(key)
        if root is None:
            root = roots[key] = Storage(key, dtype, numel)
        elif root.nbytes != numel * ITEMSIZE[dtype]:
            raise PickleError(f"storage {key!r} is declared with {root.nbytes} and {numel * ITEMSIZE[dtype]} bytes")
        if view is None:
            if dtype == root.dtype:
                return root
            found = views.setdefault((key, dtype, 0, numel), Storage(key, dtype, numel))
            return found
        if (
            not isinstance(view, tuple)
            or len(view) != 3
            or not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in view)
        ):
            raise PickleError(f"storage {key!r} has a malformed view")
        _, offset, size = view
        if not isinstance(offset, int) or not isinstance(size, int) or offset < 0 or size < 0 or offset + size > numel:
            raise PickleError(f"storage {key!r} has a view [{offset}, +{size}) outside its {numel} elements")
        return views.setdefault(
            (key, dtype, offset, size),
            Storage(key, dtype, size, element_offset=offset, root_numel=numel),
        )

    reader = _LegacyReader(fd, archive.size)
    magic = reader.next(None)
    if magic != _LEGACY_MAGIC or isinstance(magic, bool):
        raise CheckpointError(
            "is a pickle, but not a PyTorch checkpoint (no torch.save magic number)",
            path=archive.path,
            hint=_HINT,
        )
    if reader.next(None) != _LEGACY_PROTOCOL:
        raise CheckpointError(
            "is a legacy PyTorch file of an unknown protocol version",
            path=archive.path,
            hint=_HINT,
        )
    info = reader.next(None)
    little = pickled_value(info, "little_endian") if isinstance(info, PDict) else None
    if little is not True:
        raise CheckpointError(
            "is a big-endian legacy PyTorch file, which qtool does not read",
            path=archive.path,
            hint="re-save it with a current torch.save",
        )
    archive.root = reader.next(TorchHooks(storage_for))
    keys = reader.next(None)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise PickleError("the legacy storage key list is not a list of strings")
    position = reader.position
    seen: set[str] = set()
    for key in keys:
        root = roots.get(key)
        if root is None or key in seen:
            raise PickleError(f"the legacy storage list names {key!r}, which no tensor uses or which is listed twice")
        seen.add(key)
        header = os.pread(fd, 8, position)
        if len(header) != 8:
            raise CheckpointError(
                f"is cut short: storage {key!r} should start at byte {position}, the file ends at {archive.size}",
                path=archive.path,
            )
        (count,) = struct.unpack("<q", header)
        if count * root.itemsize != root.nbytes:
            raise CheckpointError(
                f"storage {key!r} is declared as {root.numel} elements, its data as {count}",
                path=archive.path,
                hint="the file is damaged",
            )
        start = position + 8
        if start + root.nbytes > archive.size:
            raise CheckpointError(
                f"is cut short: storage {key!r} ends at byte {start + root.nbytes}, the file at {archive.size}",
                path=archive.path,
            )
        archive.records[key] = (start, root.nbytes)
        position = start + root.nbytes
    missing = [key for key in roots if key not in seen]
    if missing:
        raise CheckpointError(
            f"the pickle names storage {missing[0]!r}, which has no data in the file",
            path=archive.path,
            hint=_HINT,
        )


class _LegacyReader:
    """Consecutive pickles from the start of a file, read in growing chunks: only the pickles'
    bytes are read, never the storages behind them, and at most PICKLE_LIMIT in all."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.position = 0
        self.buffer = b""  # the file's bytes from 0

    def next(self, hooks: TorchHooks | None) -> Any:
        want = max(len(self.buffer), 1 << 16)
        while True:
            if len(self.buffer) < min(want, self.size, PICKLE_LIMIT):
                more = os.pread(
                    self.fd,
                    min(want, self.size, PICKLE_LIMIT) - len(self.buffer),
                    len(self.buffer),
                )
                self.buffer += more
            try:
                value, end = interpret(
                    self.buffer,
                    hooks or _NoGlobals(),
                    start=self.position,
                    max_references=MAX_ALIASES,
                )
            except Truncated:
                if len(self.buffer) >= min(self.size, PICKLE_LIMIT):
                    if len(self.buffer) >= PICKLE_LIMIT:
                        raise PickleError(
                            f"the legacy pickles are longer than qtool's limit of {PICKLE_LIMIT} bytes"
                        ) from None
                    raise
                want = len(self.buffer) * 4
                continue
            self.position = end
            return value


class _NoGlobals:
    """Hooks for the legacy header pickles: plain data only."""

    def find_class(self, module: str, name: str) -> Any:
        raise Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise PickleError("a persistent id in a legacy header pickle")

    def call(self, func: Any, args: tuple) -> Any:
        raise PickleError("a call in a legacy header pickle")

    def build(self, obj: Any, state: Any) -> Any:
        raise PickleError("BUILD in a legacy header pickle")


def pickled_value(value: PDict, key: str) -> Any:
    """A pickled dict's value under a text key, as a dict would hold it: the last one."""
    for k, v in reversed(value.items):
        if k == key and isinstance(k, str):
            return v
    return None
