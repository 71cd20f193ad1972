"""Value statistics of plain weights, streamed: `inspect --stats` reads data only here.

Each tensor is read through mmap in chunks of at most `CHUNK` elements, so memory stays
bounded by one chunk in float64 whatever the tensor's size, and its pages are released after.
min/max/mean/std/absmax are over the finite values; NaN and Inf are counted apart.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from qtool.formats.checkpoint import Checkpoint
from qtool.weight import Weight

if TYPE_CHECKING:
    from qtool.inspection import Inspection

__all__ = ["CHUNK", "collect_stats", "weight_stats"]

CHUNK = 1 << 22  # elements per chunk


def collect_stats(inspection: Inspection, on_bytes: Callable[[int], None] | None = None) -> Inspection:
    """A new Inspection with the stats of every plain weight it reports, streamed from the
    data (quantized weights get none); the checkpoint is closed afterwards. Imports torch.
    `on_bytes` gets the bytes read, out of the plain weights' `nbytes`."""
    checkpoint = inspection.checkpoint
    try:
        stats = {w.name: weight_stats(checkpoint, w, on_bytes) for w in inspection.weights if not w.quantized}
    finally:
        checkpoint.close()
    return inspection.with_stats(stats)


def weight_stats(checkpoint: Checkpoint, weight: Weight, on_bytes: Callable[[int], None] | None = None):
    """Stats of a plain weight's values, or None where torch can't read its dtype (F4, F6)."""
    import torch

    tensor = weight.data
    if tensor.dtype.torch_name is None or not hasattr(torch, tensor.dtype.torch_name):
        return None
    values = checkpoint.load(tensor).reshape(-1)
    finite = nan = inf = 0
    mean = m2 = 0.0  # running mean and sum of squared deviations, merged per chunk (Chan et al.)
    low, high = math.inf, -math.inf
    try:
        for start in range(0, values.numel(), CHUNK):
            chunk = values[start : start + CHUNK]
            chunk = chunk.to(torch.float64) if not chunk.is_complex() else chunk.abs().to(torch.float64)
            ok = torch.isfinite(chunk)
            nan += int(torch.isnan(chunk).sum())
            inf += int(torch.isinf(chunk).sum())
            good = chunk[ok]
            if good.numel():
                n_chunk = good.numel()
                mean_chunk = float(good.mean())
                m2_chunk = float(((good - mean_chunk) ** 2).sum())
                delta = mean_chunk - mean
                merged = finite + n_chunk
                mean += delta * n_chunk / merged
                m2 += m2_chunk + delta * delta * finite * n_chunk / merged
                finite = merged
                low = min(low, float(good.min()))
                high = max(high, float(good.max()))
            if on_bytes:
                on_bytes(chunk.numel() * tensor.dtype.bits // 8)
    finally:
        del values
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
