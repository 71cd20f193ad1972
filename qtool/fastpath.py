"""The jobs that qtool.native's fused CPU kernels run in place of torch.

The pipeline asks here first, for CPU runs only; where the answer is None, torch does the job.
What qualifies (each bit for bit the torch path, tests/test_fastpath.py):

    quantize    a float16/bfloat16/float32 2-D weight to compressed-tensors' pack-quantized
                int2/4/8, per channel or per group, symmetric or with zero points, scales in
                its own dtype (W8A16, W4A16, W4A16_ASYM, int8, int4:gN[:asym], int2:gN)
    dequantize  those layouts back (no g_idx), and GGUF blocks of the types
                qtool.native.gguf_types() lists
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from qtool import native
from qtool.conventions import compressed_tensors, compressed_tensors_encode
from qtool.dtypes import WEIGHT_FLOATS
from qtool.formats.checkpoint import Checkpoint
from qtool.metrics import ErrorStats
from qtool.scheme import QScheme
from qtool.weight import Weight

__all__ = ["IntEncoder", "int_encoder", "decoder"]

@dataclass(frozen=True)
class IntEncoder:
    """Pack-quantized int codes for one weight, symmetric or with zero points."""

    dtype: str
    cols: int
    group: int
    bits: int
    packed: str  # output tensor names, in encoded_layout's order
    scale: str
    zero_point: str | None  # None: symmetric
    shape: str

    def encode(self, src, rows: int) -> tuple[dict[str, memoryview], ErrorStats | None]:
        """The stored tensors of `rows` rows in `src`, and their error; None for the error when
        the rows hold inf or NaN (then torch must encode this weight)."""
        encoded = native.encode_int(src, self.dtype, rows, self.cols, self.group, self.bits, symmetric=self.zero_point is None)
        tensors = {self.packed: encoded.packed, self.scale: encoded.scale}
        if self.zero_point is not None and encoded.zero_point is not None:
            tensors[self.zero_point] = encoded.zero_point
        return tensors, encoded.errors

    def shape_bytes(self, rows: int) -> bytes:
        """compressed-tensors' `weight_shape`: int64 [rows, cols], little-endian."""
        return rows.to_bytes(8, "little", signed=True) + self.cols.to_bytes(8, "little", signed=True)


def int_encoder(weight: Weight, scheme: QScheme, output_names: list[str]) -> IntEncoder | None:
    if not native.available() or weight.quantized or scheme.convention != compressed_tensors.NAME:
        return None
    if weight.data.dtype.name != weight.dtype or tuple(weight.data.shape) != tuple(weight.shape):
        return None
    layout = compressed_tensors_encode.row_group_int_layout(scheme, tuple(weight.shape), weight.dtype)
    if layout is None:
        return None
    bits, group, symmetric = layout
    cols = weight.shape[1]
    if bits not in (2, 4, 8) or cols * bits % 32 or len(output_names) != (3 if symmetric else 4):
        return None
    packed, scale, *zero_point, shape = output_names
    return IntEncoder(weight.dtype, cols, group, bits, packed, scale, zero_point[0] if zero_point else None, shape)


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
    if zero_point is not None and (zero_point.dtype.name != "I32" or tuple(zero_point.shape) != (-(-rows * bits // 32), groups)):
        return None
    logical = weight.dtype if weight.dtype in WEIGHT_FLOATS else "BF16"

    def decode(checkpoint: Checkpoint) -> memoryview:
        packed, scales = checkpoint.read_bytes(data), checkpoint.read_bytes(scale)
        zero_points = checkpoint.read_bytes(zero_point) if zero_point is not None else None
        return native.decode_int(packed, scales, zero_points, scale.dtype.name, logical, out_dtype, rows, cols, group, bits)

    return decode


def _gguf_decoder(weight: Weight, out_dtype: str):
    from qtool.formats.gguf import ggml_type_named

    encoding = weight.data.encoding or ""
    if encoding not in native.gguf_types():
        return None
    gtype = ggml_type_named(encoding)
    numel = math.prod(weight.shape)
    if gtype is None or numel % gtype.block_size or weight.data.nbytes != gtype.nbytes(numel):
        return None
    blocks = numel // gtype.block_size

    def decode(checkpoint: Checkpoint) -> memoryview:
        return native.decode_gguf(encoding, checkpoint.read_bytes(weight.data), blocks, gtype.block_size, out_dtype)

    return decode
