"""Mutations of one file of a seed: bit flips, byte inserts and deletes, truncation at every field
boundary, length/count/type field edits, JSON and CBOR value edits (wrong types, huge integers,
deep nesting, NaN, duplicate keys, unicode; dtype, shape and offset edits of tensor entries),
and pickle integer edits. Every mutation is a pure function of (rng, bytes, structure), so a
case is reproduced from its seed number alone; each returns a short description for reports.
"""

from __future__ import annotations

import json
import random
import struct
import zlib

from tests.fuzz.json_edits import RAW_MARKER, Raw, mutate_json_doc
from tests.fuzz.structure import Field, Structure, parse

__all__ = ["BYTE_MUTATORS", "JSON_MUTATORS", "mutate_file"]

# -- byte-level ------------------------------------------------------------------------------------

_INTERESTING = {
    "<B": (0, 1, 0x7F, 0x80, 0xFF),
    "<b": (0, -1, 127, -128),
    "<H": (0, 1, 0x7FFF, 0x8000, 0xFFFF),
    "<h": (0, -1, 32767, -32768),
    "<I": (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF),
    "<i": (0, -1, 2**31 - 1, -(2**31)),
    "<Q": (0, 1, 2**31, 2**32, 2**62, 2**63, 2**64 - 1, 2**40),
    "<q": (0, -1, 2**63 - 1, -(2**63)),
}


def _pick_offset(rng: random.Random, data: bytearray, s: Structure) -> int:
    """Mostly inside a header region (where the parsers are), sometimes anywhere."""
    headers = [r for r in s.header_regions() if r.end > r.start]
    if headers and rng.random() < 0.8:
        region = rng.choice(headers)
        return (
            rng.randrange(region.start, min(region.end, len(data)) or 1)
            if region.end <= len(data)
            else rng.randrange(max(1, len(data)))
        )
    if s.boundaries and rng.random() < 0.5:
        return min(rng.choice(sorted(s.boundaries)), max(0, len(data) - 1))
    return rng.randrange(max(1, len(data)))


def bit_flip(rng, data: bytearray, s: Structure) -> str:
    if not data:
        return "empty"
    flips = rng.choice((1, 1, 1, 2, 4, 8))
    at = []
    for _ in range(flips):
        pos = _pick_offset(rng, data, s)
        if pos < len(data):
            data[pos] ^= 1 << rng.randrange(8)
            at.append(pos)
    return f"bit flip at {at}"


def byte_set(rng, data: bytearray, s: Structure) -> str:
    if not data:
        return "empty"
    pos = _pick_offset(rng, data, s)
    value = rng.choice((0, 0xFF, 0x7F, 0x80, ord('"'), ord("{"), ord("]"), ord("9"), 0x0A))
    if pos < len(data):
        data[pos] = value
    return f"byte {value:#x} at {pos}"


def byte_insert(rng, data: bytearray, s: Structure) -> str:
    pos = (
        rng.choice(sorted(s.boundaries | s.minor))
        if s.boundaries and rng.random() < 0.6
        else _pick_offset(rng, data, s)
    )
    blob = (
        bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 4, 8, 16))))
        if rng.random() < 0.7
        else bytes([rng.choice((0, 0xFF, 0x20))]) * rng.choice((64, 4096))
    )
    data[pos:pos] = blob
    return f"insert {len(blob)} bytes at {pos}"


def byte_delete(rng, data: bytearray, s: Structure) -> str:
    pos = (
        rng.choice(sorted(s.boundaries | s.minor))
        if s.boundaries and rng.random() < 0.6
        else _pick_offset(rng, data, s)
    )
    count = rng.choice((1, 2, 4, 8, 16, 256))
    del data[pos : pos + count]
    return f"delete {count} bytes at {pos}"


def truncate(rng, data: bytearray, s: Structure) -> str:
    pool = s.boundaries if rng.random() < 0.7 or not s.minor else s.minor
    cuts = sorted(b for b in pool if b < len(data))
    pos = rng.choice(cuts) if cuts else 0
    pos = max(0, pos + rng.choice((0, 0, 0, -1, 1)))
    del data[pos:]
    return f"truncate at {pos}"


