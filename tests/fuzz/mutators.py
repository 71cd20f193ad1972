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

from tests.fuzz.structure import Field, Region, Structure, parse

__all__ = ["mutate_file", "JSON_MUTATORS", "BYTE_MUTATORS"]

# -- JSON value edits ------------------------------------------------------------------------------

_RAW = "\x00fuzz-raw-{}\x00"  # a placeholder string replaced by raw JSON text after dumps


class _Raw:
    """Collects raw JSON snippets (text json.dumps cannot write: huge ints, NaN, deep nests,
    duplicate keys) behind placeholder strings."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, text: str) -> str:
        self.texts.append(text)
        return _RAW.format(len(self.texts) - 1)

    def render(self, doc, ensure_ascii: bool, indent: int | None) -> str:
        text = json.dumps(doc, ensure_ascii=ensure_ascii, indent=indent, allow_nan=True)
        for i, raw in reversed(list(enumerate(self.texts))):
            text = text.replace(json.dumps(_RAW.format(i), ensure_ascii=ensure_ascii), raw)
        return text


_WRONG_TYPES = [
    None, True, False, 0, -1, 1, 2, 5, 255, 65536, 1.5, -0.0, 1e308, "", "x", "re:.*", "*", [], {},
    [0, 0], [0], [-1], [{}], [[]], [None], {"a": 1}, "W4A16", "int4", "float", "F32", 2**31, 2**32,
    2**63 - 1, 2**63, 2**64, -(2**63), 10**30, "a" * 300,
]
_RAW_VALUES = [
    "NaN", "Infinity", "-Infinity", "1e999999", "-0", "1" + "0" * 5000, "-" + "9" * 4400,
    "[" * 100_000 + "]" * 100_000, '{"a":' * 20_000 + "1" + "}" * 20_000, "[" * 1500 + "]" * 1500,
    "123456789012345678901234567890", "0.1e-99999", '"\\ud800"', '"\\u0000"', '"\\udfff\\ud800"',
]
_STRINGS = [
    "\u202e\u0000\x1b[31mred", "\ud800", "e\u0301\ufeff", "🧨" * 50, "a" * 100_000, "..", "../../etc/passwd",
    "model.layers.0.self_attn.q_proj.weight", "re:(a+)+$", "re:[", "\n\r\t", "\x7f",
]
_KEYS = [
    "quantization_config", "quant_method", "bits", "group_size", "weight_block_size", "format", "config_groups",
    "ignore", "targets", "weights", "num_bits", "strategy", "block_structure", "modules_to_not_convert",
    "mode", "quantization", "weight_map", "total_size", "dtype", "shape", "data_offsets", "__metadata__",
    "sym", "desc_act", "checkpoint_format", "_tensor_data_names", "tensor_names", "type", "symmetric",
    "dynamic", "observer", "global_scale", "kv_cache_scheme", "input_activations", "quant_type",
    "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "torch_dtype", "activation_scheme", "fmt",
    "zero_point", "version", "is_marlin_format", "scale_dtype", "zp_dtype", "actorder",
]
_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL",
           "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E3M2", "F6_E2M3", "C64", "Q4", "", "f32", "F8_E4M3FNUZ"]


def _nodes(doc, limit: int = 5000) -> list[tuple[object, object]]:
    """(container, key) pairs of every value, breadth-first, at most `limit`."""
    found: list[tuple[object, object]] = []
    todo = [doc]
    while todo and len(found) < limit:
        node = todo.pop(0)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            found.append((node, key))
            if isinstance(child, (dict, list)):
                todo.append(child)
    return found


def _tensor_entries(doc) -> list[dict]:
    if not isinstance(doc, dict):
        return []
    return [v for v in doc.values() if isinstance(v, dict) and "dtype" in v]


def _edit_tensor_entry(rng: random.Random, entry: dict, raw: _Raw) -> str:
    what = rng.choice(("dtype", "shape", "shape", "offsets", "offsets", "delete"))
    if what == "dtype":
        entry["dtype"] = rng.choice(_DTYPES + [5, None, ["F32"]])
        return f"dtype={entry['dtype']!r}"
    if what == "shape":
        shape = entry.get("shape")
        shape = list(shape) if isinstance(shape, list) else []
        op = rng.choice(("zero", "huge", "neg", "append", "drop", "float", "many", "overflow", "empty"))
        if op == "zero" and shape:
            shape[rng.randrange(len(shape))] = 0
        elif op == "huge" and shape:
            shape[rng.randrange(len(shape))] = rng.choice((2**31, 2**32, 2**40, 2**62, 2**63, 2**64 + 1))
        elif op == "neg" and shape:
            shape[rng.randrange(len(shape))] = -1
        elif op == "append":
            shape.append(rng.choice((1, 2, 0, 2**62)))
        elif op == "drop" and shape:
            shape.pop()
        elif op == "float" and shape:
            shape[0] = 2.5
        elif op == "many":
            shape = [1] * rng.choice((9, 64, 1000))
        elif op == "overflow":
            shape = [0, 64, 2**62] if rng.random() < 0.5 else [2**32, 2**32, 2**32]
        elif op == "empty":
            shape = []
        entry["shape"] = shape
        return f"shape={shape if len(shape) < 12 else f'[{len(shape)} dims]'}"
    if what == "offsets":
        offsets = entry.get("data_offsets")
        start, end = offsets if isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets) else (0, 0)
        op = rng.choice(("swap", "end+1", "end-1", "start+1", "huge", "zero", "same", "neg", "three", "past"))
        new = {
            "swap": [end, start], "end+1": [start, end + 1], "end-1": [start, end - 1], "start+1": [start + 1, end],
            "huge": [start, 2**64 - 1], "zero": [0, 0], "same": [start, start], "neg": [-8, end], "three": [start, end, end],
            "past": [start + 2**40, end + 2**40],
        }[op]
        entry["data_offsets"] = new
        return f"data_offsets {op}"
    entry.clear()
    return "entry emptied"


def mutate_json_doc(rng: random.Random, doc, raw: _Raw, nested_json: bool = True) -> tuple[object, str]:
    """Edit one value of a decoded JSON document in place (or return a new root)."""
    entries = _tensor_entries(doc)
    if entries and rng.random() < 0.4:
        return doc, _edit_tensor_entry(rng, rng.choice(entries), raw)
    nodes = _nodes(doc)
    if nested_json:  # a JSON document inside a string value (safetensors __metadata__)
        inner = [(c, k) for c, k in nodes if isinstance(c[k], str) and c[k][:1] in "{[" and len(c[k]) > 1]  # type: ignore[index]
        if inner and rng.random() < 0.5:
            container, key = rng.choice(inner)
            try:
                sub = json.loads(container[key])  # type: ignore[index]
            except ValueError:
                sub = None
            if sub is not None:
                sub_raw = _Raw()
                sub, what = mutate_json_doc(rng, sub, sub_raw, nested_json=False)
                container[key] = sub_raw.render(sub, ensure_ascii=rng.random() < 0.5, indent=None)  # type: ignore[index]
                return doc, f"in {key!s:.40}: {what}"
    if not nodes or rng.random() < 0.03:
        choice = rng.choice(_WRONG_TYPES + [raw(rng.choice(_RAW_VALUES))])
        return choice, f"root={_short(choice)}"
    container, key = rng.choice(nodes)
    value = container[key]  # type: ignore[index]
    op = rng.random()
    if op < 0.30:
        new = rng.choice(_WRONG_TYPES)
        container[key] = new  # type: ignore[index]
        return doc, f"{key!s:.40}={_short(new)}"
    if op < 0.50:
        text = rng.choice(_RAW_VALUES)
        container[key] = raw(text)  # type: ignore[index]
        return doc, f"{key!s:.40}=raw {text[:20]!r}"
    if op < 0.60:
        if isinstance(container, dict):
            del container[key]
        else:
            container.pop(key)  # type: ignore[union-attr]
        return doc, f"deleted {key!s:.40}"
    if op < 0.70 and isinstance(container, dict):
        items = [f"{json.dumps(k)}: {json.dumps(v, allow_nan=True)}" for k, v in container.items() if not _has_raw(v)]
        dup = f"{json.dumps(key)}: {json.dumps(rng.choice(_WRONG_TYPES))}"
        items.insert(rng.randrange(len(items) + 1), dup)
        parent_nodes = [(c, k) for c, k in nodes if c[k] is container]  # type: ignore[index]
        if parent_nodes:
            parent, pkey = parent_nodes[0]
            parent[pkey] = raw("{" + ", ".join(items) + "}")  # type: ignore[index]
            return doc, f"duplicate key {key!s:.40}"
        return raw("{" + ", ".join(items) + "}"), f"duplicate key {key!s:.40} at the root"
    if op < 0.80 and isinstance(value, (dict, list)) or isinstance(container, dict) and op < 0.80:
        target = value if isinstance(value, dict) else container
        if isinstance(target, dict):
            new_key = rng.choice(_KEYS + _STRINGS[:4])
            target[new_key] = rng.choice(_WRONG_TYPES + [raw(rng.choice(_RAW_VALUES))])
            return doc, f"added key {new_key!r:.40}"
    if op < 0.88:
        new = rng.choice(_STRINGS)
        container[key] = new  # type: ignore[index]
        return doc, f"{key!s:.40}=string {new[:12]!r}"
    if isinstance(value, list):
        op2 = rng.choice(("double", "empty", "grow", "reverse"))
        container[key] = {"double": value * 2, "empty": [], "grow": value + [value[-1] if value else 0] * 1000, "reverse": value[::-1]}[op2]  # type: ignore[index]
        return doc, f"{key!s:.40} list {op2}"
    if isinstance(value, int) and not isinstance(value, bool):
        new = rng.choice((value + 1, value - 1, -value, value * 2**32, 0, 2**63, -(2**63) - 1))
        container[key] = new  # type: ignore[index]
        return doc, f"{key!s:.40}={new}"
    container[key] = [value] if rng.random() < 0.5 else {"value": value}  # type: ignore[index]
    return doc, f"{key!s:.40} wrapped"


def _has_raw(value) -> bool:
    return _RAW.split("{")[0] in json.dumps(value) if isinstance(value, (dict, list, str)) else False


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


# -- byte-level ------------------------------------------------------------------------------------

_INTERESTING = {
    "<B": (0, 1, 0x7F, 0x80, 0xFF), "<b": (0, -1, 127, -128), "<H": (0, 1, 0x7FFF, 0x8000, 0xFFFF),
    "<h": (0, -1, 32767, -32768), "<I": (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF), "<i": (0, -1, 2**31 - 1, -(2**31)),
    "<Q": (0, 1, 2**31, 2**32, 2**62, 2**63, 2**64 - 1, 2**40), "<q": (0, -1, 2**63 - 1, -(2**63)),
}


def _pick_offset(rng: random.Random, data: bytearray, s: Structure) -> int:
    """Mostly inside a header region (where the parsers are), sometimes anywhere."""
    headers = [r for r in s.header_regions() if r.end > r.start]
    if headers and rng.random() < 0.8:
        region = rng.choice(headers)
        return rng.randrange(region.start, min(region.end, len(data)) or 1) if region.end <= len(data) else rng.randrange(max(1, len(data)))
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
    pos = rng.choice(sorted(s.boundaries | s.minor)) if s.boundaries and rng.random() < 0.6 else _pick_offset(rng, data, s)
    blob = bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 4, 8, 16)))) if rng.random() < 0.7 else bytes([rng.choice((0, 0xFF, 0x20))]) * rng.choice((64, 4096))
    data[pos:pos] = blob
    return f"insert {len(blob)} bytes at {pos}"


def byte_delete(rng, data: bytearray, s: Structure) -> str:
    pos = rng.choice(sorted(s.boundaries | s.minor)) if s.boundaries and rng.random() < 0.6 else _pick_offset(rng, data, s)
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
        new = rng.choice((old + 1, old - 1, 0, hi, hi - 1, old * 2, old * 16 + 1, rng.randint(lo, hi)) + _INTERESTING.get(f.fmt, ()))
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
    (bit_flip, 5), (byte_set, 2), (byte_insert, 2), (byte_delete, 2), (truncate, 3), (field_edit, 4), (splice, 1), (data_bit_flip, 4),
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
    raw = _Raw()
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
    raw = _Raw()
    doc, what = mutate_json_doc(rng, doc, raw)
    data[:] = raw.render(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice((None, 2))).encode("utf-8", "surrogatepass")
    return f"JSON: {what}"


def burnpack_cbor_edit(rng, data: bytearray, s: Structure) -> str:
    import cbor2

    regions = [r for r in s.regions if r.kind == "cbor"]
    if not regions:
        return bit_flip(rng, data, s)
    region = regions[0]
    try:
        doc = cbor2.loads(bytes(data[region.start : region.end]))
    except Exception:  # noqa: BLE001
        return bit_flip(rng, data, s)
    raw = _Raw()
    doc, what = mutate_json_doc(rng, doc, raw, nested_json=False)
    doc, placed = _resolve_raw_for_cbor(rng, doc, raw)
    if placed:  # CBOR has no raw text: say what took the raw value's place
        what = what.split("=raw")[0] + "=" + ", ".join(placed)
    try:
        blob = cbor2.dumps(doc)
    except Exception:  # noqa: BLE001 - e.g. lone surrogates
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


def _resolve_raw_for_cbor(rng, doc, raw: _Raw):
    """CBOR has no raw text: a placeholder becomes a deep nest, a huge int or NaN."""
    marker = _RAW.split("{")[0]
    placed: list[str] = []
    choices = (
        ("NaN", float("nan")), ("inf", float("inf")), ("10**5000", 10**5000), ("-(10**80)", -(10**80)),
        ("list nested 300 deep", _nest(300)), ("list nested 5000 deep", _nest(5000, {})), ("8 bytes ff", b"\xff" * 8),
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
    inside = Structure("pickle", [f for f in s.fields if region.start <= f.offset < region.end], {b for b in s.boundaries if region.start <= b <= region.end}, regions=[region])
    op = rng.random()
    if op < 0.5 and inside.fields:
        what = field_edit(rng, data, inside)
    elif op < 0.8:
        pos = rng.randrange(region.start, max(region.start + 1, region.end))
        data[pos] ^= 1 << rng.randrange(8)
        what = f"pickle bit flip at {pos}"
    else:
        ops = [b for b in sorted(inside.boundaries) if b < region.end]
        pos = rng.choice(ops) if ops else region.start
        opcode = rng.choice((b"N", b")", b"]", b"}", b"(", b"t", b"R", b".", b"0", b"2", b"h\x00", b"q\x00", b"\x88", b"K\x05", b"J\xff\xff\xff\x7f", b"c__builtin__\neval\n", b"\x8a\x09" + b"\xff" * 9))
        data[pos : pos + len(opcode)] = opcode
        what = f"pickle opcode {opcode[:12]!r} at {pos}"
    if data[:4] == b"PK\x03\x04" and rng.random() < 0.85:
        _fix_zip_crcs(data)
        what += " (CRCs fixed)"
    return what


_DIM_SETS = (
    (0, 64, 2**62), (2**62, 0), (2**32, 2**32), (2**63, 2), (2**64 - 1, 1), (0,), (1, 0), (3, 5), (2**31, 2**31, 4),
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
        head = bytes(data[:start]) + struct.pack(f"<{len(values)}Q", *values) + bytes(data[group[-1].offset + 8 : info_end])
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
    except (ValueError, RecursionError, OverflowError, UnicodeError, struct.error):  # a seed broken by an earlier mutation
        buffer = bytearray(data)
        mutator = bit_flip
        what = bit_flip(rng, buffer, s)
    return bytes(buffer), f"{name}: {mutator.__name__}: {what}"
