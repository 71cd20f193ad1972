"""Read GGUF headers (CONVENTIONS §10) without touching tensor data.

    "GGUF" | u32 version (2, 3) | u64 tensor_count | u64 kv_count
    kv_count × (string key, u32 value type, value)          string = u64 length + UTF-8 bytes
    tensor_count × (string name, u32 n_dims, n_dims × u64 ne, u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then the data; offsets are relative to it

Dims are stored fastest first (ggml's `ne`); qtool reports them reversed, in PyTorch order.
Plain types (F32, F16, BF16, I8..I64, F64) become ordinary stored tensors. Block-quantized
types become raw bytes (dtype U8, shape `(nbytes,)`) with `encoding` set to the type name
and `logical_shape` set, for `qtool.conventions.gguf` to read.

Why not `gguf.GGUFReader`: it builds one numpy view per metadata array element, which took
21.6 s on this machine for a header with a 152k-token vocabulary and 150k merges (this parser:
well under a second); it raises on a type id it doesn't know, where a newer file must stay
readable; and a truncated file surfaces as a numpy reshape error. The checks below follow
llama.cpp's `gguf_init_from_file_impl` (ggml/src/gguf.cpp); a file it refuses, we refuse.
One more: dims whose non-zero product overflows int64 ([0, 64, 2^62], which llama.cpp accepts as
empty) are refused, since torch and numpy cannot build them. Every count is checked against the
bytes left before a loop runs, and a tensor of an unknown type is sized by a bisect of the starts.
This module imports neither numpy nor torch, so `qtool inspect x.gguf` costs the header only.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import mmap
import os
import struct
from typing import Any
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qtool.dtypes import DTYPES, StorageDType
from qtool.errors import CheckpointError
from qtool.formats.checkpoint import StoredTensor, dims_fit_int64
from qtool.ggml_types import ggml_type

__all__ = [
    "read_gguf_file",
    "read_gguf_key_values",
    "parse_gguf_prefix",
    "NeedMore",
    "StringArray",
    "use_prefixed_walk",
    "GGUF_MAGIC",
    "MAX_DIMS",
]

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)
SHORT_ARRAY = 8  # arrays up to this many scalars are shown in full; longer ones as "[n × type]"
MAX_ARRAY_DEPTH = 8  # nested arrays (which llama.cpp refuses outright) deeper than this are corrupt
_HINT = "the file is not a valid GGUF file; re-download it, or check that the copy finished"


_PLAIN: dict[int, StorageDType] = {d.gguf_id: d for d in DTYPES.values() if d.gguf_id is not None}


# -- the header parser ---------------------------------------------------------------------------

# GGUF value type id -> (short name, struct format); 8 = string and 9 = array are handled apart
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("u8", "<B"),
    1: ("i8", "<b"),
    2: ("u16", "<H"),
    3: ("i16", "<h"),
    4: ("u32", "<I"),
    5: ("i32", "<i"),
    6: ("f32", "<f"),
    7: ("bool", "<?"),
    10: ("u64", "<Q"),
    11: ("i64", "<q"),
    12: ("f64", "<d"),
}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {**{k: v[0] for k, v in _SCALARS.items()}, _STRING: "str", _ARRAY: "array"}


class NeedMore(Exception):
    """Parsing a prefix of a file reached its end: the header needs the first `size` bytes."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf, size: int, path: str, available: int | None = None) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0
        # Bytes of the file in `buf`: all of it locally; a prefix for a remote file, whose reader
        # fetches more when a read past it raises NeedMore.
        self.available = size if available is None else available
        # (device, inode, size, mtime_ns) of a local file, so a string array walked once in this
        # process is not walked again (see _walked); None for a remote prefix
        self.identity: tuple[int, int, int, int] | None = None

    def fail(self, message: str) -> CheckpointError:
        return CheckpointError(message, path=self.path, hint=_HINT)

    def need(self, count: int, what: str) -> int:
        start = self.pos
        if count < 0 or start + count > self.size:
            raise self.fail(f"file is cut short: {what} at byte {start} needs {count} bytes, the file has {self.size}")
        if start + count > self.available:
            raise NeedMore(start + count)
        self.pos = start + count
        return start

    def unpack(self, fmt: str, what: str):
        start = self.need(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self, what: str) -> bytes:
        length = self.unpack("<Q", what)
        start = self.need(length, what)
        return bytes(self.buf[start : start + length])

    def room_for(self, count: int, least: int, what: str) -> None:
        """Fail at once when `count` items of at least `least` bytes can't fit in the rest of
        the file, rather than walking a corrupt count item by item."""
        if count * least > self.size - self.pos:
            raise self.fail(
                f"file is cut short: {count} entries of {what} need at least {count * least} bytes, {self.size - self.pos} are left"
            )

    def skip_strings(self, count: int, what: str) -> None:
        self.room_for(count, 8, what)
        buf, size, pos = self.buf, self.size, self.pos
        available = self.available
        length_at = _U64.unpack_from
        walked = None if self.identity is None else (*self.identity, pos, count)
        if walked is not None and walked in _walked:
            self.pos = _walked[walked]
            return
        past_end = f"file is cut short: {what} runs past the end of the file ({size} bytes)"
        end = _prefixed_walk(buf, pos, count) if available == size and _prefixed_walk is not None else None
        if end is not None:  # all of it at hand, walked in C
            if end < 0 or end > size:
                raise self.fail(past_end)
            pos = end
        elif available == size:  # all of it at hand: no check per string, the buffer's end is one
            try:
                for _ in range(count):  # a 49k-entry vocabulary walks in ~15 ms
                    pos += 8 + length_at(buf, pos)[0]
            except (struct.error, OverflowError):  # a length before the last one ran past the end (or past any offset)
                raise self.fail(past_end) from None
            if pos > size:
                raise self.fail(past_end)
        else:
            for _ in range(count):
                if pos + 8 > available:
                    self.pos = pos
                    self.need(8, what)
                pos += 8 + length_at(buf, pos)[0]
                if pos > size:
                    raise self.fail(past_end)
        self.pos = pos
        if walked is not None:
            if len(_walked) >= _WALKED_MAX:
                _walked.clear()
            _walked[walked] = pos

    def string_array(self, count: int, what: str) -> StringArray:
        """`count` strings as the file stores them, bounds-checked by one walk over their
        lengths, copied in one slice (a 49k-token vocabulary: one walk, where splitting it into
        49k bytes objects took four times as long, and packing them again as long once more)."""
        start = self.pos
        self.skip_strings(count, what)
        return StringArray(bytes(self.buf[start : self.pos]), count)

    def value(self, kind: int, key: str) -> str:
        """Read one metadata value and return how `inspect` shows it."""
        if kind in _SCALARS:
            return _show_scalar(kind, self.unpack(_SCALARS[kind][1], f"the value of {key!r}"))
        if kind == _STRING:
            return self.string(f"the value of {key!r}").decode("utf-8", errors="backslashreplace")
        if kind == _ARRAY:
            item = self.unpack("<I", f"the array type of {key!r}")
            count = self.unpack("<Q", f"the array length of {key!r}")
            return self._array(item, count, key, depth=1)
        raise self.fail(f"key {key!r} has invalid GGUF value type {kind}")

    def _array(self, item: int, count: int, key: str, depth: int) -> str:
        what = f"the array {key!r}"
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"array {key!r} nests deeper than {MAX_ARRAY_DEPTH} levels")
        if item in _SCALARS:
            name, fmt = _SCALARS[item]
            width = struct.calcsize(fmt)
            start = self.need(width * count, what)
            if count > SHORT_ARRAY:
                return f"[{count} × {name}]"
            values = struct.unpack_from(f"<{count}{fmt[1]}", self.buf, start)
            return "[" + ", ".join(_show_scalar(item, v) for v in values) + "]"
        if item == _STRING:
            if count > SHORT_ARRAY:
                self.skip_strings(count, what)
                return f"[{count} × str]"
            self.room_for(count, 8, what)
            texts = [self.string(what).decode("utf-8", errors="backslashreplace") for _ in range(count)]
            return "[" + ", ".join(json.dumps(t, ensure_ascii=False) for t in texts) + "]"
        if item == _ARRAY:  # llama.cpp refuses nested arrays; gguf-py writes them. Walk, summarize.
            self.room_for(count, 12, what)
            for _ in range(count):
                inner = self.unpack("<I", what)
                self._array(inner, self.unpack("<Q", what), key, depth + 1)
            return f"[{count} × array]"
        raise self.fail(f"array {key!r} has invalid GGUF value type {item}")


