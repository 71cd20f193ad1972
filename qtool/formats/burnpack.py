"""Read burn's burnpack (.bpk) headers (CONVENTIONS §11) without touching tensor data.

Layout read from tracel-ai/burn `crates/burn-pack/src/{base,reader,writer}.rs` at burn
0.22.0-pre.2 (commit 2c06be3), where burn-pack became its own crate; burn 0.19-0.21 wrote the
same container from `crates/burn-store/src/burnpack/`:

    "NRUB"                      u32 LE 0x4255524E ("BURN" read as a little-endian u32)
    u16 LE version              FORMAT_VERSION = 1; a reader refuses a newer one
    u32 LE metadata_size        at most 100 MiB
    metadata_size bytes of CBOR (serde through ciborium):
        {"tensors": {name: {"dtype": DType, "shape": [u64], "data_offsets": [start, end],
                            "param_id"?: u64}},
         "metadata"?: {str: str}, "scalars"?: {name: {"Int"|"UInt"|"Float"|"Bool": value}}}
    zero padding to the next multiple of 256 (the data section; offsets are relative to it,
    and each tensor starts on a 256-byte boundary)

serde's externally tagged enums put a unit variant as its name and a newtype variant as a
one-entry map, so `DType` reads `"F32"`, `{"Bool": "Native"}` or `{"QFloat": {scheme}}`;
structs are maps with text keys; `Option::None` is null; tuples and `[u8; 5]` are arrays.

Plain dtypes become ordinary stored tensors (their byte count must be numel x size, as burn's
writer checks). A `QFloat` tensor holds packed values and its scales inline, so it becomes raw
bytes (dtype U8, shape `(nbytes,)`) with `encoding` = `"QFloat"` + the scheme as canonical JSON
and `logical_shape` set, for `qtool.conventions.burn` to read.

Like the reference reader this refuses: a short header, a bad magic, a newer version, an
oversized or cut-short metadata block, CBOR that does not decode or nests past 128 levels,
more than 100,000 tensors, offsets that end before they begin or past the end of the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

from qtool.dtypes import DTYPES, StorageDType
from qtool.errors import CheckpointError
from qtool.formats.checkpoint import StoredTensor, dims_fit_int64
from qtool.formats.untrusted_json import describe, parse_json

__all__ = [
    "MAGIC",
    "HEADER_SIZE",
    "FORMAT_VERSION",
    "TENSOR_ALIGNMENT",
    "QFLOAT",
    "read_burnpack_file",
    "data_section_start",
    "qfloat_scheme",
]

MAGIC = b"NRUB"
HEADER_SIZE = 10
FORMAT_VERSION = 1
TENSOR_ALIGNMENT = 256
MAX_METADATA_SIZE = 100 * 1024 * 1024
MAX_TENSOR_COUNT = 100_000
MAX_CBOR_DEPTH = 128
QFLOAT = "QFloat"
_HINT = "the file is not a valid burnpack file; re-export it from burn, or check that the copy finished"

# burn DType variant -> storage dtype. Flex32 is f32 in memory and on disk.
_PLAIN: dict[str, StorageDType] = {d.burn_name: d for d in DTYPES.values() if d.burn_name}
_PLAIN["Flex32"] = DTYPES["F32"]
_BOOL_STORES = {"Native": DTYPES["BOOL"], "U8": DTYPES["BOOL"], "U32": DTYPES["U32"]}


def data_section_start(metadata_size: int) -> int:
    """Where the data section starts: after the header and metadata, rounded up to 256."""
    unaligned = HEADER_SIZE + metadata_size
    return -(-unaligned // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


def qfloat_scheme(tensor: StoredTensor) -> dict[str, Any] | None:
    """The burn QuantScheme map a QFloat stored tensor carries, or None for any other tensor."""
    encoding = tensor.encoding or ""
    if not encoding.startswith(QFLOAT):
        return None
    scheme = parse_json(
        encoding[len(QFLOAT) :], tensor.file, where=f"tensor {tensor.name!r}'s QFloat scheme", hint=_HINT
    )
    if not isinstance(scheme, dict):
        raise _fail(tensor.file, f"tensor {tensor.name!r}'s QFloat scheme is {describe(scheme)}, not a map")
    return scheme


def _fail(path: str, message: str) -> CheckpointError:
    return CheckpointError(message, path=path, hint=_HINT)


def read_burnpack_file(path: str) -> tuple[list[StoredTensor], dict[str, str]]:
    """The stored tensors of one burnpack file, in data order, and its metadata as strings."""
    from qtool.formats.regular_files import NotReadable, open_regular

    try:
        fd, info = open_regular(path)  # a FIFO is never waited on, a device never read
    except NotReadable as exc:
        raise CheckpointError(f"cannot read: {exc}", path=path, hint=_HINT) from None
    try:
        size = info.st_size
        with os.fdopen(fd, "rb") as handle:
            header = handle.read(HEADER_SIZE)
            if size == 0:
                raise _fail(path, "file is empty (0 bytes)")
            if len(header) < HEADER_SIZE:
                raise _fail(path, f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte burnpack header")
            magic, version, metadata_size = header[:4], *struct.unpack("<HI", header[4:])
            if magic != MAGIC:
                shown = "".join(chr(c) if 32 <= c < 127 else "." for c in magic)
                raise _fail(path, f"bad magic '{shown}': not a burnpack file (expected 'NRUB')")
            if version > FORMAT_VERSION:
                raise CheckpointError(
                    f"burnpack version {version} is newer than qtool reads (version {FORMAT_VERSION})",
                    path=path,
                    hint="upgrade qtool, or re-save the model with the burn release qtool supports",
                )
            if metadata_size > MAX_METADATA_SIZE:
                raise _fail(path, f"metadata size {metadata_size} is over the {MAX_METADATA_SIZE}-byte limit")
            if HEADER_SIZE + metadata_size > size:
                raise _fail(
                    path,
                    f"file is cut short: {metadata_size} bytes of metadata run past the end of the {size}-byte file",
                )
            raw = handle.read(metadata_size)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", path=path) from None
    document = _decode_cbor(path, raw)
    return _describe(path, document, version, metadata_size, size)


def _decode_cbor(path: str, raw: bytes) -> Any:
    try:
        import cbor2
    except ImportError:
        raise CheckpointError("reading .bpk files needs cbor2; pip install cbor2", path=path) from None
    try:
        document = cbor2.loads(raw)
    except RecursionError:
        raise _fail(path, "metadata CBOR nests too deeply") from None
    except Exception as exc:  # cbor2 raises CBORDecodeError and, on odd input, ValueError/TypeError
        raise _fail(path, f"metadata is not valid CBOR ({exc})") from None
    _check_tree(path, document)
    return document


def _check_tree(path: str, value: Any, level: int = 0) -> None:
    """Depth at most MAX_CBOR_DEPTH, and every integer within 64 bits (CBOR's own range; a
    bignum tag holds any size, and Python refuses to print one of 4,300 digits)."""
    if level > MAX_CBOR_DEPTH:
        raise _fail(path, f"metadata CBOR nests deeper than {MAX_CBOR_DEPTH} levels")
    if isinstance(value, int) and not isinstance(value, bool):
        if not -(2**64) <= value < 2**64:
            raise _fail(
                path, f"metadata holds an integer of {value.bit_length()} bits; CBOR's integers have at most 64"
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_tree(path, key, level + 1)
            _check_tree(path, item, level + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_tree(path, item, level + 1)


def _describe(
    path: str, document: Any, version: int, metadata_size: int, size: int
) -> tuple[list[StoredTensor], dict[str, str]]:
    if not isinstance(document, dict) or not isinstance(document.get("tensors"), dict):
        raise _fail(path, 'metadata is not a map with a "tensors" map')
    entries = document["tensors"]
    if len(entries) > MAX_TENSOR_COUNT:
        raise _fail(path, f"metadata lists {len(entries)} tensors, more than the {MAX_TENSOR_COUNT} burn allows")
    metadata: dict[str, str] = {"burnpack.version": str(version)}
    user = document.get("metadata") or {}
    if not isinstance(user, dict):
        raise _fail(path, '"metadata" is not a map of strings')
    for key, value in user.items():
        metadata[str(key)] = str(value)
    scalars = document.get("scalars") or {}
    if isinstance(scalars, dict):
        for key, value in scalars.items():
            shown = next(iter(value.values())) if isinstance(value, dict) and len(value) == 1 else value
            metadata[f"scalars.{key}"] = str(shown)
    data_start = data_section_start(metadata_size)
    tensors = [_tensor(path, name, info, data_start, size) for name, info in entries.items()]
    tensors.sort(key=lambda t: (t.begin, t.name))
    return tensors, metadata


def _tensor(path: str, name: Any, info: Any, data_start: int, size: int) -> StoredTensor:
    if not isinstance(name, str):
        raise _fail(path, f"tensor name {name!r} is not text")
    if not isinstance(info, dict):
        raise _fail(path, f"tensor {name!r} entry is not a map")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(path, f"tensor {name!r} shape {shape!r} is not a list of non-negative integers")
    if not dims_fit_int64(shape):
        raise _fail(path, f"tensor {name!r} shape {shape!r} has more elements than a 64-bit size can count")
    offsets = info.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise _fail(path, f"tensor {name!r} data_offsets {offsets!r} is not a pair of non-negative integers")
    start, end = offsets
    if end < start:
        raise _fail(path, f"tensor {name!r} data_offsets [{start}, {end}) end before they begin")
    begin, stop = data_start + start, data_start + end
    if stop > size:
        raise CheckpointError(
            f"file is truncated: tensor {name!r} ends at byte {stop}, but the file has {size} bytes",
            path=path,
            hint="the download or copy did not finish; fetch the file again",
        )
    dtype = info.get("dtype")
    shape_t = tuple(shape)
    if isinstance(dtype, dict) and len(dtype) == 1 and QFLOAT in dtype:
        scheme = dtype[QFLOAT]
        if not isinstance(scheme, dict):
            raise _fail(path, f"tensor {name!r} QFloat scheme is not a map")
        encoding = QFLOAT + json.dumps(_jsonable(scheme), sort_keys=True, separators=(",", ":"))
        return StoredTensor(name, DTYPES["U8"], (stop - begin,), begin, stop, path, encoding, shape_t)
    stored = _plain_dtype(dtype)
    if stored is None:
        raise _fail(path, f"tensor {name!r} has unknown burn dtype {dtype!r}")
    expected = math.prod(shape_t) * stored.bits // 8
    if stop - begin != expected:
        raise _fail(
            path,
            f"tensor {name!r} is {stop - begin} bytes but shape {list(shape_t)} of {stored.burn_name or stored.name} needs {expected}",
        )
    return StoredTensor(name, stored, shape_t, begin, stop, path)


def _plain_dtype(dtype: Any) -> StorageDType | None:
    if isinstance(dtype, str):
        return DTYPES["BOOL"] if dtype == "Bool" else _PLAIN.get(dtype)  # burn <= 0.20 wrote a bare "Bool"
    if isinstance(dtype, dict) and len(dtype) == 1 and "Bool" in dtype:
        return _BOOL_STORES.get(dtype["Bool"]) if isinstance(dtype["Bool"], str) else None
    return None


def _jsonable(value: Any) -> Any:
    """CBOR values as JSON: byte strings (a serializer may write `[u8; 5]` as one) as int lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return list(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
