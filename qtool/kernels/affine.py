"""The one quantization primitive, for every granularity: a block shape.

    granularity    block for [E, O, I]       scale (block grid) shape
    per-tensor     (E, O, I)  or (None,)*3   (1, 1, 1)
    per-channel    (1, 1, I)  or (1, 1, None) (E, O, 1)
    per-group g    (1, 1, g)                 (E, O, ceil(I/g))
    2-D block      (1, bh, bw)               (E, ceil(O/bh), ceil(I/bw))
    flat blocks    (g,) on x.reshape(-1)     (ceil(numel/g),)   bitsandbytes

A block shorter than the tensor aligns to the trailing dims; `None` means the whole dim.
Dims that the block does not divide end in a partial block: the tensor is padded with zeros
to whole blocks and cut back afterwards (compressed-tensors' block strategy does exactly
this). Zeros never change a scale, because every range here includes 0. Which *layouts*
accept partial blocks is the codecs' business: compressed-tensors pads 2-D blocks but
refuses groups that do not divide in_features; bitsandbytes runs its blocks over the
flattened weight.

Value types and what `quantize` returns (unpacked):
    int / uint b    int8 / uint8 values in [qmin, qmax]
    fp8             float8 tensor
    fp4 e2m1        uint8 codes sign<<3 | index           (see floats.py)
    nf4, fp4_bnb    uint8 codebook indices

Scales come back in their storage form: float16/bfloat16/float32, float8_e4m3fn (NVFP4 block
scales, under an optional float32 global scale), or uint8 E8M0 exponents (MX).

Arithmetic follows compressed-tensors 0.20.1 op for op (`calculate_qparams`, `_quantize`,
`generate_gparam`), so that encoding its layouts is bit-identical: qparams are computed in
the scale's dtype (NVFP4: in x's dtype, then times the float32 global scale), and `x / scale`
runs in the promoted dtype of x and scale -- bfloat16 for a bfloat16 weight with bfloat16
scales, as there. Pass float32 tensors for single-rounding math. Integer rounding is
round-half-to-even (`torch.round`); float rounding is described in floats.py. Dequantizing
computes in float32 and casts once to `dtype`, which equals compressed-tensors' and
bitsandbytes' results (the products are exact in float32 before that cast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from qtool.dtypes import WEIGHT_FLOATS, decoded_dtype, weight_float_of
from qtool.errors import KernelError
from qtool.kernels import floats
from qtool.qtypes import QType
from qtool.qtypes import qtype as lookup_qtype

__all__ = [
    "resolve_block",
    "grid_shape",
    "choose_qparams",
    "choose_global_scale",
    "quantize",
    "dequantize",
    "scale_to_float",
]

BlockLike = Sequence["int | None"]
_E4M3_SCALES = ("E4M3", "F8_E4M3", "UE4M3")
_E8M0_SCALES = ("E8M0", "F8_E8M0", "U8")


def _qtype(qtype: QType | str) -> QType:
    return lookup_qtype(qtype) if isinstance(qtype, str) else qtype


# -- blocks -------------------------------------------------------------------------------------


def resolve_block(shape: Sequence[int], block: BlockLike) -> tuple[int, ...]:
    """The concrete block for a tensor of `shape`: trailing-aligned, `None` = the whole dim,
    and never larger than the dim (a 128-row block on 64 rows is one 64-row block)."""
    shape, block = tuple(shape), tuple(block)
    if len(block) > len(shape):
        extra, block = block[: len(block) - len(shape)], block[len(block) - len(shape) :]
        if any(b not in (None, 1) for b in extra):
            raise KernelError(f"block {list(extra + block)} has more dims than the tensor's shape {list(shape)}")
    block = (1,) * (len(shape) - len(block)) + block
    resolved = []
    for dim, size in zip(shape, block):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise KernelError(f"block sizes must be positive ints or None, got {list(block)}")
        resolved.append(max(1, dim if size is None else min(size, dim)))
    return tuple(resolved)


def grid_shape(shape: Sequence[int], block: BlockLike) -> tuple[int, ...]:
    """The scale's shape: ceil(dim / block) per dim."""
    return tuple(math.ceil(dim / size) for dim, size in zip(shape, resolve_block(shape, block)))


