"""Value statistics of plain weights, streamed: `inspect --stats` reads data only here.

Each tensor is read with pread in chunks of at most `CHUNK` elements (`qtool.plain_values`, numpy, no
torch), so memory stays bounded by one chunk in float64 whatever the tensor's size, and a file
truncated meanwhile is an error naming it, not a SIGBUS. min/max/mean/std/absmax are over the
finite values; NaN and Inf are counted apart.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING
from collections.abc import Callable

from qtool.dtypes import DTYPES
from qtool.formats.checkpoint import Checkpoint
from qtool.plain_values import float64_reader, value_chunks
from qtool.weight import Weight

if TYPE_CHECKING:
    from qtool.inspection import Inspection

__all__ = ["CHUNK", "collect_stats", "weight_stats", "count_stored_non_finite"]

CHUNK = 1 << 22  # elements per chunk


def collect_stats(inspection: Inspection, on_bytes: Callable[[int], None] | None = None) -> Inspection:
    """A new Inspection with the stats of every plain weight it reports, streamed from the
    data (quantized weights get none); the checkpoint is closed afterwards. Needs numpy, not
    torch. `on_bytes` gets the bytes read, out of the plain weights' `nbytes`."""
    checkpoint = inspection.checkpoint
    try:
        stats = {w.name: weight_stats(checkpoint, w, on_bytes) for w in inspection.weights if not w.quantized}
    finally:
        checkpoint.close()
    return inspection.with_stats(stats)


def weight_stats(checkpoint: Checkpoint, weight: Weight, on_bytes: Callable[[int], None] | None = None):
    """Stats of a plain weight's values, or None where qtool has no reader for its dtype (F4, F6)."""
    import numpy as np

    tensor = weight.data
    if float64_reader(tensor.dtype) is None:
        return None
    finite = nan = inf = 0
    mean = m2 = 0.0  # running mean and sum of squared deviations, merged per chunk (Chan et al.)
    low, high = math.inf, -math.inf
    try:
        for values, nbytes in value_chunks(checkpoint, tensor, CHUNK):
            ok = np.isfinite(values)
            bad = values.size - int(np.count_nonzero(ok))
            if bad:
                n_nan = int(np.count_nonzero(np.isnan(values)))
                nan, inf = nan + n_nan, inf + bad - n_nan
                good = values[ok]
            else:
                good = values
            if good.size:
                n_chunk = good.size
                mean_chunk = float(good.mean())
                m2_chunk = float(np.square(good - mean_chunk).sum())
                delta = mean_chunk - mean
                merged = finite + n_chunk
                mean += delta * n_chunk / merged
                m2 += m2_chunk + delta * delta * finite * n_chunk / merged
                finite = merged
                low = min(low, float(good.min()))
                high = max(high, float(good.max()))
            if on_bytes:
                on_bytes(nbytes)
    finally:
        checkpoint.release(tensor)
    if not finite:
        return {"min": None, "max": None, "mean": None, "std": None, "absmax": None, "nan": nan, "inf": inf}
    variance = m2 / finite
    return {
        "min": low,
        "max": high,
        "mean": mean,
        "std": math.sqrt(variance),
        "absmax": max(abs(low), abs(high)),
        "nan": nan,
        "inf": inf,
    }


def count_stored_non_finite(checkpoint: Checkpoint, weight: Weight) -> tuple[int, int] | None:
    """(NaN count, Inf count) of a plain weight's stored values, streamed without torch; None
    where qtool has no reader for its dtype."""
    import numpy as np

    tensor = weight.data
    reader = float64_reader(tensor.dtype)
    if reader is None:
        return None
    if not (tensor.dtype.is_float or tensor.dtype.kind == "complex"):
        return 0, 0  # integers and bools hold no NaN; their bytes need no reading
    if tensor.dtype.kind == "complex":  # NaN and Inf counted per component, not per magnitude
        tensor = replace(tensor, dtype=DTYPES["F32"], shape=(tensor.nbytes // 4,))
    nan = inf = 0
    try:
        for values, _ in value_chunks(checkpoint, tensor, CHUNK):
            n_nan = int(np.count_nonzero(np.isnan(values)))
            nan += n_nan
            inf += int(np.count_nonzero(~np.isfinite(values))) - n_nan
    finally:
        checkpoint.release(tensor)
    return nan, inf
