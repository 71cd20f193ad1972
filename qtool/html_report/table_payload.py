"""The per-weight table as the page carries it: every row of the report, small enough that a
60,000-weight model's report stays a few MB, decoded by the page's script.

    {"columns": [{"key", "label", "type": "name"|"text"|"number"|"bytes"|"db"|"count", "unit", "sort": "asc"|"desc"}],
     "rows": int,
     "data": {key: column}}

A column is stored by type: a `name` column front-coded in row order (`{"prefix": [int],
"suffix": [str]}`: each name shares `prefix[i]` characters with the one before), a `text` column
as a dictionary (`{"values": [str | null], "index": [int]}`), anything else as a list of
numbers (or null) exactly as the document holds them. The JSON is gzip-compressed and base64
encoded (the page decompresses it with the browser's DecompressionStream). `decode` gives the
rows back, as the tests and any script reading a report do.
"""

from __future__ import annotations

import base64
import gzip
import json
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

__all__ = ["Column", "encode", "decode"]


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    type: str  # name, text, number, bytes, db, count
    unit: str = ""
    sort: str = "asc"  # the first click's direction: where the worst rows are
    title: str = ""  # the header's tooltip
    status: str = (
        ""  # a db column: the key of the text column saying why a value is null ("exact" sorts last, others first)
    )

    def to_json(self) -> dict[str, str]:
        return {
            "key": self.key,
            "label": self.label,
            "type": self.type,
            "unit": self.unit,
            "sort": self.sort,
            "title": self.title,
            "status": self.status,
        }


def _front_coded(names: Sequence[str]) -> dict[str, list]:
    prefix, suffix = [], []
    previous = ""
    for name in names:
        shared = 0
        limit = min(len(previous), len(name))
        while shared < limit and previous[shared] == name[shared]:  # linear in the name's length
            shared += 1
        prefix.append(shared)
        suffix.append(name[shared:])
        previous = name
    return {"prefix": prefix, "suffix": suffix}


def _dictionary(values: Sequence[Any]) -> dict[str, list]:
    seen: dict[Any, int] = {}
    index = [seen.setdefault(value, len(seen)) for value in values]
    return {"values": list(seen), "index": index}


def encode(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> str:
    """The base64 text of the gzip-compressed table."""
    data: dict[str, Any] = {}
    for column in columns:
        values = [row.get(column.key) for row in rows]
        if column.type == "name":
            data[column.key] = _front_coded(values)
        elif column.type == "text":
            data[column.key] = _dictionary(values)
        else:
            data[column.key] = values
    document = {"columns": [c.to_json() for c in columns], "rows": len(rows), "data": data}
    raw = json.dumps(document, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")


def decode(payload: str) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """(columns, rows) back from `encode`'s text."""
    document = json.loads(gzip.decompress(base64.b64decode(payload)))
    count = document["rows"]
    rows: list[dict[str, Any]] = [{} for _ in range(count)]
    for column in document["columns"]:
        stored = document["data"][column["key"]]
        if column["type"] == "name":
            previous = ""
            values = []
            for shared, tail in zip(stored["prefix"], stored["suffix"]):
                previous = previous[:shared] + tail
                values.append(previous)
        elif column["type"] == "text":
            values = [stored["values"][i] for i in stored["index"]]
        else:
            values = stored
        for row, value in zip(rows, values):
            row[column["key"]] = value
    return document["columns"], rows
