"""Per-weight SQNR in fixed 5 dB bins: what `compare` and `quantize` report as a histogram, so
the table of hundreds of weights has a shape at a glance.

    {"bin_db": 5, "bins": [{"from_db": int, "to_db": int, "weights": int}],   # lowest to highest filled bin
     "exact": int,        # weights with no error at all (SQNR +inf)
     "no_signal": int}    # weights whose original is all zeros while the copy is not (SQNR -inf)
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Iterable

__all__ = ["HISTOGRAM_BIN_DB", "sqnr_histogram"]

HISTOGRAM_BIN_DB = 5


def sqnr_histogram(values: Iterable[float]) -> dict[str, Any]:
    """`values`: each measured weight's SQNR in dB (+inf exact, -inf no signal; NaN is skipped)."""
    counts: dict[int, int] = {}
    exact = no_signal = 0
    for value in values:
        if value == math.inf:
            exact += 1
        elif value == -math.inf:
            no_signal += 1
        elif math.isfinite(value):
            low = math.floor(value / HISTOGRAM_BIN_DB) * HISTOGRAM_BIN_DB
            counts[low] = counts.get(low, 0) + 1
    bins = []
    if counts:
        for low in range(min(counts), max(counts) + HISTOGRAM_BIN_DB, HISTOGRAM_BIN_DB):
            bins.append({"from_db": low, "to_db": low + HISTOGRAM_BIN_DB, "weights": counts.get(low, 0)})
    return {"bin_db": HISTOGRAM_BIN_DB, "bins": bins, "exact": exact, "no_signal": no_signal}
