"""Read safetensors headers without touching tensor data, validating what the reference does.

Layout (CONVENTIONS §12): `u64 LE N`, N bytes of UTF-8 JSON, then the data buffer. The JSON maps
each name to `{dtype, shape, data_offsets: [begin, end)}` relative to the buffer, plus an optional
`__metadata__` of string to string. The checks below mirror huggingface/safetensors
`safetensors/src/tensor.rs` (`Metadata::validate`), and add the duplicate-name check that
serde's map silently drops.
"""

from __future__ import annotations

import math
import operator
import os
import stat
import struct
from typing import Any

from qtool.dtypes import DTYPES, StorageDType, nbytes_for
from qtool.errors import CheckpointError
from qtool.formats.checkpoint import StoredTensor, dims_fit_int64
from qtool.formats.untrusted_json import DuplicateKey, lone_surrogate, parse_strict_json

__all__ = ["MAX_HEADER_SIZE", "header_length", "read_header", "parse_header", "read_safetensors_file"]

MAX_HEADER_SIZE = 100_000_000  # the reference reader's limit
_USIZE_MAX = 2**64 - 1
_HINT = "the file is not a valid safetensors file; re-export it, or check that the download finished"


def _fail(path: str, message: str, hint: str = _HINT) -> CheckpointError:
    return CheckpointError(message, path=path, hint=hint)


def header_length(path: str, first8: bytes, size: int) -> int:
    """The header length in the first 8 bytes of a file of `size` bytes, checked against the
    limit and the file size (also for a remote file, read by ranges)."""
    (header_len,) = struct.unpack("<Q", first8)
    if header_len > MAX_HEADER_SIZE:
        raise _fail(path, f"header length {header_len} is over the {MAX_HEADER_SIZE}-byte limit")
    if 8 + header_len > size:
        raise _fail(path, f"header length {header_len} runs past the end of the {size}-byte file")
    return header_len


def read_header(path: str) -> tuple[bytes, int]:
    """Return the raw header bytes and the file size, checking the size limits."""
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        )  # a FIFO opens at once, refused below
    except OSError as exc:
        raise CheckpointError(f"cannot open: {exc.strerror}", path=path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _fail(path, "is not a regular file", hint="pass a .safetensors file or the folder that holds it")
        os.set_blocking(fd, True)
        size = info.st_size
        if size == 0:
            raise _fail(path, "file is empty (0 bytes)")
        if size < 8:
            raise _fail(path, f"file is {size} bytes, shorter than the 8-byte header length")
        header_len = header_length(path, os.pread(fd, 8, 0), size)
        header = os.pread(fd, header_len, 8)
    finally:
        os.close(fd)
    if len(header) != header_len:
        raise _fail(path, "file changed while it was read")
    return header, size


def parse_header(path: str, header: bytes, file_size: int) -> tuple[list[StoredTensor], dict[str, str]]:
    """Validate a header and return its tensors in data order plus `__metadata__`."""
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(path, f"header is not valid UTF-8 (byte {exc.start})") from None
    try:
        parsed = parse_strict_json(text)
    except DuplicateKey as exc:
        if not exc.top_level:
            raise _fail(path, f"field {exc.key!r} appears twice in an entry") from None
        raise _fail(path, f"tensor name {exc.key!r} appears twice in the header") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; so are 5000-digit ints
        raise _fail(path, f"header is not JSON ({getattr(exc, 'msg', None) or exc or 'too deeply nested'})") from None
    if not isinstance(parsed, dict):
        raise _fail(path, f"header is JSON {type(parsed).__name__}, expected an object")
    if "\\u" in text and lone_surrogate(parsed) is not None:  # only a \u escape can make one
        raise _fail(path, "header holds a lone UTF-16 surrogate, which is not valid UTF-8 text")

    metadata = parsed.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null is allowed (an Option in the reference)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, "__metadata__ must map strings to strings")

    data_start = 8 + len(header)
    buffer_size = file_size - data_start
    entries = _entries(path, parsed)
    del parsed, text  # a 95 MB header parses to ~1 GB of dicts: gone before the tensors are built
    entries.sort(key=_BY_OFFSETS)

    tensors = []
    append = tensors.append
    expected_begin = 0
    for name, dtype, shape, begin, end in entries:
        if begin != expected_begin:
            what = "overlaps the previous tensor" if begin < expected_begin else "leaves a gap before it"
            raise _fail(path, f"tensor {name!r} data_offsets [{begin}, {end}) {what} (expected begin {expected_begin})")
        if end > buffer_size:
            raise _fail(path, f"tensor {name!r} data_offsets end {end} is past the end of the {buffer_size}-byte data")
        tensor = StoredTensor(name, dtype, shape, data_start + begin, data_start + end, path)
        append(tensor)
        expected_begin = end
    if expected_begin != buffer_size:
        raise _fail(path, f"{buffer_size - expected_begin} trailing bytes after the last tensor")
    return tensors, metadata


