"""A stored tensor's values as float64 numpy arrays, read chunk by chunk with pread: what
`inspect --stats` and `check --no-nan` need of a plain weight, without torch.

pread, not mmap: a page of a mapped file that another process truncated is SIGBUS, which kills
the process with no message (exit 135); a short pread is an ordinary CheckpointError naming the
file. 8-bit floats go through a 256-entry table built from each format's definition (E4M3FN has
no infinity, only NaN at 0x7F/0xFF; E5M2 has both; the FNUZ formats have one NaN, 0x80, and no
-0); tests check every table against torch. Sub-byte floats (F4, F6) have no reader here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from typing import TYPE_CHECKING

from qtool.dtypes import StorageDType
from qtool.formats.checkpoint import Checkpoint, StoredTensor

if TYPE_CHECKING:
    import numpy as np

__all__ = ["float64_reader", "float8_table", "value_chunks"]

# 8-bit float formats: (exponent bits, mantissa bits, bias, how the top codes read)
_FLOAT8 = {
    "F8_E4M3": (4, 3, 7, "fn"),  # all-ones exponent and mantissa is NaN; no inf
    "F8_E5M2": (5, 2, 15, "ieee"),  # all-ones exponent: inf (mantissa 0) or NaN
    "F8_E4M3FNUZ": (4, 3, 8, "fnuz"),  # 0x80 is the only NaN; no inf, no -0
    "F8_E5M2FNUZ": (5, 2, 16, "fnuz"),
}


@cache
def float8_table(name: str):  # -> np.ndarray of 256 float64
    """The value of every byte in the 8-bit float format `name` (F8_* or F8_E8M0)."""
    import numpy as np

    codes = np.arange(256)
    if name == "F8_E8M0":  # unsigned: 2^(code - 127), 0xFF is NaN
        table = np.ldexp(1.0, codes - 127)
        table[255] = np.nan
        return table
    exp_bits, man_bits, bias, kind = _FLOAT8[name]
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = (codes >> man_bits) & ((1 << exp_bits) - 1)
    mantissa = codes & ((1 << man_bits) - 1)
    normal = np.ldexp(1.0 + mantissa / (1 << man_bits), exponent - bias)
    subnormal = np.ldexp(mantissa / (1 << man_bits), 1 - bias)
    table = sign * np.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << exp_bits) - 1
    if kind == "fn":
        table[top & (mantissa == (1 << man_bits) - 1)] = np.nan
    elif kind == "ieee":
        table[top & (mantissa == 0)] = sign[top & (mantissa == 0)] * np.inf
        table[top & (mantissa != 0)] = np.nan
    else:
        table[0x80] = np.nan
    return table


def float64_reader(dtype: StorageDType) -> Callable[[bytes | bytearray | memoryview], np.ndarray] | None:
    """A function from raw bytes of `dtype` to their values as float64 (complex: magnitudes),
    or None where qtool has no reader (F4, F6)."""
    import numpy as np

    name = dtype.name
    if name in _FLOAT8 or name == "F8_E8M0":
        table = float8_table(name)
        return lambda raw: table[np.frombuffer(raw, dtype=np.uint8)]
    if name == "BF16":
        return lambda raw: (
            (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        )
    if name == "BOOL":
        return lambda raw: (np.frombuffer(raw, dtype=np.uint8) != 0).astype(np.float64)
    if name == "C64":
        return lambda raw: np.abs(np.frombuffer(raw, dtype=np.complex64)).astype(np.float64)
    numpy_name = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2",
                  "U32": "<u4", "I32": "<i4", "U64": "<u8", "I64": "<i8"}.get(name)  # fmt: skip
    if numpy_name is None:
        return None
    return lambda raw: np.frombuffer(raw, dtype=numpy_name).astype(np.float64)


def value_chunks(checkpoint: Checkpoint, tensor: StoredTensor, chunk: int) -> Iterator[tuple[np.ndarray, int]]:
    """(float64 values, bytes read) for each run of at most `chunk` elements of a plain stored
    tensor, in order. The caller checks `float64_reader(tensor.dtype)` first."""
    reader = float64_reader(tensor.dtype)
    if reader is None:
        raise ValueError(f"no float64 reader for {tensor.dtype.name}")
    import numpy as np

    itemsize = tensor.dtype.bits // 8
    step = max(1, chunk) * itemsize
    for start in range(0, tensor.nbytes, step):
        size = min(step, tensor.nbytes - start)
        raw = checkpoint.read_bytes(tensor, start, size)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN payloads widen with a warning
            values = reader(raw)
        yield values, size