def field_edit(rng, data: bytearray, s: Structure) -> str:
    fields = [f for f in s.fields if f.offset + f.size <= len(data) and f.kind != "float"]
    if not fields:
        return bit_flip(rng, data, s)
    f = rng.choice(fields)
    if f.kind == "crc":
        f = rng.choice(fields)
    (old,) = struct.unpack_from(f.fmt, data, f.offset)
    bits = f.size * 8
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if f.fmt[-1].islower() else (0, 2**bits - 1)
    if f.kind == "type" and rng.random() < 0.6:
        new = rng.choice((old + 1, old - 1, 9999, 42, 13, 14, 39, 40, 255, 8, 9))
    else:
        new = rng.choice(
            (old + 1, old - 1, 0, hi, hi - 1, old * 2, old * 16 + 1, rng.randint(lo, hi)) + _INTERESTING.get(f.fmt, ())
        )
    new = min(max(new, lo), hi)
    struct.pack_into(f.fmt, data, f.offset, new)
    return f"{f.kind} field at {f.offset} {old} -> {new}"


def splice(rng, data: bytearray, s: Structure) -> str:
    if len(data) < 16:
        return bit_flip(rng, data, s)
    src = rng.randrange(len(data) - 8)
    dst = _pick_offset(rng, data, s)
    size = rng.choice((4, 8, 16, 64))
    chunk = data[src : src + size]
    data[dst : dst + len(chunk)] = chunk
    return f"copy {size} bytes {src} -> {dst}"


def data_bit_flip(rng, data: bytearray, s: Structure) -> str:
    """Flips in the tensor data (scales, codes, zero points): the decoders' inputs."""
    regions = [r for r in s.regions if r.kind in ("data", "member") and r.end > r.start and r.end <= len(data)]
    if not regions:
        return bit_flip(rng, data, s)
    region = rng.choice(regions)
    at = []
    for _ in range(rng.choice((1, 4, 32))):
        pos = rng.randrange(region.start, region.end)
        data[pos] ^= 1 << rng.randrange(8)
        at.append(pos)
    if data[:4] == b"PK\x03\x04" and rng.random() < 0.85:
        _fix_zip_crcs(data)
    return f"data bit flips at {at[:8]}{'...' if len(at) > 8 else ''}"


BYTE_MUTATORS = (
    (bit_flip, 5),
    (byte_set, 2),
    (byte_insert, 2),
    (byte_delete, 2),
    (truncate, 3),
    (field_edit, 4),
    (splice, 1),
    (data_bit_flip, 4),
)


# -- structured edits ------------------------------------------------------------------------------


def safetensors_json_edit(rng, data: bytearray, s: Structure) -> str:
    json_regions = [r for r in s.regions if r.kind == "json"]
    if not json_regions:
        return bit_flip(rng, data, s)
    region = json_regions[0]
    try:
        doc = json.loads(bytes(data[region.start : region.end]))
    except ValueError:
        return bit_flip(rng, data, s)
    raw = Raw()
    doc, what = mutate_json_doc(rng, doc, raw)
    text = raw.render(doc, ensure_ascii=rng.random() < 0.7, indent=None).encode("utf-8", "surrogatepass")
    if rng.random() < 0.8:
        text += b" " * (-len(text) % 8)
    fix = rng.random() < 0.9
    head = struct.pack("<Q", len(text)) if fix else bytes(data[:8])
    data[:] = head + text + bytes(data[region.end :])
    return f"header JSON: {what}" + ("" if fix else " (length kept)")


def json_file_edit(rng, data: bytearray, s: Structure) -> str:
    try:
        doc = json.loads(bytes(data))
    except ValueError:
        return bit_flip(rng, data, s)
    raw = Raw()
    doc, what = mutate_json_doc(rng, doc, raw)
    data[:] = raw.render(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice((None, 2))).encode(
        "utf-8", "surrogatepass"
    )
    return f"JSON: {what}"


def burnpack_cbor_edit(rng, data: bytearray, s: Structure) -> str:
    import cbor2

    regions = [r for r in s.regions if r.kind == "cbor"]
    if not regions:
        return bit_flip(rng, data, s)
    region = regions[0]
    try:
        doc = cbor2.loads(bytes(data[region.start : region.end]))
    except Exception:
        return bit_flip(rng, data, s)
    raw = Raw()
    doc, what = mutate_json_doc(rng, doc, raw, nested_json=False)
    doc, placed = _resolve_raw_for_cbor(rng, doc, raw)
    if placed:  # CBOR has no raw text: say what took the raw value's place
        what = what.split("=raw")[0] + "=" + ", ".join(placed)
    try:
        blob = cbor2.dumps(doc)
    except Exception:
        return bit_flip(rng, data, s)
    fix = rng.random() < 0.9
    head = bytes(data[:6]) + (struct.pack("<I", len(blob)) if fix else bytes(data[6:10]))
    tail = bytes(data[region.end :])
    if fix and rng.random() < 0.7:  # keep the data section where the offsets expect it
        from qtool.formats.burnpack import data_section_start

        old_start = data_section_start(region.end - 10)
        tail = bytes(data[old_start:])
        pad = data_section_start(len(blob)) - 10 - len(blob)
        blob += bytes(pad)
    data[:] = head + blob + tail
    return f"CBOR: {what}" + ("" if fix else " (length kept)")


