"""Small float formats and codebooks: fp8 casts, fp4 e2m1 / fp6 e2m3 codes, e8m0 exponents,
and the bitsandbytes 4-bit codebooks. Torch only, elementwise, the same on CPU and CUDA.

Codes are what sits in a nibble (or six bits) before packing:

    fp4 e2m1   sign<<3 | index into FP4_E2M1_MAGNITUDES      (compressed-tensors, OCP MX)
    fp6 e2m3   sign<<5 | index into FP6_E2M3_MAGNITUDES      (compressed-tensors mxfp6)
    nf4, fp4   index into the 16-entry codebook              (bitsandbytes)
    e8m0       biased exponent u, value 2^(u - 127)          (MX block scales)

Rounding, named per format:
    fp8        round-half-to-even (torch's saturating-free cast, after an explicit clamp)
    fp4 e2m1   round-half-to-even on the e2m1 grid, saturating at +-6 -- compressed-tensors'
               `cast_to_fp4` thresholds (<=0.25 -> 0, >=0.75 -> 1, <=1.25 -> 1, >=1.75 -> 2,
               <=2.5 -> 2, >=3.5 -> 4, <=5 -> 4); a negative value that rounds to zero keeps
               its sign (code 0x8), -0.0 itself does not, as compressed-tensors packs it
    codebooks  nearest entry, a tie goes to the lower entry: bitsandbytes' CPU `quantize_4bit`
               (bucketize over midpoints). Its CUDA kernel compares against decimal constants
               and may differ at an exact midpoint.
    e8m0       compressed-tensors' `generate_mx_scales`: the block max is rounded to a power
               of two upward when its significand is >= 1.75 (`round_to_power_2`), then
               offset by floor(log2(element max)); not OCP's plain floor(log2(amax)).
"""

from __future__ import annotations

import math
from functools import cache

import torch

from qtool.errors import KernelError
from qtool.qtypes import FP4_BNB_CODEBOOK, NF4_CODEBOOK, QType
from qtool.qtypes import qtype as lookup_qtype

__all__ = [
    "FP4_E2M1_MAGNITUDES",
    "FP6_E2M3_MAGNITUDES",
    "NF4_CODEBOOK",
    "FP4_BNB_CODEBOOK",
    "float8_dtype",
    "to_float8",
    "fp4_e2m1_encode",
    "fp4_e2m1_decode",
    "fp6_e2m3_decode",
    "round_to_power_2",
    "mx_scale_exponent",
    "e8m0_decode",
    "codebook",
    "codebook_encode",
    "codebook_decode",
]

FP4_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# compressed-tensors' kE2M3ToFloat: 8 subnormals m/8, then (1 + m/8) * 2^e for e in 0..2
FP6_E2M3_MAGNITUDES = tuple([m / 8 for m in range(8)] + [(1 + m / 8) * 2**e for e in range(3) for m in range(8)])

# bitsandbytes `get_4bit_type` (CONVENTIONS §4); the tables are divided by their absmax in
# float32 there, so they are here: FP4's /12 must round exactly as bitsandbytes' does.
_FLOAT8 = {
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp8_e4m3fnuz": "float8_e4m3fnuz",
    "fp8_e5m2fnuz": "float8_e5m2fnuz",
}
_CODEBOOKS = {"nf4": NF4_CODEBOOK, "fp4_bnb": FP4_BNB_CODEBOOK}


def _qt(qtype: QType | str) -> QType:
    return lookup_qtype(qtype) if isinstance(qtype, str) else qtype


# -- fp8 ----------------------------------------------------------------------------------------


def float8_dtype(qtype: QType | str) -> torch.dtype:
    """The torch dtype that stores an fp8 value type."""
    qt = _qt(qtype)
    name = _FLOAT8.get(qt.name)
    if name is None:
        raise KernelError(f"{qt.name} is not an fp8 type (fp8 types: {' '.join(_FLOAT8)})")
    return getattr(torch, name)


def to_float8(x: torch.Tensor, qtype: QType | str) -> torch.Tensor:
    """Saturating cast: clamp to +-max, then torch's round-half-to-even cast."""
    qt = _qt(qtype)
    return torch.clamp(x, qt.qmin, qt.qmax).to(float8_dtype(qt))


# -- fp4 e2m1 and fp6 e2m3 -------------------------------------------------------------------


def fp4_e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes sign<<3 | index, same shape as `x`. Saturates at +-6."""
    magnitude = x.abs()
    index = (magnitude > 0.25).to(torch.uint8)
    for threshold, ties_up in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        index += (magnitude >= threshold) if ties_up else (magnitude > threshold)
    return index | ((x < 0).to(torch.uint8) << 3)


@cache
def _signed_table(magnitudes: tuple[float, ...], device: torch.device) -> torch.Tensor:
    values = torch.tensor(magnitudes, dtype=torch.float32)
    return torch.cat([values, -values]).to(device)


def fp4_e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of fp4 codes; code 0x8 is -0.0."""
    table = _signed_table(FP4_E2M1_MAGNITUDES, codes.device)
    return table[(codes & 0xF).long()].to(dtype)


