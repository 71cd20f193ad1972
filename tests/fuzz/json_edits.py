"""Edits of a decoded JSON (or CBOR) document: wrong types, huge integers, NaN, deep nesting,
duplicate keys, hostile strings, deleted and added keys, JSON inside string values, and the
dtype, shape and data_offsets of safetensors tensor entries. Text that `json.dumps` cannot write
(a 5,000-digit integer, NaN, a 100,000-deep nest, a duplicate key) goes in as a placeholder
string that `Raw.render` swaps for the raw text.
"""

from __future__ import annotations

import json
import random

__all__ = ["RAW_MARKER", "Raw", "mutate_json_doc"]

_RAW = "\x00fuzz-raw-{}\x00"  # a placeholder string replaced by raw JSON text after dumps


class Raw:
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
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    5,
    255,
    65536,
    1.5,
    -0.0,
    1e308,
    "",
    "x",
    "re:.*",
    "*",
    [],
    {},
    [0, 0],
    [0],
    [-1],
    [{}],
    [[]],
    [None],
    {"a": 1},
    "W4A16",
    "int4",
    "float",
    "F32",
    2**31,
    2**32,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    10**30,
    "a" * 300,
]
_RAW_VALUES = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999999",
    "-0",
    "1" + "0" * 5000,
    "-" + "9" * 4400,
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 20_000 + "1" + "}" * 20_000,
    "[" * 1500 + "]" * 1500,
    "123456789012345678901234567890",
    "0.1e-99999",
    '"\\ud800"',
    '"\\u0000"',
    '"\\udfff\\ud800"',
]
_STRINGS = [
    "\u202e\u0000\x1b[31mred",
    "\ud800",
    "e\u0301\ufeff",
    "🧨" * 50,
    "a" * 100_000,
    "..",
    "../../etc/passwd",
    "model.layers.0.self_attn.q_proj.weight",
    "re:(a+)+$",
    "re:[",
    "\n\r\t",
    "\x7f",
]
_KEYS = [
    "quantization_config",
    "quant_method",
    "bits",
    "group_size",
    "weight_block_size",
    "format",
    "config_groups",
    "ignore",
    "targets",
    "weights",
    "num_bits",
    "strategy",
    "block_structure",
    "modules_to_not_convert",
    "mode",
    "quantization",
    "weight_map",
    "total_size",
    "dtype",
    "shape",
    "data_offsets",
    "__metadata__",
    "sym",
    "desc_act",
    "checkpoint_format",
    "_tensor_data_names",
    "tensor_names",
    "type",
    "symmetric",
    "dynamic",
    "observer",
    "global_scale",
    "kv_cache_scheme",
    "input_activations",
    "quant_type",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "torch_dtype",
    "activation_scheme",
    "fmt",
    "zero_point",
    "version",
    "is_marlin_format",
    "scale_dtype",
    "zp_dtype",
    "actorder",
]
_DTYPES = [
    "F32",
    "F16",
    "BF16",
    "F64",
    "I8",
    "U8",
    "I16",
    "U16",
    "I32",
    "U32",
    "I64",
    "U64",
    "BOOL",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "F4",
    "F6_E3M2",
    "F6_E2M3",
    "C64",
    "Q4",
    "",
    "f32",
    "F8_E4M3FNUZ",
]


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


def _edit_tensor_entry(rng: random.Random, entry: dict, raw: Raw) -> str:
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
        start, end = (
            offsets
            if isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)
            else (0, 0)
        )
        op = rng.choice(("swap", "end+1", "end-1", "start+1", "huge", "zero", "same", "neg", "three", "past"))
        new = {
            "swap": [end, start],
            "end+1": [start, end + 1],
            "end-1": [start, end - 1],
            "start+1": [start + 1, end],
            "huge": [start, 2**64 - 1],
            "zero": [0, 0],
            "same": [start, start],
            "neg": [-8, end],
            "three": [start, end, end],
            "past": [start + 2**40, end + 2**40],
        }[op]
        entry["data_offsets"] = new
        return f"data_offsets {op}"
    entry.clear()
    return "entry emptied"


def mutate_json_doc(rng: random.Random, doc, raw: Raw, nested_json: bool = True) -> tuple[object, str]:
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
                sub_raw = Raw()
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
    if op < 0.70 and isinstance(container, dict) and _dumpable(container):  # not CBOR's byte strings
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
        container[key] = {
            "double": value * 2,
            "empty": [],
            "grow": value + [value[-1] if value else 0] * 1000,
            "reverse": value[::-1],
        }[op2]  # type: ignore[index]
        return doc, f"{key!s:.40} list {op2}"
    if isinstance(value, int) and not isinstance(value, bool):
        new = rng.choice((value + 1, value - 1, -value, value * 2**32, 0, 2**63, -(2**63) - 1))
        container[key] = new  # type: ignore[index]
        return doc, f"{key!s:.40}={new}"
    container[key] = [value] if rng.random() < 0.5 else {"value": value}  # type: ignore[index]
    return doc, f"{key!s:.40} wrapped"


def _dumpable(value) -> bool:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        return False
    return True


def _has_raw(value) -> bool:
    return _RAW.split("{")[0] in json.dumps(value) if isinstance(value, (dict, list, str)) else False


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


RAW_MARKER = _RAW.split("{")[0]
