"""A GGUF's key-values read as a stranger's: each value asked for with the type it must have.

`qtool.formats.gguf.read_gguf_key_values` gives every key-value of a file with its exact GGUF
type, bounds-checked. What a key is supposed to hold is the reader's to say: a hyperparameter a
whole number in range, an epsilon a finite positive float, a vocabulary an array of strings of
UTF-8. `GgufMetadata` asks each key that question once, and a wrong answer is one
CheckpointError naming the file and the key (exit 2), never a TypeError deep in transformers.
"""

from __future__ import annotations

import math
from typing import Any

from qtool.errors import CheckpointError

__all__ = ["GgufMetadata", "INTEGERS", "FLOATS", "SIZE_LIMIT", "HINT"]

SIZE_LIMIT = 1 << 31  # a width, count or context length beyond this is no model's
HINT = "the GGUF's metadata does not describe its model; convert it again with llama.cpp's convert_hf_to_gguf.py"
INTEGERS = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
FLOATS = ("FLOAT32", "FLOAT64")


class GgufMetadata:
    """A GGUF's key-values by key, each read with its type checked: what is wrong with one is a
    CheckpointError naming the file and the key."""

    def __init__(self, path: str, entries: list[tuple[str, object, str]]) -> None:
        self.path = path
        self.values = {key: (value, kind) for key, value, kind in entries}

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def fail(self, key: str, problem: str) -> CheckpointError:
        return CheckpointError(f"metadata key {key} {problem}", path=self.path, hint=HINT)

    def _get(self, key: str, required: bool) -> tuple[Any, str] | None:
        if key not in self.values:
            if required:
                raise self.fail(key, "is missing")
            return None
        return self.values[key]

    def size(self, key: str, *, required: bool = False, limit: int = SIZE_LIMIT) -> int | None:
        """A whole number from 1 to `limit` - 1."""
        got = self._get(key, required)
        if got is None:
            return None
        value, kind = got
        if kind not in INTEGERS:
            raise self.fail(key, f"is {_kind_words(kind)}, not an integer")
        if not 0 < value < limit:
            raise self.fail(key, f"is {value}, not from 1 to {limit - 1}")
        return value

    def real(self, key: str, *, required: bool = False) -> float | None:
        """A finite positive float (as transformers' reader gives it: the float32 widened)."""
        got = self._get(key, required)
        if got is None:
            return None
        value, kind = got
        if kind not in FLOATS:
            raise self.fail(key, f"is {_kind_words(kind)}, not a float")
        if not (math.isfinite(value) and value > 0):
            raise self.fail(key, f"is {value!r}, not a finite positive number")
        return float(value)

    def text(self, key: str, *, required: bool = False) -> str | None:
        got = self._get(key, required)
        if got is None:
            return None
        value, kind = got
        if kind != "STRING":
            raise self.fail(key, f"is {_kind_words(kind)}, not a string")
        return self.utf8(key, value)

    def flag(self, key: str) -> bool | None:
        got = self._get(key, False)
        if got is None:
            return None
        value, kind = got
        if kind != "BOOL":
            raise self.fail(key, f"is {_kind_words(kind)}, not a bool")
        return bool(value)

    def token_id(self, key: str, vocab_size: int) -> int | None:
        got = self._get(key, False)
        if got is None:
            return None
        value, kind = got
        if kind not in INTEGERS:
            raise self.fail(key, f"is {_kind_words(kind)}, not an integer")
        if not 0 <= value < vocab_size:
            raise self.fail(key, f"is {value}, not a token id of the {vocab_size} the token embedding has")
        return value

    def utf8(self, key: str, raw: bytes, index: int | None = None) -> str:
        """Text from key `key` (item `index` of its array): UTF-8, as transformers' reader
        decodes it, or a CheckpointError."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            where = "" if index is None else f" (item {index})"
            raise self.fail(key, f"is not UTF-8{where}") from None

    def array(self, key: str, kinds: tuple[str, ...]) -> tuple[Any, str] | None:
        """An array of one of `kinds` (element type names), as the reader holds it."""
        got = self._get(key, False)
        if got is None:
            return None
        value, kind = got
        if not kind.startswith("ARRAY:") or kind[6:] not in kinds:
            raise self.fail(key, f"is {_kind_words(kind)}, not an array of {' or '.join(k.lower() for k in kinds)}")
        return value, kind[6:]


def _kind_words(kind: str) -> str:
    """A GGUF value type as a message says it: "a uint32", "an array of str"."""
    if kind.startswith("ARRAY:"):
        return f"an array of {kind[6:].lower()}"
    word = kind.lower()
    return f"an {word}" if word.startswith("int") else f"a {word}"  # a uint32, an int32
