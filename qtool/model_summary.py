"""What a report says about one model as a whole: where it is, which revision, its size and its
bits per weight, overall and by scheme. The compare, quantize and check documents carry one per
model they read or wrote (`models` / `model`), so a reader (the HTML report, a CI script) shows
the same figures without reading the checkpoint again.

    {"path": str, "format": str, "revision": null | {"source", "repo", "commit", ...},
     "weights": int, "parameters": int, "bytes": int, "bits_per_weight": float,
     "by_scheme": {LABEL | "plain": {"weights": int, "parameters": int, "bytes": int, "bits_per_weight": float}}}

Bits per weight are `bytes * 8 / parameters` over every member tensor, rounded to 4 decimals as
`qtool inspect` reports them.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable

from qtool.formats.revision import revision_of

__all__ = ["describe_model", "PLAIN"]

PLAIN = "plain"  # the by_scheme key of weights that are not quantized, as in `inspect`


def _bits(nbytes: int, parameters: int) -> float:
    return round(nbytes * 8 / parameters, 4) if parameters else 0.0


def describe_model(
    path: str,
    container: str,
    weights: Iterable[tuple[str | None, int, int]],
    *,
    revision: bool | dict[str, str | None] | None = True,
) -> dict[str, Any]:
    """`weights`: (scheme label or None, parameters, bytes) per weight. `revision`: True to
    look it up now; else the one looked up before (`revision_of`, a run does so before it
    commits anything), None where it is unknown or for a model qtool has just written."""
    by_scheme: dict[str, dict[str, Any]] = {}
    count = total_parameters = total_bytes = 0
    for label, parameters, nbytes in weights:
        entry = by_scheme.setdefault(label or PLAIN, {"weights": 0, "parameters": 0, "bytes": 0})
        entry["weights"] += 1
        entry["parameters"] += parameters
        entry["bytes"] += nbytes
        count += 1
        total_parameters += parameters
        total_bytes += nbytes
    for entry in by_scheme.values():
        entry["bits_per_weight"] = _bits(entry["bytes"], entry["parameters"])
    return {
        "path": path,
        "format": container,
        "revision": revision_of(path) if revision is True else revision or None,
        "weights": count,
        "parameters": total_parameters,
        "bytes": total_bytes,
        "bits_per_weight": _bits(total_bytes, total_parameters),
        "by_scheme": dict(sorted(by_scheme.items(), key=lambda kv: (kv[0] == PLAIN, kv[0]))),
    }