def fp6_e2m3_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of fp6 e2m3 codes (sign in bit 5)."""
    table = _signed_table(FP6_E2M3_MAGNITUDES, codes.device)
    return table[(codes & 0x3F).long()].to(dtype)


# -- e8m0 (MX block scales) ----------------------------------------------------------------


def round_to_power_2(x: torch.Tensor, elem_mantissa: int = 1) -> torch.Tensor:
    """compressed-tensors' `round_to_power_2`, bit for bit in x's own dtype: add half of the
    element format's last mantissa step to the bit pattern, then drop the mantissa. With
    `elem_mantissa=1` a significand >= 1.75 carries into the next power of two."""
    layouts = {
        torch.bfloat16: (torch.uint16, 7, 8),
        torch.float16: (torch.uint16, 10, 5),
        torch.float32: (torch.uint32, 23, 8),
        torch.float64: (torch.uint64, 52, 11),
    }
    if x.dtype not in layouts:
        raise KernelError(f"round_to_power_2 needs a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    int_dtype, mantissa, exponent = layouts[x.dtype]
    bits = x.view(int_dtype).to(torch.int64 if int_dtype is torch.uint64 else torch.int32)
    carry = 1 << (mantissa - elem_mantissa - 1)
    sign_exponent_mask = ((1 << (exponent + 1)) - 1) << mantissa
    rounded = torch.bitwise_and(bits + carry, sign_exponent_mask)
    if int_dtype is torch.uint16:
        return rounded.to(torch.uint16).view(x.dtype)
    return rounded.view(x.dtype)  # int32 / int64 hold the same bits as float32 / float64


def mx_scale_exponent(amax: torch.Tensor, elem_qtype: QType | str) -> torch.Tensor:
    """uint8 biased E8M0 exponents for blocks whose absolute max is `amax` (compressed-tensors'
    `generate_mx_scales`, then its uint8 rounding): 127 + floor(log2(round_to_power_2(amax)))
    - floor(log2(element max)), clamped to [0, 255]. An all-zero block gets 0 (2^-127)."""
    qt = _qt(elem_qtype)
    if qt.qmax is None or qt.kind != "float":
        raise KernelError(f"MX scales need a float element type, got {qt.name}")
    offset = int(math.floor(math.log2(qt.qmax)))
    elem_mantissa = 3 if qt.name == "fp6_e2m3" else 1  # compressed-tensors uses fp4's for fp8 too
    if amax.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        amax = amax.float()
    power = round_to_power_2(amax, elem_mantissa)
    exponent = 127 + torch.floor(torch.log2(power)) - offset
    return torch.round(torch.clamp(exponent, 0, 255)).to(torch.uint8)


def e8m0_decode(exponent: torch.Tensor) -> torch.Tensor:
    """float32 2^(u - 127), built from the bit pattern so it is exact: u=0 is the subnormal
    2^-127, u=255 comes out inf (OCP calls it NaN; compressed-tensors computes inf)."""
    if exponent.dtype == getattr(torch, "float8_e8m0fnu", None):
        exponent = exponent.view(torch.uint8)
    biased = exponent.to(torch.int32)
    bits = torch.where(biased == 0, torch.full_like(biased, 1 << 22), biased << 23)
    return bits.view(torch.float32)


# -- codebooks ----------------------------------------------------------------------------------


@cache
def _codebook(name: str, device: torch.device) -> torch.Tensor:
    values = torch.tensor(_CODEBOOKS[name], dtype=torch.float32)
    return (values / values.abs().max()).to(device)


def codebook(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16] table of a 4-bit codebook ("nf4" or "fp4_bnb"), in bitsandbytes' order."""
    if name not in _CODEBOOKS:
        raise KernelError(f"unknown codebook {name!r} (known: {' '.join(_CODEBOOKS)})")
    return _codebook(name, torch.device(device))


@cache
def _bounds(name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    table = _codebook(name, device)
    order = torch.argsort(table)
    return (table[order[:-1]] + table[order[1:]]) / 2, order


def codebook_encode(normalized: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 indices of the nearest codebook entry for values already divided by their absmax."""
    codebook(name)  # validates the name
    midpoints, order = _bounds(name, normalized.device)
    index = torch.bucketize(normalized.float(), midpoints, out_int32=True)
    return order[index].to(torch.uint8)


@cache
def _decode_table(name: str, device: torch.device) -> torch.Tensor:
    table = _codebook(name, device).clone()
    if name == "fp4_bnb":
        table[8] = -0.0  # bitsandbytes' CPU and CUDA kernels decode the sign bit of code 8
    return table


def codebook_decode(indices: torch.Tensor, name: str) -> torch.Tensor:
    """float32 codebook values of uint8 indices. fp4_bnb's code 8 decodes to -0.0, as
    bitsandbytes' native CPU and CUDA kernels do (its torch fallback, used for an odd last
    dim, returns +0.0 from the stored table: equal values, another sign bit)."""
    codebook(name)  # validates the name
    return _decode_table(name, indices.device)[(indices & 0xF).long()]
