"""Parse a container just enough to know where its fields and boundaries are, so mutators can
cut it at every field boundary and edit its length and count fields. Tolerant: a file that a
previous mutation already broke yields whatever was found before the break.

`Structure.fields` are fixed-width integers (offset, struct format, kind); `boundaries` are
offsets where one field or record ends and the next begins (`minor`: inside JSON text); `regions` name spans (the JSON
header, the CBOR metadata, a zip member, a pickle) and whether they are data or header.
"""

from __future__ import annotations

import io
import json
import pickletools
import struct
from dataclasses import dataclass, field

__all__ = ["Field", "Region", "Structure", "parse"]


@dataclass(frozen=True)
class Field:
    offset: int
    fmt: str  # struct format, little-endian: "<Q", "<I", "<H", "<B", "<i", "<q"
    kind: str  # "length", "count", "type", "dim", "offset", "version", "crc", "int"

    @property
    def size(self) -> int:
        return struct.calcsize(self.fmt)


@dataclass(frozen=True)
class Region:
    start: int
    end: int
    kind: str  # "json", "cbor", "pickle", "data", "member"
    name: str = ""


@dataclass
class Structure:
    kind: str
    fields: list[Field] = field(default_factory=list)
    boundaries: set[int] = field(default_factory=set)  # between fields and records
    minor: set[int] = field(default_factory=set)  # inside a JSON text: around each {}[],:"
    regions: list[Region] = field(default_factory=list)

    def header_regions(self) -> list[Region]:
        return [r for r in self.regions if r.kind not in ("data", "member")]


def parse(name: str, data: bytes) -> Structure:
    """The structure of a file, by its name (the extension) and, for .pt, its magic."""
    parsers = {
        ".safetensors": _safetensors,
        ".gguf": _gguf,
        ".bpk": _burnpack,
        ".json": _json,
    }
    for suffix, parser in parsers.items():
        if name.endswith(suffix):
            return _guarded(parser, data)
    if name.endswith((".pt", ".pth", ".bin")):
        return _guarded(_zip if data[:4] == b"PK\x03\x04" else _legacy_pickle, data)
    return Structure("raw", boundaries={0, len(data)})


def _guarded(parser, data: bytes) -> Structure:
    s = Structure(parser.__name__.strip("_"))
    s.boundaries.update((0, len(data)))
    try:
        parser(data, s)
    except Exception:
        pass
    s.boundaries = {b for b in s.boundaries if 0 <= b <= len(data)}
    s.minor = {b for b in s.minor if 0 <= b <= len(data)} - s.boundaries
    return s


def _json_boundaries(text: bytes, base: int, s: Structure, limit: int = 4000) -> None:
    count = 0
    for i, byte in enumerate(text):
        if byte in b'{}[],:"':
            s.minor.add(base + i)
            s.minor.add(base + i + 1)
            count += 1
            if count > limit:
                break


def _safetensors(data: bytes, s: Structure) -> None:
    s.fields.append(Field(0, "<Q", "length"))
    s.boundaries.add(8)
    (n,) = struct.unpack_from("<Q", data, 0)
    end = min(8 + n, len(data))
    s.regions.append(Region(8, end, "json"))
    s.regions.append(Region(end, len(data), "data"))
    s.boundaries.add(end)
    _json_boundaries(data[8:end], 8, s)
    header = json.loads(data[8:end])
    for entry in header.values():
        if isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list):
            for offset in entry["data_offsets"]:
                if isinstance(offset, int):
                    s.boundaries.add(end + offset)


# -- GGUF ------------------------------------------------------------------------------------------
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf(data: bytes, s: Structure) -> None:
    pos = 4
    s.boundaries.add(4)
    s.fields.append(Field(4, "<I", "version"))
    s.fields.append(Field(8, "<Q", "count"))  # tensors
    s.fields.append(Field(16, "<Q", "count"))  # kv
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24
    s.boundaries.update((8, 16, 24))

    def string(pos: int) -> int:
        s.fields.append(Field(pos, "<Q", "length"))
        (length,) = struct.unpack_from("<Q", data, pos)
        s.boundaries.add(pos + 8)
        if pos + 8 + length > len(data):
            raise ValueError("cut")
        s.boundaries.add(pos + 8 + length)
        return pos + 8 + length

    def value(pos: int, type_id: int) -> int:
        if type_id in _GGUF_SCALARS:
            s.fields.append(Field(pos, _GGUF_SCALARS[type_id], "int" if type_id not in (6, 12) else "float"))
            end = pos + struct.calcsize(_GGUF_SCALARS[type_id])
            s.boundaries.add(end)
            return end
        if type_id == 8:
            return string(pos)
        if type_id == 9:
            s.fields.append(Field(pos, "<I", "type"))
            s.fields.append(Field(pos + 4, "<Q", "count"))
            item_type, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            s.boundaries.add(pos)
            for _ in range(min(count, 10_000)):
                pos = value(pos, item_type)
            return pos
        raise ValueError(f"type {type_id}")

    for _ in range(min(n_kv, 10_000)):
        pos = string(pos)
        s.fields.append(Field(pos, "<I", "type"))
        (type_id,) = struct.unpack_from("<I", data, pos)
        pos += 4
        s.boundaries.add(pos)
        pos = value(pos, type_id)
    info_start = pos
    for _ in range(min(n_tensors, 10_000)):
        pos = string(pos)
        s.fields.append(Field(pos, "<I", "count"))
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4
        for _ in range(min(n_dims, 16)):
            s.fields.append(Field(pos, "<Q", "dim"))
            pos += 8
            s.boundaries.add(pos)
        s.fields.append(Field(pos, "<I", "type"))
        s.fields.append(Field(pos + 4, "<Q", "offset"))
        pos += 12
        s.boundaries.add(pos)
    s.regions.append(Region(4, info_start, "kv"))
    s.regions.append(Region(info_start, pos, "tensor_info"))
    s.regions.append(Region(pos, len(data), "data"))