def _to_blocks(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """[d0, d1, ...] -> [g0, b0, g1, b1, ...], zero padded to whole blocks."""
    pad = [(-dim) % size for dim, size in zip(x.shape, block)]
    if any(pad):
        x = F.pad(x, [p for amount in reversed(pad) for p in (0, amount)])
    interleaved = [n for dim, size in zip(x.shape, block) for n in (dim // size, size)]
    return x.reshape(interleaved)


def _from_blocks(blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    padded = tuple(blocks.shape[i] * blocks.shape[i + 1] for i in range(0, blocks.dim(), 2))
    out = blocks.reshape(padded)
    if padded != tuple(shape):
        out = out[tuple(slice(0, dim) for dim in shape)].contiguous()
    return out


def _grid_view(t: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    """A per-block tensor (any shape with the grid's numel) as [g0, 1, g1, 1, ...]."""
    if t.numel() != math.prod(grid):
        raise KernelError(f"scale has {t.numel()} values, the block grid {list(grid)} needs {math.prod(grid)}")
    return t.reshape([n for g in grid for n in (g, 1)])


def _block_dims(ndim: int) -> tuple[int, ...]:
    return tuple(range(1, 2 * ndim, 2))


# -- scales -------------------------------------------------------------------------------------


def _scale_kind(scale_dtype: str | torch.dtype, x: torch.Tensor) -> tuple[str, torch.dtype | None]:
    """("float", dtype) | ("e4m3", None) | ("e8m0", None). "auto" = x's dtype, as compressed-tensors."""
    if isinstance(scale_dtype, torch.dtype):
        scale_dtype = weight_float_of(scale_dtype) or str(scale_dtype)
    name = str(scale_dtype).upper()
    if name == "AUTO":
        return "float", x.dtype if weight_float_of(x.dtype) else torch.float16
    if name in WEIGHT_FLOATS:
        return "float", decoded_dtype(name)
    if name in _E4M3_SCALES:
        return "e4m3", None
    if name in _E8M0_SCALES:
        return "e8m0", None
    known = " ".join([*WEIGHT_FLOATS, "E4M3", "E8M0", "auto"])
    raise KernelError(f"unknown scale dtype {scale_dtype!r} (known: {known})")


def scale_to_float(scale: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The scale that values are multiplied by, from its storage form: float scales as they
    are, float8 as float32, uint8/e8m0 as 2^(u - 127); divided by the global scale if any."""
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        effective = floats.e8m0_decode(scale)
    elif scale.dtype.is_floating_point and scale.dtype.itemsize == 1:
        effective = scale.to(torch.float32)
    elif scale.dtype.is_floating_point:
        effective = scale
    else:
        raise KernelError(f"a scale must be a float or uint8 (E8M0) tensor, got {scale.dtype}")
    if global_scale is not None:
        effective = effective / global_scale.to(effective.device)
    return effective


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor on like's device: compressed-tensors divides by these, never by Python
    numbers (CUDA turns division by a host scalar into multiplication by its reciprocal)."""
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _range(qt: QType, like: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' bit_range: q_max - q_min in float32, cast to the math dtype."""
    return torch.tensor(float(qt.qmax) - float(qt.qmin), device=like.device).to(like.dtype)


def _replace_zero(scale: torch.Tensor, eps: float) -> torch.Tensor:
    """compressed-tensors replaces a zero scale (an all-zero block) by the scale dtype's eps."""
    return torch.where(scale == 0, _const(eps, scale), scale)


def choose_global_scale(
    x: torch.Tensor, qtype: QType | str = "fp4_e2m1", scale_qtype: QType | str = "ue4m3"
) -> torch.Tensor:
    """float32 [1]: the NVFP4 second-level scale, scale_max * elem_max / amax(x)
    (compressed-tensors' `generate_gparam`, in x's dtype; NaN or inf -> 1)."""
    qt, st = _qtype(qtype), _qtype(scale_qtype)
    if not x.dtype.is_floating_point:
        raise KernelError(f"choose_global_scale needs a float tensor, got {x.dtype}")
    amax = torch.max(torch.abs(torch.clamp(x.amin(), max=0)), torch.abs(torch.clamp(x.amax(), min=0)))
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    # `float / tensor` in compressed-tensors is torch's __rtruediv__: reciprocal, then multiply
    global_scale = amax.reciprocal() * (float(st.qmax) * float(qt.qmax))
    global_scale = torch.nan_to_num(global_scale, nan=1.0, posinf=1.0, neginf=1.0)
    return global_scale.to(torch.float32).reshape(1)


def choose_qparams(
    x: torch.Tensor,
    block: BlockLike,
    qtype: QType | str,
    symmetric: bool = True,
    scale_dtype: str | torch.dtype = "F32",
    *,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero_point or None), both of the block-grid shape.

    int, symmetric     scale = amax / ((qmax - qmin) / 2)
    int, asymmetric    scale = (max - min) / (qmax - qmin), zero_point = round(qmin - min / scale)
    float              scale = amax / qmax; E4M3 scales: global_scale * amax / qmax rounded to
                       float8_e4m3fn; E8M0 scales: see floats.mx_scale_exponent
    codebook           scale = float32 absmax (bitsandbytes)
    min and max are taken with 0 included; a zero scale becomes the scale dtype's eps.
    """
    qt = _qtype(qtype)
    if not x.dtype.is_floating_point:
        raise KernelError(f"choose_qparams needs a float tensor, got {x.dtype}")
    resolved = resolve_block(x.shape, block)
    blocks = _to_blocks(x, resolved)
    dims = _block_dims(x.dim())
    kind, float_dtype = _scale_kind(scale_dtype, x)

    if qt.kind == "codebook":
        if str(scale_dtype).upper() not in ("F32", "AUTO", "TORCH.FLOAT32"):
            raise KernelError(f"{qt.name} stores float32 absmax scales, not {scale_dtype}")
        return blocks.float().abs().amax(dim=dims), None
    if qt.kind not in ("int", "float") or qt.qmin is None or qt.qmax is None:
        raise KernelError(f"qtool cannot quantize to {qt.name}")
    if not symmetric and qt.kind != "int":
        raise KernelError(f"{qt.name} is symmetric only: asymmetric (zero point) quantization needs an int type")
    if symmetric and not qt.signed:
        raise KernelError(f"{qt.name} is unsigned: symmetric quantization needs a signed type such as int{qt.bits}")

    # amin and amax, not aminmax: on CPU aminmax over a dim is ~5x slower than both together
    minimum = torch.minimum(blocks.amin(dim=dims), torch.zeros((), dtype=x.dtype, device=x.device))
    maximum = torch.maximum(blocks.amax(dim=dims), torch.zeros((), dtype=x.dtype, device=x.device))

    if kind == "e8m0":
        if qt.kind != "float":
            raise KernelError(f"E8M0 (MX) scales go with float elements (fp4_e2m1, fp8_e4m3), not {qt.name}")
        return floats.mx_scale_exponent(torch.max(torch.abs(minimum), torch.abs(maximum)), qt), None

    if kind == "e4m3":
        # the local scale in x's dtype, then times the float32 global scale, then fp8
        amax = torch.max(torch.abs(minimum), torch.abs(maximum))
        local = amax / (_range(qt, amax) / 2)
        if global_scale is not None:
            local = global_scale.to(local.device) * local
        scale = floats.to_float8(local, "fp8_e4m3")
        return _replace_zero(scale.float(), 0.125).to(torch.float8_e4m3fn), None

    minimum, maximum = minimum.to(float_dtype), maximum.to(float_dtype)
    eps = torch.finfo(float_dtype).eps
    if symmetric:
        amax = torch.max(torch.abs(minimum), torch.abs(maximum))
        scale = amax / (_range(qt, amax) / 2)
        if global_scale is not None:
            scale = (global_scale.to(scale.device) * scale).to(float_dtype)
        return _replace_zero(scale, eps), None

    scale = (maximum - minimum) / _range(qt, maximum)
    zero_point = torch.tensor(float(qt.qmin), device=x.device) - (minimum / scale)
    zero_point = torch.clamp(zero_point, qt.qmin, qt.qmax)
    # 0/0 in an all-zero block: compressed-tensors' NaN casts to 0 on CPU; say so explicitly
    zero_point = torch.nan_to_num(zero_point, nan=0.0)
    value_dtype = _int_dtype(qt)
    info = torch.iinfo(value_dtype)
    zero_point = torch.round(torch.clamp(zero_point, info.min, info.max)).to(value_dtype)
    return _replace_zero(scale, eps), zero_point


def _int_dtype(qt: QType) -> torch.dtype:
    if qt.bits > 8:
        raise KernelError(f"qtool stores int values of at most 8 bits, got {qt.name}")
    return torch.int8 if qt.signed else torch.uint8


# -- quantize / dequantize ----------------------------------------------------------------------


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    block: BlockLike,
    qtype: QType | str,
    *,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpacked quantized values of x's shape (see the module docstring for their dtype)."""
    qt = _qtype(qtype)
    if zero_point is not None and qt.kind != "int":
        raise KernelError(f"{qt.name} takes no zero point")
    resolved = resolve_block(x.shape, block)
    grid = tuple(math.ceil(d / b) for d, b in zip(x.shape, resolved))
    blocks = _to_blocks(x, resolved)

    if qt.kind == "codebook":
        if qt.name not in ("nf4", "fp4_bnb"):
            raise KernelError(f"unknown codebook type {qt.name}")
        inverse = _grid_view(scale.float(), grid).clamp(min=1e-38).reciprocal()
        normalized = torch.clamp(blocks.float() * inverse, -1, 1)
        return _from_blocks(floats.codebook_encode(normalized, qt.name), tuple(x.shape))

    effective = _grid_view(scale_to_float(scale, global_scale), grid)
    scaled = blocks / effective
    if qt.kind == "int":
        if zero_point is not None:
            scaled = scaled + _grid_view(zero_point, grid).to(x.dtype)
        # `scaled` is a fresh tensor: clamp and round in place, in the package's order
        values = scaled.clamp_(qt.qmin, qt.qmax).round_().to(_int_dtype(qt))
    elif qt.kind == "float" and qt.bits == 8:
        values = floats.to_float8(scaled, qt)
    elif qt.name == "fp4_e2m1":
        values = floats.fp4_e2m1_encode(torch.clamp(scaled, qt.qmin, qt.qmax))
    else:
        raise KernelError(f"qtool cannot quantize to {qt.name} (it decodes it only)")
    return _from_blocks(values, tuple(x.shape))


def _values(q: torch.Tensor, qt: QType | None) -> torch.Tensor:
    """float32 values of unpacked quantized data."""
    if qt is None:
        if q.dtype == torch.uint8:
            raise KernelError("uint8 data is ambiguous (uint8 ints, fp4 codes or codebook indices): pass qtype=")
        return q.to(torch.float32)
    if qt.kind == "codebook":
        return floats.codebook_decode(q, qt.name)
    if qt.name == "fp4_e2m1":
        return floats.fp4_e2m1_decode(q)
    if qt.name == "fp6_e2m3":
        return floats.fp6_e2m3_decode(q)
    if qt.kind in ("int", "float"):
        return q.to(torch.float32)
    raise KernelError(f"qtool cannot dequantize {qt.name}")


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    block: BlockLike,
    dtype: torch.dtype | str = torch.float32,
    *,
    qtype: QType | str | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """(q - zero_point) * scale per block, in float32, cast once to `dtype`. `qtype` is needed
    for uint8 codes (fp4, fp6, codebooks); int and float8 data speak for themselves."""
    if isinstance(dtype, str):
        if dtype.upper() not in WEIGHT_FLOATS:
            raise KernelError(f"dequantize to F32, F16 or BF16, not {dtype!r}")
        dtype = decoded_dtype(dtype.upper())
    qt = _qtype(qtype) if qtype is not None else None
    values = _values(q, qt)
    resolved = resolve_block(values.shape, block)
    grid = tuple(math.ceil(d / b) for d, b in zip(values.shape, resolved))
    blocks = _to_blocks(values, resolved)
    if zero_point is not None:
        blocks = blocks - _grid_view(zero_point, grid).to(torch.float32)
    effective = scale_to_float(scale.to(values.device), global_scale).to(torch.float32)
    out = blocks * _grid_view(effective, grid)
    return _from_blocks(out, tuple(values.shape)).to(dtype)