# The walk over a string array's lengths in C, where a layer above has it to give: formats sit
# below qtool.native and may not import it, so `qtool.api` hands its `skip_prefixed` in
# (`use_prefixed_walk`). (buffer, position, count) -> the position past the strings, -1 where
# one runs past the buffer's end, or None (no extension: the loop above walks them).
_prefixed_walk: Callable[[Any, int, int], int | None] | None = None


def use_prefixed_walk(walk: Callable[[Any, int, int], int | None] | None) -> None:
    """Walk string arrays with `walk` (None: in Python). The results are the same either way."""
    global _prefixed_walk
    _prefixed_walk = walk


class StringArray(Sequence):
    """A GGUF array of strings in the file's own encoding: `count` strings, each a u64 length
    then its bytes, back to back in `raw`. Why: a GGUF requantize writes a tokenizer's 49k-150k
    strings back unchanged, so they are kept as one bytes object and written as one, and split
    into items (bytes) only when an item is asked for. Equal to any sequence of the same items."""

    __slots__ = ("raw", "count", "_items")

    def __init__(self, raw: bytes, count: int) -> None:
        self.raw, self.count, self._items = raw, count, None

    def items(self) -> list[bytes]:
        if self._items is None:
            raw, length_at, pos, out = self.raw, _U64.unpack_from, 0, []
            for _ in range(self.count):
                start = pos + 8
                pos = start + length_at(raw, pos)[0]
                out.append(raw[start:pos])
            self._items = out
        return self._items

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        return self.items()[index]

    def __iter__(self):
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self.count == other.count and self.raw == other.raw
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes, bytearray)):
            return self.items() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable as they are

    def __repr__(self) -> str:
        return f"StringArray({self.count} strings, {len(self.raw)} bytes)"

    def __reduce__(self):
        return (StringArray, (self.raw, self.count))


