"""The decoders that qtool.native's fused CPU kernels run in place of torch, on the read side.

The executor asks here first, for CPU runs only; where the answer is None, the convention's
torch decoder does the job. What qualifies (each bit for bit the torch path): compressed-tensors'
pack-quantized int2/4/8 per channel or per group, symmetric or with zero points (no g_idx), and
GGUF blocks of the types qtool.native.gguf_types() lists. The write side's kernels are chosen by
each layout (`qtool.layouts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from qtool import native
from qtool.conventions import compressed_tensors
from qtool.dtypes import WEIGHT_FLOATS
from qtool.formats.checkpoint import Checkpoint
from qtool.weight import Weight

__all__ = ["decoder"]


def decoder(weight: Weight, out_dtype: str) -> Callable[[Checkpoint], memoryview] | None:
    """A function reading `weight` from a checkpoint and returning its values as `out_dtype`
    bytes, or None where torch must decode it."""
    if not native.available() or not weight.quantized or out_dtype not in WEIGHT_FLOATS:
        return None
    if weight.convention == compressed_tensors.NAME:
        return _int_decoder(weight, out_dtype)
    if weight.convention == "gguf":
        return _gguf_decoder(weight, out_dtype)
    return None


def _int_decoder(weight: Weight, out_dtype: str):
    scheme = weight.require_scheme()
    data, scale, zero_point = weight.data, weight.members.get("scale"), weight.members.get("zero_point")
    if set(weight.members) - {"data", "scale", "zero_point", "shape"} or scale is None or len(weight.shape) != 2:
        return None  # g_idx or a global scale: torch
    if scheme.qtype.kind != "int" or scheme.qtype.bits not in (2, 4, 8) or scheme.symmetric != (zero_point is None):
        return None
    if not data.name.endswith("weight_packed") or data.dtype.name != "I32" or scale.dtype.name not in WEIGHT_FLOATS:
        return None
    rows, cols = weight.shape
    bits = scheme.qtype.bits
    block_rows, group = scheme.block_for((rows, cols))
    if block_rows != 1 or cols % group or cols * bits % 32:
        return None
    groups = cols // group
    if data.nbytes != rows * cols * bits // 8 or scale.numel != rows * groups:
        return None  # torch's decoder names what is wrong
    if zero_point is not None and (
        zero_point.dtype.name != "I32" or tuple(zero_point.shape) != (-(-rows * bits // 32), groups)
    ):
        return None
    logical = weight.dtype if weight.dtype in WEIGHT_FLOATS else "BF16"

    def decode(checkpoint: Checkpoint) -> memoryview:
        packed, scales = checkpoint.read_bytes(data), checkpoint.read_bytes(scale)
        zero_points = checkpoint.read_bytes(zero_point) if zero_point is not None else None
        return native.decode_int(
            packed, scales, zero_points, scale.dtype.name, logical, out_dtype, rows, cols, group, bits
        )

    return decode


def _gguf_decoder(weight: Weight, out_dtype: str):
    from qtool.errors import UnknownNameError
    from qtool.ggml_types import ggml_type_named

    try:
        gtype = ggml_type_named(weight.data.encoding or "")
    except UnknownNameError:
        return None
    entry = gtype.native_decoder
    numel = math.prod(weight.shape)
    if (
        entry is None
        or entry not in native.gguf_types()
        or numel % gtype.block_size
        or weight.data.nbytes != gtype.nbytes(numel)
    ):
        return None
    blocks = numel // gtype.block_size

    def decode(checkpoint: Checkpoint) -> memoryview:
        return native.decode_gguf(entry, checkpoint.read_bytes(weight.data), blocks, gtype.block_size, out_dtype)

    return decode