def _resolve_raw_for_cbor(rng, doc, raw: Raw):
    """CBOR has no raw text: a placeholder becomes a deep nest, a huge int or NaN."""
    marker = RAW_MARKER
    placed: list[str] = []
    choices = (
        ("NaN", float("nan")),
        ("inf", float("inf")),
        ("10**5000", 10**5000),
        ("-(10**80)", -(10**80)),
        ("list nested 300 deep", _nest(300)),
        ("list nested 5000 deep", _nest(5000, {})),
        ("8 bytes ff", b"\xff" * 8),
    )

    def fix(value, depth=0):
        if isinstance(value, str) and value.startswith(marker):
            name, new = rng.choice(choices)
            placed.append(name)
            return new
        if depth > 400:
            return value
        if isinstance(value, dict):
            return {k: fix(v, depth + 1) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v, depth + 1) for v in value]
        return value

    return fix(doc), placed


def _nest(depth: int, leaf=None):
    value = leaf if leaf is not None else []
    for _ in range(depth):
        value = [value]
    return value


def _fix_zip_crcs(data: bytearray) -> None:
    """Recompute the CRC-32 of every stored member in the local and central headers, so an edit
    inside a member tests the reader, not the zip library's checksum."""
    s = parse("x.pt", bytes(data))
    crcs: dict[str, int] = {}
    for region in s.regions:
        if region.kind in ("pickle", "member") and region.end <= len(data):
            crcs[region.name] = zlib.crc32(data[region.start : region.end]) & 0xFFFFFFFF
    pos = 0
    while (at := data.find(b"PK\x03\x04", pos)) >= 0 and at + 30 <= len(data):
        nlen = struct.unpack_from("<H", data, at + 26)[0]
        name = bytes(data[at + 30 : at + 30 + nlen]).decode("utf-8", "replace")
        if name in crcs:
            struct.pack_into("<I", data, at + 14, crcs[name])
        pos = at + 4
    pos = 0
    while (at := data.find(b"PK\x01\x02", pos)) >= 0 and at + 46 <= len(data):
        nlen = struct.unpack_from("<H", data, at + 28)[0]
        name = bytes(data[at + 46 : at + 46 + nlen]).decode("utf-8", "replace")
        if name in crcs:
            struct.pack_into("<I", data, at + 16, crcs[name])
        pos = at + 4


def pickle_edit(rng, data: bytearray, s: Structure) -> str:
    """An edit inside a pickle (data.pkl in a zip, or a legacy file's pickles)."""
    pickles = [r for r in s.regions if r.kind == "pickle" and r.end <= len(data)]
    if not pickles:
        return field_edit(rng, data, s)
    region = max(pickles, key=lambda r: r.end - r.start) if rng.random() < 0.8 else rng.choice(pickles)
    inside = Structure(
        "pickle",
        [f for f in s.fields if region.start <= f.offset < region.end],
        {b for b in s.boundaries if region.start <= b <= region.end},
        regions=[region],
    )
    op = rng.random()
    if op < 0.5 and inside.fields:
        what = field_edit(rng, data, inside)
    elif op < 0.75:
        pos = rng.randrange(region.start, max(region.start + 1, region.end))
        data[pos] ^= 1 << rng.randrange(8)
        what = f"pickle bit flip at {pos}"
    elif op < 0.85 and (swap := _surrogate_string(rng, data, inside, region)):
        what = swap
    else:
        ops = [b for b in sorted(inside.boundaries) if b < region.end]
        pos = rng.choice(ops) if ops else region.start
        opcode = rng.choice(
            (
                b"N",
                b")",
                b"]",
                b"}",
                b"(",
                b"t",
                b"R",
                b".",
                b"0",
                b"2",
                b"h\x00",
                b"q\x00",
                b"\x88",
                b"K\x05",
                b"J\xff\xff\xff\x7f",
                b"c__builtin__\neval\n",
                b"\x8a\x09" + b"\xff" * 9,
            )
        )
        data[pos : pos + len(opcode)] = opcode
        what = f"pickle opcode {opcode[:12]!r} at {pos}"
    if data[:4] == b"PK\x03\x04" and rng.random() < 0.85:
        _fix_zip_crcs(data)
        what += " (CRCs fixed)"
    return what