_U64 = struct.Struct("<Q")
# (device, inode, size, mtime_ns, offset, count) -> where a string array of a local file ends,
# for the arrays walked in this process: planning a GGUF requantize reads the header twice (the
# listing, then the key-values), and a second walk of a 49k-token vocabulary and its merges cost
# as much as the first. Another version of the file has another key.
_walked: dict[tuple[int, ...], int] = {}
_WALKED_MAX = 64


def _show_scalar(kind: int, value) -> str:
    if kind == 7:
        return "true" if value else "false"
    if kind == 6:  # the shortest text that reads back as the same float32
        if math.isfinite(value):
            for digits in range(6, 10):
                text = f"{value:.{digits}g}"
                if struct.unpack("<f", struct.pack("<f", float(text)))[0] == value:
                    return text
        return repr(value)
    if kind == 12:
        return repr(value)
    return str(value)


@dataclass(frozen=True)
class _Info:
    name: str
    dims: tuple[int, ...]  # ne order: fastest first
    type_id: int
    offset: int


def read_gguf_file(path: str) -> tuple[list[StoredTensor], dict[str, str]]:
    """The stored tensors of one GGUF file, in file order, and its metadata as display strings."""
    fd, info = _open_checked(path)
    try:
        size = info.st_size
        if size == 0:
            raise CheckpointError("file is empty (0 bytes)", path=path, hint=_HINT)
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        identity = _identity(info)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from None
    finally:
        os.close(fd)
    try:
        cur = _Cursor(mapped, size, path)
        cur.identity = identity if identity[2] == size else None
        return _parse(cur)
    finally:
        mapped.close()


def _open_checked(path: str) -> tuple[int, os.stat_result]:
    """One descriptor of the regular file `path` (a FIFO is never waited on, a device never
    mapped: `regular_files.open_regular`) and its stat."""
    from qtool.formats.regular_files import NotReadable, open_regular

    try:
        return open_regular(path)
    except NotReadable as exc:
        raise CheckpointError(f"cannot read: {exc}", path=path, hint=_HINT) from None


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


# GGUF value type id -> gguf-py's GGUFValueType name, which the GGUF layout writes back
_VALUE_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}  # fmt: skip


