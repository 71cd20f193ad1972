"""JSON from strangers: parsed with limits, then read through the types its consumer declares.

Every JSON qtool reads comes from a file it did not write: side files (config.json,
quantize_config.json, quanto maps, *.index.json), JSON held in safetensors `__metadata__`
strings (compressed-tensors' quantization_config, torchao's tensor records) and JSON stored as
tensor bytes (bitsandbytes' quant state, burn's QFloat scheme). Python's `json` turns hostile
input into a RecursionError (deep nesting), a ValueError (an integer over 4,300 digits) or a
consumer's TypeError/ZeroDivisionError (`"ignore": 5`, `"block_structure": [0, 0]`). Here:

- `parse_json` parses with a size limit, a depth limit and a size limit on every number
  literal, and raises one `CheckpointError` naming the file (and the field, for embedded JSON).
  NaN, Infinity and -Infinity are read as floats, as Python's `json` (which writes them, and
  which transformers and compressed-tensors read with) does; a number literal that overflows
  a float (1e400) is refused, and so is a string holding a lone UTF-16 surrogate ("\ud800"),
  which no UTF-8 output could print or write back.
- A consumer declares the shape it reads as a small spec (`Record`, `ListOf`, `Integer`, ...)
  and `spec.check(value, where, path)` returns the value or raises `JsonTypeError`, one line:
  `config.json: quantization_config.ignore is 5, expected a list of strings`. Keys a spec does
  not name are left alone; a missing key or a JSON null reads as absent.

    WEIGHTS = Record({"num_bits": Integer(min=1, max=32), "block_structure": ListOf(Integer(min=1), length=2)})
    args = WEIGHTS.check(raw, where="quantization_config.config_groups.group_0.weights", path=path)
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
from collections.abc import Callable, Mapping
from typing import Any

from qtool.errors import CheckpointError, JsonTypeError

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_FLOAT_CHARS",
    "parse_json",
    "parse_strict_json",
    "DuplicateKey",
    "lone_surrogate",
    "Spec",
    "Anything",
    "Integer",
    "Number",
    "String",
    "Boolean",
    "ListOf",
    "Record",
    "MapOf",
    "AnyOf",
    "Constant",
    "side_file_path",
    "describe",
    "field_path",
]

MAX_JSON_BYTES = 64 << 20  # a config is KBs, a 100k-tensor index a few MB, a tokenizer.json ~10 MB
MAX_DEPTH = 64  # HF configs nest 5-6 levels, torchao's records about 8
MAX_INT_DIGITS = 40  # a u64 has 20 digits; Python refuses int() past 4,300 with a ValueError
MAX_FLOAT_CHARS = 100  # repr of a double is at most 24 characters
_HINT = "fix or remove the file"


class _LimitExceeded(Exception):
    """Raised inside a json hook; turned into a CheckpointError by parse_json."""


def _parse_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise _LimitExceeded(f"holds an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_FLOAT_CHARS:
        raise _LimitExceeded(f"holds a number literal of {len(text)} characters (at most {MAX_FLOAT_CHARS})")
    value = float(text)
    if math.isinf(value):
        raise _LimitExceeded(f"holds the number {text[:40]}, which overflows a double")
    return value


_CONSTANTS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _depth_over(value: Any, limit: int) -> bool:
    """Whether `value` nests containers more than `limit` deep; one pass per level, linear."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            below.extend(child for child in children if isinstance(child, (dict, list)))
        level = below
    return False