def _surrogate_string(rng, data: bytearray, inside: Structure, region) -> str | None:
    """A BINUNICODE string (a key, a storage name) rewritten in place, same length, as a
    protocol-0 UNICODE opcode holding a lone surrogate (`V\\ud800...\\n`): the one opcode that
    can make a str no UTF-8 output carries (issue 42 #7)."""
    starts = [b for b in sorted(inside.boundaries) if b + 5 <= region.end and data[b] == 0x58]
    rng.shuffle(starts)
    for at in starts:
        n = struct.unpack_from("<I", data, at + 1)[0]
        if 3 <= n and at + 5 + n <= region.end:
            payload = b"\\ud800" + b"a" * (n + 3 - 6)
            data[at : at + 5 + n] = b"V" + payload + b"\n"
            return f"pickle string at {at} as UNICODE with a lone surrogate"
    return None


_DIM_SETS = (
    (0, 64, 2**62),
    (2**62, 0),
    (2**32, 2**32),
    (2**63, 2),
    (2**64 - 1, 1),
    (0,),
    (1, 0),
    (3, 5),
    (2**31, 2**31, 4),
)


def gguf_tensor_edit(rng, data: bytearray, s: Structure) -> str:
    """Rewrite one tensor's dims as a set (overflowing products, zeros, odd sizes), its type id,
    or its data offset; the dims count keeps its place, so later entries still parse."""
    dims_groups: list[list[Field]] = []
    for f in s.fields:
        if f.kind == "dim" and dims_groups and dims_groups[-1][-1].offset + 8 == f.offset:
            dims_groups[-1].append(f)
        elif f.kind == "dim":
            dims_groups.append([f])
    if not dims_groups:
        return field_edit(rng, data, s)
    group = rng.choice(dims_groups)
    values = list(rng.choice(_DIM_SETS))
    infos = [r for r in s.regions if r.kind == "tensor_info"]
    if infos and rng.random() < 0.5:  # change the dims count too, and re-align the data section
        info_end = infos[0].end
        old_data = -(-info_end // 32) * 32
        start = group[0].offset
        struct.pack_into("<I", data, start - 4, len(values))
        head = (
            bytes(data[:start])
            + struct.pack(f"<{len(values)}Q", *values)
            + bytes(data[group[-1].offset + 8 : info_end])
        )
        data[:] = head + bytes(-len(head) % 32) + bytes(data[old_data:])
        return f"dims at {start} -> {values} (count changed)"
    values = (values + [1] * len(group))[: len(group)]
    for f, value in zip(group, values):
        struct.pack_into("<Q", data, f.offset, value)
    end = group[-1].offset + 8
    what = f"dims at {group[0].offset} -> {values}"
    if rng.random() < 0.3 and end + 12 <= len(data):
        type_id = rng.choice((9999, 4, 5, 31, 39, 40, 41, 255, 2**31))
        struct.pack_into("<I", data, end, type_id)
        what += f", type {type_id}"
    return what


# -- choosing --------------------------------------------------------------------------------------

JSON_MUTATORS = ((json_file_edit, 10), (bit_flip, 1), (truncate, 1), (byte_insert, 1), (byte_delete, 1))

_STRUCTURED = {
    "safetensors": ((safetensors_json_edit, 30),),
    "gguf": ((field_edit, 12), (gguf_tensor_edit, 6)),
    "burnpack": ((burnpack_cbor_edit, 20),),
    "zip": ((pickle_edit, 16),),
    "legacy_pickle": ((pickle_edit, 16),),
}


def mutate_file(rng: random.Random, name: str, data: bytes, json_only: bool = False) -> tuple[bytes, str]:
    """One mutation of the file `name`; returns the new bytes and what was done."""
    buffer = bytearray(data)
    s = parse(name, data)
    if name.endswith(".json"):
        table = JSON_MUTATORS
    else:
        table = BYTE_MUTATORS + _STRUCTURED.get(s.kind, ())
    mutators, weights = zip(*table)
    mutator = rng.choices(mutators, weights)[0]
    try:
        what = mutator(rng, buffer, s)
    except (
        ValueError,
        RecursionError,
        OverflowError,
        UnicodeError,
        struct.error,
    ):  # a seed broken by an earlier mutation
        buffer = bytearray(data)
        mutator = bit_flip
        what = bit_flip(rng, buffer, s)
    return bytes(buffer), f"{name}: {mutator.__name__}: {what}"
