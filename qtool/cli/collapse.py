"""Fold repeated layers into one row for the human table:
`model.layers.[0-31].mlp.up_proj.weight ×32`, when every other key column matches."""

from __future__ import annotations

import re
from typing import Any
from collections.abc import Sequence

__all__ = ["collapse_rows", "format_indices"]

_NUMERIC_SEGMENT = re.compile(r"(?<=\.)(\d+)(?=\.)")


def format_indices(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    ordered = sorted(set(indices))
    runs: list[str] = []
    start = prev = ordered[0]
    for index in ordered[1:] + [None]:  # type: ignore[operator]
        if index is not None and index == prev + 1:
            prev = index
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if index is not None:
            start = prev = index
    return ",".join(runs)


def collapse_rows(rows: list[list[Any]], key_columns: Sequence[int], sum_columns: Sequence[int]) -> list[list[Any]]:
    """Merge rows whose names differ only in their first numeric path segment and that agree on
    `key_columns`; `sum_columns` are added up. Column 0 is the name. A group keeps the place of
    its first row."""
    groups: dict[tuple, list[int]] = {}
    indices: dict[tuple, list[int]] = {}
    for position, row in enumerate(rows):
        match = _NUMERIC_SEGMENT.search(row[0])
        if match is None:
            key: tuple = (None, None, position)
            index = None
        else:
            prefix, suffix = row[0][: match.start()], row[0][match.end() :]
            key = (prefix, suffix, *(repr(row[c]) for c in key_columns))
            index = int(match.group(1))
        groups.setdefault(key, []).append(position)
        if index is not None:
            indices.setdefault(key, []).append(index)
    out = []
    for key, members in groups.items():
        first = list(rows[members[0]])
        if len(members) > 1:
            prefix, suffix = key[0], key[1]
            first[0] = f"{prefix}[{format_indices(indices[key])}]{suffix} ×{len(members)}"
            for column in sum_columns:
                first[column] = sum(rows[m][column] for m in members)
        out.append(first)
    return out