_BY_OFFSETS = operator.itemgetter(3, 4)  # (begin, end) of an entry tuple, in C
_INT_TYPES = {int}


def _entries(path: str, parsed: dict[str, Any]) -> list[tuple]:
    """(name, dtype, shape, begin, end) per entry. A header holds up to ~1.6M entries, so the
    common, valid one is checked inline, with the shapes already seen cached; anything unusual
    goes through `_tensor_entry`, which finds the fault and names it."""
    entries = []
    append = entries.append
    int_types = _INT_TYPES
    seen: dict[tuple[str, tuple[int, ...]], tuple[StorageDType, int]] = {}  # (dtype, shape) -> (dtype, nbytes)
    for name, info in parsed.items():
        try:
            dtype_name = info["dtype"]
            shape_list = info["shape"]
            begin, end = info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            append(_tensor_entry(path, name, info))
            continue
        if (
            type(shape_list) is not list
            or type(dtype_name) is not str
            or type(begin) is not int
            or type(end) is not int
            or not 0 <= begin <= end <= _USIZE_MAX
            or (shape_list and (not set(map(type, shape_list)) <= int_types or min(shape_list) < 0))
        ):
            append(_tensor_entry(path, name, info))
            continue
        shape = tuple(shape_list)
        known = seen.get((dtype_name, shape))
        if known is None:
            _, dtype, shape, _, _ = _tensor_entry(
                path, name, {"dtype": dtype_name, "shape": shape_list, "data_offsets": [0, 0]}, sized=False
            )
            nbytes = nbytes_for(dtype, math.prod(shape))
            if nbytes is None:
                append(_tensor_entry(path, name, info))  # raises, naming the fault
                continue
            known = seen[dtype_name, shape] = (dtype, nbytes)
        dtype, nbytes = known
        if end - begin != nbytes:
            append(_tensor_entry(path, name, info))  # raises, naming the fault
            continue
        append((name, dtype, shape, begin, end))
    return entries


def _tensor_entry(path: str, name: str, info: Any, sized: bool = True):
    """Check one entry field by field, raising on the first fault; `sized=False` checks the
    dtype and shape only."""
    if not isinstance(info, dict):
        raise _fail(path, f"tensor {name!r} entry is not an object")
    dtype_name = info.get("dtype")
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise _fail(
            path,
            f"tensor {name!r} has unknown dtype {dtype_name!r}",
            hint=f"known safetensors dtypes: {' '.join(DTYPES)}",
        )
    shape = info.get("shape")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(path, f"tensor {name!r} shape {shape!r} is not a list of non-negative integers")
    numel = 1
    for dim in shape:  # the reference multiplies in usize and refuses overflow, even before a 0
        numel *= dim
        if numel > _USIZE_MAX:
            raise _fail(path, f"tensor {name!r} shape {shape} overflows 64 bits")
    if not dims_fit_int64(shape):  # the reference passes [0, 2^62, 64]; torch and numpy cannot build it
        raise _fail(path, f"tensor {name!r} shape {shape} overflows 64 bits")
    if not sized:
        return name, dtype, tuple(shape), 0, 0
    offsets = info.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise _fail(path, f"tensor {name!r} data_offsets {offsets!r} is not a pair of non-negative integers")
    begin, end = offsets
    if end < begin:
        raise _fail(path, f"tensor {name!r} data_offsets [{begin}, {end}) end before they begin")
    if end > _USIZE_MAX:
        raise _fail(path, f"tensor {name!r} data_offsets overflow 64 bits")
    nbytes = nbytes_for(dtype, numel)
    if nbytes is None:
        raise _fail(path, f"tensor {name!r}: {numel} elements of {dtype.name} do not fill whole bytes")
    if nbytes != end - begin:
        raise _fail(
            path,
            f"tensor {name!r} is {end - begin} bytes but shape {shape} of {dtype.name} needs {nbytes}",
        )
    return name, dtype, tuple(shape), begin, end


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0  # not isinstance: True is an int too


def read_safetensors_file(path: str) -> tuple[list[StoredTensor], dict[str, str]]:
    header, size = read_header(path)
    return parse_header(path, header, size)
