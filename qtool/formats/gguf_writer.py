"""The bytes of a GGUF header, written by qtool: magic, version 3, counts, key-values, tensor
infos, and the padding before the data. Byte for byte what gguf-py's `GGUFWriter` writes for the
same key-values and tensors (tests/test_gguf_header.py compares the two), so a GGUF qtool writes
is the file gguf-py would; the tensor data is laid out after it by `qtool.formats.writer`.

Why not GGUFWriter itself: it writes through its own file state (qtool drove its private
`fout` and `state`), it refuses an empty array where GGUF allows one and llama.cpp reads it, and
it packs a 49k-token vocabulary one `struct.pack` at a time (1.4 s of a GGUF requantize). Here
each array is packed in one go.

    "GGUF" | u32 3 | u64 tensors | u64 key-values
    key-values: string key, u32 type, value (string = u64 length + bytes; array = u32 element
                type, u64 count, elements)
    tensor infos: string name, u32 n_dims, n_dims × u64 ne (fastest dim first), u32 type,
                  u64 offset from the data start (each tensor padded to the alignment)
    zeros up to `general.alignment` (default 32), then the data
"""

from __future__ import annotations

import struct
from typing import Any
from collections.abc import Sequence

from qtool.errors import CheckpointError
from qtool.formats.gguf import _SCALARS, _VALUE_TYPE_NAMES, DEFAULT_ALIGNMENT, GGUF_MAGIC, StringArray
from qtool.ggml_types import ggml_type_named

__all__ = ["gguf_header", "HeaderTensor", "Entry"]

GGUF_VERSION = 3
_TYPE_IDS = {name: type_id for type_id, name in _VALUE_TYPE_NAMES.items()}
_STRING, _ARRAY = _TYPE_IDS["STRING"], _TYPE_IDS["ARRAY"]

Entry = tuple[str, Any, str]  # (key, value, type name: "UINT32", "STRING", "ARRAY:STRING", or "ARRAY" to infer)
HeaderTensor = tuple[str, Sequence[int], str, int]  # (name, shape in PyTorch order, GGML type name, bytes)


def gguf_header(
    entries: list[Entry], tensors: list[HeaderTensor], architecture: str | None = None
) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The bytes before the data, each tensor's absolute byte range, and the file's size (its
    last tensor padded to the alignment, as GGUFWriter pads it). `architecture`, when given, is
    written first as `general.architecture` (as GGUFWriter's constructor does); otherwise the
    entries hold every key. A key given twice keeps its first place and its last value."""
    values: dict[str, tuple[Any, str]] = {}
    if architecture is not None:
        values["general.architecture"] = (architecture, "STRING")
    for key, value, kind in entries:
        values[key] = (value, kind)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in values:
        alignment = int(values["general.alignment"][0])
    out = bytearray(GGUF_MAGIC)
    out += struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(values))
    for key, (value, kind) in values.items():
        out += _string(key)
        out += _value(key, value, kind)
    offset = 0
    for name, shape, type_name, nbytes in tensors:
        out += _string(name)
        out += struct.pack("<I", len(shape))
        out += struct.pack(f"<{len(shape)}Q", *reversed(shape))
        out += struct.pack("<IQ", ggml_type_named(type_name).id, offset)
        offset += _padded(nbytes, alignment)
    start = _padded(len(out), alignment)
    out += bytes(start - len(out))
    ranges, at = {}, start
    for name, _, _, nbytes in tensors:
        ranges[name] = (at, at + nbytes)
        at += _padded(nbytes, alignment)
    return bytes(out), ranges, at


def _padded(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return struct.pack("<Q", len(raw)) + raw


def _value(key: str, value: Any, kind: str) -> bytes:
    """u32 type, then the value; arrays carry their element type (an empty one too)."""
    outer, _, inner = kind.partition(":")
    type_id = _TYPE_IDS.get(outer)
    if type_id is None or (inner and type_id != _ARRAY):
        raise CheckpointError(f"metadata {key!r}: {kind!r} is not a GGUF value type qtool writes")
    if type_id != _ARRAY:
        return struct.pack("<I", type_id) + _scalar(key, value, type_id)
    item_id = _TYPE_IDS.get(inner) if inner else _element_type(key, value)
    if item_id is None or item_id == _ARRAY:
        raise CheckpointError(
            f"metadata {key!r}: arrays of {inner!r} are not written (llama.cpp refuses nested arrays)"
        )
    head = struct.pack("<IIQ", _ARRAY, item_id, len(value))
    if item_id == _STRING and isinstance(value, StringArray):  # an input's, unchanged: its bytes
        return head + value.raw
    if item_id == _STRING:
        return head + b"".join(_string(item) for item in value)
    fmt = _SCALARS[item_id][1]
    return head + struct.pack(f"{fmt[0]}{len(value)}{fmt[1:]}", *value)


def _element_type(key: str, value: Any) -> int:
    """An array's element type from its values, as GGUFWriter infers it: bytes are UINT8, text
    STRING, a float FLOAT32, a bool BOOL, an int INT32; every element the first's type."""
    if isinstance(value, (bytes, bytearray)):
        return _TYPE_IDS["UINT8"]
    if not value:
        raise CheckpointError(f"metadata {key!r}: an empty array needs its element type")
    named = {_scalar_type(item) for item in value}
    if len(named) != 1 or None in named:
        raise CheckpointError(f"metadata {key!r}: the array's elements are not all of one GGUF type")
    return _TYPE_IDS[named.pop()]


def _scalar_type(item: Any) -> str | None:
    """gguf-py's `GGUFValueType.get_type`, in its order (a bool is an int too)."""
    if isinstance(item, (str, bytes, bytearray)):
        return "STRING"
    if isinstance(item, float):
        return "FLOAT32"
    if isinstance(item, bool):
        return "BOOL"
    if isinstance(item, int):
        return "INT32"
    return None


def _scalar(key: str, value: Any, type_id: int) -> bytes:
    if type_id == _STRING:
        return _string(value)
    return struct.pack(_SCALARS[type_id][1], value)