# `\ud800`-`\udfff` escapes: JSON can spell a lone UTF-16 surrogate, which Python keeps in a str
# that no UTF-8 output (a table, --json, a written config.json) can encode. Only text holding
# such an escape is walked for one (a pair, as in emoji, decodes to one character and is fine).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate(value: Any) -> str | None:
    """The first string (value or key) in `value` that is not Unicode text, or None; linear."""
    stack = [value]
    while stack:
        item = stack.pop()
        texts = list(item) if isinstance(item, dict) else [item] if isinstance(item, str) else []
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return text
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def parse_json(
    raw: bytes | str,
    path: str,
    *,
    where: str | None = None,
    hint: str = _HINT,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """`raw` parsed, or a one-line CheckpointError naming `path` (and `where`, the field or
    tensor that held the JSON, for JSON inside another file)."""
    prefix = f"{where} " if where else ""

    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"{prefix}{problem}", path=path, hint=hint)

    if len(raw) > max_bytes:
        unit = "characters" if isinstance(raw, str) else "bytes"
        raise fail(f"is {len(raw)} {unit} of JSON (at most {max_bytes})")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise fail(f"is not UTF-8 (byte {exc.start})") from None
    else:
        text = raw
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_CONSTANTS.__getitem__)
    except _LimitExceeded as exc:
        raise fail(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise fail(f"is not valid JSON at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise fail(f"nests deeper than {max_depth} levels") from None
    if _depth_over(value, max_depth):
        raise fail(f"nests deeper than {max_depth} levels")
    if _SURROGATE_ESCAPE.search(text) and (bad := lone_surrogate(value)) is not None:
        raise fail(f"holds the string {describe(bad)}, whose lone UTF-16 surrogate is not Unicode text")
    return value


class DuplicateKey(ValueError):
    """A key twice in one object (`top_level`: in the outermost one)."""

    def __init__(self, key: str, top_level: bool) -> None:
        super().__init__(key)
        self.key = key
        self.top_level = top_level


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """serde refuses duplicate keys at every level; json.loads keeps the last. dict() is C, so
    the common case costs one length check."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:  # only the top level holds objects (the entries and __metadata__)
                raise DuplicateKey(key, top_level=any(isinstance(value, dict) for _, value in pairs))
            seen.add(key)
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_strict_json(text: str) -> Any:
    """JSON parsed as the safetensors reference reader (serde) parses a header: a duplicated
    key at any level is refused (`DuplicateKey`), NaN and Infinity are not JSON. Numbers are
    Python's own (a header's are checked field by field afterwards); the caller bounds the size
    and names the file: a ValueError or RecursionError says what is wrong. This is the header's
    fast path: one C call per object, where `parse_json` calls back per number."""
    return json.loads(text, object_pairs_hook=_strict_object, parse_constant=_no_constants)


def side_file_path(checkpoint_path: str, name: str) -> str:
    """Where the side file `name` of the checkpoint the user named lies (for messages): beside
    the weights file or index, or inside the folder or remote repository."""
    if "://" in checkpoint_path:
        base = checkpoint_path.rstrip("/")
        if base.endswith((".safetensors", ".json", ".gguf")):
            base = posixpath.dirname(base)
        return f"{base}/{name}"
    folder = checkpoint_path if os.path.isdir(checkpoint_path) else os.path.dirname(checkpoint_path)
    return os.path.join(folder, name)


# -- declared types -------------------------------------------------------------------------------


def describe(value: Any, limit: int = 40) -> str:
    """A JSON value as a message shows it: `5`, `{}`, `["x"]`, cut at `limit` characters."""
    try:
        text = json.dumps(value, ensure_ascii=True, allow_nan=True)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def field_path(where: str, key: str) -> str:
    """`where.key`, or `where["key"]` for a key that is not a plain name (strangers' keys)."""
    if key.isidentifier() and len(key) <= 64:
        return f"{where}.{key}" if where else key
    return f"{where}[{describe(key)}]"


class Spec:
    """The JSON type a consumer expects at one place. `check` returns the value (for a Record,
    the declared keys that are present) or raises JsonTypeError."""

    expected = "a JSON value"

    def check(self, value: Any, where: str, path: str | None = None, hint: str | None = None) -> Any:
        def fail(at: str, bad: Any, expected: str) -> JsonTypeError:
            return JsonTypeError(at, describe(bad), expected, path=path, hint=hint)

        return self._check(value, where, fail)

    def _check(self, value: Any, where: str, fail: Callable[..., JsonTypeError]) -> Any:
        raise NotImplementedError


class Anything(Spec):
    """Any JSON value, unchecked (a field passed through without being read)."""

    def _check(self, value, where, fail):
        return value


class Integer(Spec):
    """A JSON integer (not a boolean, not 4.0) within [min, max]."""

    def __init__(self, min: int | None = None, max: int | None = None) -> None:
        self.min, self.max = min, max
        if min is not None and max is not None:
            self.expected = f"an integer from {min} to {max}"
        elif min is not None or max is not None:
            self.expected = f"an integer ≥ {min}" if min is not None else f"an integer ≤ {max}"
        else:
            self.expected = "an integer"

    def _check(self, value, where, fail):
        if (
            type(value) is not int
            or (self.min is not None and value < self.min)
            or (self.max is not None and value > self.max)
        ):
            raise fail(where, value, self.expected)
        return value


class Number(Spec):
    """A JSON number (integer or float, not a boolean); `finite` refuses NaN and the infinities."""

    def __init__(self, finite: bool = False) -> None:
        self.finite = finite
        self.expected = "a finite number" if finite else "a number"

    def _check(self, value, where, fail):
        if type(value) not in (int, float) or (self.finite and not math.isfinite(value)):
            raise fail(where, value, self.expected)
        return value


class String(Spec):
    """A JSON string, of at most `max_chars` characters."""

    def __init__(self, max_chars: int = 4096) -> None:
        self.max_chars = max_chars
        self.expected = "a string"

    def _check(self, value, where, fail):
        if not isinstance(value, str):
            raise fail(where, value, self.expected)
        if len(value) > self.max_chars:
            raise fail(where, value, f"a string of at most {self.max_chars} characters")
        return value


class Boolean(Spec):
    expected = "true or false"

    def _check(self, value, where, fail):
        if not isinstance(value, bool):
            raise fail(where, value, self.expected)
        return value


def _plural(expected: str) -> str:
    """ "a string" -> "strings", "an integer ≥ 1" -> "integers ≥ 1" (for "a list of ...")."""
    words = expected.split(" ")
    if words[0] in ("a", "an") and len(words) > 1:
        noun = words[1] + ("es" if words[1].endswith("s") else "s")
        return " ".join([noun, *words[2:]])
    return expected


class ListOf(Spec):
    """A JSON array whose every item is `item`; `length` fixes its size, `max_items` caps it."""

    def __init__(self, item: Spec, *, length: int | None = None, max_items: int | None = None) -> None:
        self.item, self.length, self.max_items = item, length, max_items
        size = f" of {length}" if length is not None else ""
        self.expected = f"a list{size} of {_plural(item.expected)}"

    def _check(self, value, where, fail):
        if (
            not isinstance(value, list)
            or (self.length is not None and len(value) != self.length)
            or (self.max_items is not None and len(value) > self.max_items)
        ):
            raise fail(where, value, self.expected)
        return [self.item._check(item, f"{where}[{index}]", fail) for index, item in enumerate(value)]


class Record(Spec):
    """A JSON object with the declared `fields`, each optional (a missing key or a null is
    absent from the result). `rest` checks the keys not declared; without it they are dropped."""

    expected = "an object"

    def __init__(self, fields: Mapping[str, Spec], rest: Spec | None = None) -> None:
        self.fields, self.rest = dict(fields), rest

    def _check(self, value, where, fail):
        if not isinstance(value, dict):
            raise fail(where, value, self.expected)
        checked: dict[str, Any] = {}
        for key, item in value.items():
            spec = self.fields.get(key, self.rest)
            if spec is not None and item is not None:
                checked[key] = spec._check(item, field_path(where, key), fail)
        return checked


def MapOf(value: Spec) -> Record:
    """A JSON object of any keys, each holding `value`."""
    return Record({}, rest=value)


class AnyOf(Spec):
    """The first of `options` the value fits ("an object or false", "an integer or a string")."""

    def __init__(self, *options: Spec) -> None:
        self.options = options
        self.expected = " or ".join(o.expected for o in options)

    def _check(self, value, where, fail):
        for option in self.options:
            try:
                return option._check(value, where, fail)
            except JsonTypeError as exc:
                if exc.where != where:  # the type fitted, a part inside it did not: that is the error
                    raise
        raise fail(where, value, self.expected)


class Constant(Spec):
    """Exactly `value` (mlx's `false` for a module left unquantized)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.expected = describe(value)

    def _check(self, value, where, fail):
        if value is not self.value and not (type(value) is type(self.value) and value == self.value):
            raise fail(where, value, self.expected)
        return value