# -- burnpack --------------------------------------------------------------------------------------


def _burnpack(data: bytes, s: Structure) -> None:
    s.fields += [Field(4, "<H", "version"), Field(6, "<I", "length")]
    s.boundaries.update((4, 6, 10))
    (size,) = struct.unpack_from("<I", data, 6)
    end = min(10 + size, len(data))
    s.regions.append(Region(10, end, "cbor"))
    s.regions.append(Region(end, len(data), "data"))
    s.boundaries.add(end)


def _json(data: bytes, s: Structure) -> None:
    s.regions.append(Region(0, len(data), "json"))
    _json_boundaries(data, 0, s)


# -- pickles ---------------------------------------------------------------------------------------


def _pickle(data: bytes, base: int, s: Structure, name: str = "") -> int:
    """Boundaries and integer fields of one pickle starting at data[base:]; returns its end."""
    stream = io.BytesIO(data)
    stream.seek(base)
    end = base
    for opcode, _arg, pos in pickletools.genops(stream):
        s.boundaries.add(pos)
        if opcode.name == "BININT1":
            s.fields.append(Field(pos + 1, "<B", "int"))
        elif opcode.name == "BININT2":
            s.fields.append(Field(pos + 1, "<H", "int"))
        elif opcode.name == "BININT":
            s.fields.append(Field(pos + 1, "<i", "int"))
        elif opcode.name in ("BINUNICODE", "BINBYTES"):
            s.fields.append(Field(pos + 1, "<I", "length"))
        elif opcode.name in ("SHORT_BINUNICODE", "SHORT_BINBYTES", "SHORT_BINSTRING"):
            s.fields.append(Field(pos + 1, "<B", "length"))
        elif opcode.name in ("BINPUT", "BINGET"):
            s.fields.append(Field(pos + 1, "<B", "int"))
        elif opcode.name in ("LONG_BINPUT", "LONG_BINGET"):
            s.fields.append(Field(pos + 1, "<I", "int"))
        elif opcode.name == "FRAME":
            s.fields.append(Field(pos + 1, "<Q", "length"))
        end = stream.tell()
    s.boundaries.add(end)
    s.regions.append(Region(base, end, "pickle", name))
    return end


def _legacy_pickle(data: bytes, s: Structure) -> None:
    """magic, protocol, sys_info, the object, the storage keys; then per storage: u64 count + bytes."""
    pos = 0
    for _ in range(5):
        pos = _pickle(data, pos, s)
    s.fields.append(Field(pos, "<Q", "count"))
    s.boundaries.add(pos + 8)
    s.regions.append(Region(pos, len(data), "data"))


def _zip(data: bytes, s: Structure) -> None:
    pos = 0
    while True:
        local = data.find(b"PK\x03\x04", pos)
        if local < 0:
            break
        _, _, _flags, method, _, _, _crc, csize, _usize, nlen, xlen = struct.unpack_from("<IHHHHHIIIHH", data, local)
        s.fields += [
            Field(local + 8, "<H", "type"),
            Field(local + 14, "<I", "crc"),
            Field(local + 18, "<I", "length"),
            Field(local + 22, "<I", "length"),
            Field(local + 26, "<H", "length"),
            Field(local + 28, "<H", "length"),
        ]
        name = data[local + 30 : local + 30 + nlen].decode("utf-8", "replace")
        start = local + 30 + nlen + xlen
        end = start + csize
        s.boundaries.update((local, local + 30, local + 30 + nlen, start, end))
        is_pickle = name.endswith(".pkl") and method == 0
        s.regions.append(Region(start, end, "pickle" if is_pickle else "member", name))
        if is_pickle:
            try:
                _pickle(data[:end], start, s, name)
            except Exception:
                pass
        pos = max(end, local + 4)
    pos = 0
    while True:
        central = data.find(b"PK\x01\x02", pos)
        if central < 0:
            break
        s.fields += [
            Field(central + 10, "<H", "type"),
            Field(central + 16, "<I", "crc"),
            Field(central + 20, "<I", "length"),
            Field(central + 24, "<I", "length"),
            Field(central + 28, "<H", "length"),
            Field(central + 30, "<H", "length"),
            Field(central + 32, "<H", "length"),
            Field(central + 42, "<I", "offset"),
        ]
        s.boundaries.update((central, central + 46))
        pos = central + 4
    eocd = data.rfind(b"PK\x05\x06")
    if eocd >= 0:
        s.fields += [
            Field(eocd + 8, "<H", "count"),
            Field(eocd + 10, "<H", "count"),
            Field(eocd + 12, "<I", "length"),
            Field(eocd + 16, "<I", "offset"),
        ]
        s.boundaries.update((eocd, eocd + 22))
    for sig, fields in (
        (b"PK\x06\x06", ((24, "<Q", "count"), (32, "<Q", "count"), (40, "<Q", "length"), (48, "<Q", "offset"))),
        (b"PK\x06\x07", ((8, "<Q", "offset"),)),
    ):
        at = data.rfind(sig)
        if at >= 0:
            s.fields += [Field(at + off, fmt, kind) for off, fmt, kind in fields]
            s.boundaries.add(at)