def read_gguf_key_values(path: str) -> list[tuple[str, object, str]]:
    """Every key-value of a GGUF file (see `_read_key_values`), read once per version of the
    file: planning a GGUF output asks twice (the mix's model facts, the metadata written)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from None
    return _cached_key_values(path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_key_values(path: str, *identity: int) -> list[tuple[str, object, str]]:
    return _read_key_values(path)


def _read_key_values(path: str) -> list[tuple[str, object, str]]:
    """Every key-value of a GGUF file, in order, with its exact type, for writing them back:
    (key, value, type name) with strings as their bytes, arrays of numbers as lists and arrays
    of strings as a `StringArray`, whose type reads "ARRAY:<element type>". The same
    bounds-checked cursor as the listing (a 32k vocabulary in tens of ms, where gguf-py's
    reader takes seconds). Nested arrays, which llama.cpp refuses,
    raise a CheckpointError saying so."""
    fd, info = _open_checked(path)
    try:
        size = info.st_size
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
        identity = _identity(info)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from None
    finally:
        os.close(fd)
    cur = _Cursor(mapped, size, path)
    cur.identity = identity if identity[2] == size else None
    try:
        if size < 4 or mapped[:4] != GGUF_MAGIC:
            raise cur.fail("not a GGUF file (bad magic)")
        cur.pos = 4
        if cur.unpack("<I", "the version") not in SUPPORTED_VERSIONS:
            raise cur.fail("GGUF version not supported (qtool reads versions 2 and 3)")
        cur.unpack("<Q", "the tensor count")
        kv_count = cur.unpack("<Q", "the key-value count")
        cur.room_for(kv_count, 13, "the metadata")
        entries: list[tuple[str, object, str]] = []
        for _ in range(kv_count):
            raw_key = cur.string("a metadata key")
            try:
                key = raw_key.decode("utf-8")
            except UnicodeDecodeError:
                raise cur.fail(f"metadata key {raw_key[:40]!r} is not UTF-8") from None
            kind = cur.unpack("<I", f"the type of {key!r}")
            entries.append((key, *_typed_value(cur, kind, key)))
        return entries
    finally:
        if isinstance(mapped, mmap.mmap):
            mapped.close()


def _typed_value(cur: _Cursor, kind: int, key: str) -> tuple[object, str]:
    if kind in _SCALARS:
        return cur.unpack(_SCALARS[kind][1], f"the value of {key!r}"), _VALUE_TYPE_NAMES[kind]
    if kind == _STRING:
        return cur.string(f"the value of {key!r}"), "STRING"
    if kind != _ARRAY:
        raise cur.fail(f"key {key!r} has invalid GGUF value type {kind}")
    item = cur.unpack("<I", f"the array type of {key!r}")
    count = cur.unpack("<Q", f"the array length of {key!r}")
    what = f"the array {key!r}"
    if item in _SCALARS:
        fmt = _SCALARS[item][1]
        start = cur.need(struct.calcsize(fmt) * count, what)
        return list(struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, start)), f"ARRAY:{_VALUE_TYPE_NAMES[item]}"
    if item == _STRING:
        return cur.string_array(count, what), "ARRAY:STRING"
    if item == _ARRAY:
        raise CheckpointError(
            f"key {key} holds arrays of arrays, which qtool does not copy (llama.cpp does not read them either)",
            path=cur.path,
            hint="remove the key, or quantize with llama-quantize",
        )
    raise cur.fail(f"array {key!r} has invalid GGUF value type {item}")


def parse_gguf_prefix(path: str, prefix: bytes, file_size: int) -> tuple[list[StoredTensor], dict[str, str]]:
    """The same as read_gguf_file, from the first bytes of a file of `file_size` bytes (a remote
    file read by ranges). Raises NeedMore when the header runs past `prefix`."""
    if file_size == 0:
        raise CheckpointError("file is empty (0 bytes)", path=path, hint=_HINT)
    return _parse(_Cursor(prefix, file_size, path, available=len(prefix)))


def _parse(cur: _Cursor) -> tuple[list[StoredTensor], dict[str, str]]:
    path = cur.path
    if cur.size < 4 or cur.buf[:4] != GGUF_MAGIC:
        magic = "".join(chr(c) if 32 <= c < 127 else "." for c in bytes(cur.buf[:4]))
        raise cur.fail(f"bad magic '{magic}': not a GGUF file (expected 'GGUF')")
    cur.pos = 4
    version = cur.unpack("<I", "the version")
    if version and version & 0xFFFF == 0:
        raise cur.fail("file is big-endian GGUF; qtool reads little-endian GGUF only")
    if version not in SUPPORTED_VERSIONS:
        why = "GGUF version 1 is no longer supported" if version == 1 else f"GGUF version {version} is not supported"
        raise CheckpointError(
            f"{why} (qtool reads versions 2 and 3)", path=path, hint="convert it with a current llama.cpp"
        )
    tensor_count = cur.unpack("<Q", "the tensor count")
    kv_count = cur.unpack("<Q", "the key-value count")
    cur.room_for(kv_count, 13, "the metadata")  # key length, type, one byte of value at least
    cur.room_for(tensor_count, 24, "the tensor infos")  # name length, n_dims, type, offset

    metadata: dict[str, str] = {"GGUF.version": str(version)}
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cur.string("a metadata key").decode("utf-8", errors="backslashreplace")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        kind = cur.unpack("<I", f"the type of {key!r}")
        if key == "general.alignment":
            if kind != 4:
                raise cur.fail(f"general.alignment has type {_TYPE_NAMES.get(kind, kind)}, not u32")
            alignment = cur.unpack("<I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise cur.fail(f"general.alignment {alignment} is not a power of two")
            metadata[key] = str(alignment)
            continue
        metadata[key] = cur.value(kind, key)

    infos: list[_Info] = []
    seen: set[str] = set()
    for _ in range(tensor_count):
        name = cur.string("a tensor name").decode("utf-8", errors="backslashreplace")
        if name in seen:
            raise cur.fail(f"duplicate tensor name {name!r}")
        seen.add(name)
        n_dims = cur.unpack("<I", f"the dims of {name!r}")
        if n_dims > MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dims; GGUF allows at most {MAX_DIMS}")
        start = cur.need(8 * n_dims, f"the dims of {name!r}")
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, start)
        if any(d >= 2**63 for d in dims):
            raise cur.fail(f"tensor {name!r} has a negative dimension")
        if not dims_fit_int64(dims):
            raise cur.fail(f"tensor {name!r} has dims {list(dims)} whose product overflows 64 bits")
        type_id = cur.unpack("<I", f"the type of {name!r}")
        offset = cur.unpack("<Q", f"the offset of {name!r}")
        infos.append(_Info(name, tuple(dims), type_id, offset))

    data_offset = cur.pos + (-cur.pos % alignment)
    return _tensors(cur, infos, data_offset, alignment), metadata


def _tensors(cur: _Cursor, infos: list[_Info], data_offset: int, alignment: int) -> list[StoredTensor]:
    begins: list[int] | None = None  # sorted starts, built once if a tensor of an unknown type needs them
    tensors = []
    for info in infos:
        name, begin = info.name, data_offset + info.offset
        if info.offset % alignment:
            raise cur.fail(f"tensor {name!r} has offset {info.offset}, not a multiple of the alignment {alignment}")
        shape = tuple(reversed(info.dims))
        numel = math.prod(info.dims)
        gtype = ggml_type(info.type_id)
        if gtype is None:
            # A type newer than qtool and the gguf package: size it by where the next tensor
            # starts (padding included), so the file still lists and other tensors still decode.
            if begins is None:
                begins = sorted({data_offset + i.offset for i in infos})
            after = bisect.bisect_right(begins, begin)
            end = begins[after] if after < len(begins) else cur.size
            if begin > cur.size:
                raise _truncated(cur, name, begin)
            tensors.append(
                StoredTensor(
                    name, DTYPES["U8"], (end - begin,), begin, end, cur.path, f"unknown({info.type_id})", shape
                )
            )
            continue
        row = info.dims[0] if info.dims else 1  # no dims: one value, as llama.cpp reads it
        if row % gtype.block_size:
            raise cur.fail(
                f"tensor {name!r} of type {gtype.name} has {row} elements per row, "
                f"not a multiple of its block size {gtype.block_size}"
            )
        end = begin + gtype.nbytes(numel)
        if end > cur.size:
            raise _truncated(cur, name, end)
        plain = _PLAIN.get(gtype.id)
        if plain is not None:
            tensors.append(StoredTensor(name, plain, shape, begin, end, cur.path))
        else:
            tensors.append(StoredTensor(name, DTYPES["U8"], (end - begin,), begin, end, cur.path, gtype.name, shape))
    return tensors


def _truncated(cur: _Cursor, name: str, end: int) -> CheckpointError:
    return CheckpointError(
        f"file is truncated: tensor {name!r} ends at byte {end}, but the file has {cur.size} bytes",
        path=cur.path,
        hint="the download or copy did not finish; fetch the file again",
    )
