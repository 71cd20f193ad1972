"""Float conversions of raw bytes in numpy, bit for bit what torch's do, so that copying a
weight through a cast (`--dtype`, GGUF's F32 norms) does not import torch.

bf16 is the top half of an f32: widening is a shift; narrowing rounds to nearest even, as
c10's `round_to_nearest_even` does. f16 conversions are numpy's, also round to nearest even.
Inf and NaN payloads are where implementations differ, so `cast` reports it cannot promise
torch's bytes for them (None) and the caller uses torch.
"""

from __future__ import annotations

__all__ = ["NUMPY_FLOATS", "to_float32", "cast"]

NUMPY_FLOATS = ("F32", "F16", "BF16")


def to_float32(raw, dtype: str):  # -> numpy.ndarray of float32
    """The values of `raw` (`dtype` bytes, one of NUMPY_FLOATS) as a float32 array, exactly."""
    import numpy as np

    if dtype == "F32":
        return np.frombuffer(raw, dtype=np.float32)
    if dtype == "F16":
        return np.frombuffer(raw, dtype=np.float16).astype(np.float32)
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"to_float32 takes F32, F16 or BF16 bytes, not {dtype}")


def cast(raw, source: str, target: str) -> memoryview | None:
    """`raw` (`source` bytes) as `target` bytes, both in NUMPY_FLOATS; None when the values
    hold inf or NaN (torch must cast those, for its exact bytes)."""
    import numpy as np

    values = to_float32(raw, source)
    if not np.isfinite(values).all():
        return None
    if target == "F32":
        out = values
    elif target == "F16":
        with np.errstate(over="ignore"):  # finite values past f16's range become inf, as in torch
            out = values.astype(np.float16)
    elif target == "BF16":
        bits = values.view(np.uint32)
        out = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    else:
        raise ValueError(f"cast writes F32, F16 or BF16, not {target}")
    return memoryview(np.ascontiguousarray(out)).cast("B")
