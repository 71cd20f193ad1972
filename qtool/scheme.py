"""Quantization schemes: the math of how one weight is quantized, and nothing else.

A `QScheme` holds the value type (`qtool.qtypes`), the block shape, symmetry, the scale and
zero-point types, a global scale, the observer (how scales are chosen), and, for a toolchain
whose own algorithm defines the codes (llama.cpp's Q4_0 ... Q6_K, IQ4_NL), that algorithm's
name as its `rule`. Where a weight was read from (which toolchain, how its codes are packed) is
not the scheme's: that is `Weight.provenance`. How a layout stores a scheme is the layout's. The
strings users type (`W4A16`, `int4:g64:asym`, `q4_k`) are `qtool.scheme_strings`.

Granularity is a block shape (see DESIGN "Granularity is a block shape"). A block entry of
`None` means "the whole dimension", so a scheme stays independent of any one weight's shape
and resolves against it with `QScheme.block_for(shape)`. Blocks align to the trailing
dimensions; leading dimensions (MoE experts, say) get 1.

    granularity   block for [out, in]   resolved for [4096, 11008]
    tensor        (None, None)          (4096, 11008)
    channel       (1, None)             (1, 11008)
    channel axis1 (None, 1)             (4096, 1)      a scale per column, "channel(axis=1)"
    group g128    (1, 128)              (1, 128)
    block         (128, 128)            (128, 128)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from qtool.dtypes import DTYPES
from qtool.errors import SchemeError
from qtool.qtypes import QTYPES, QType

__all__ = [
    "QScheme",
    "Block",
    "Granularity",
    "TENSOR",
    "CHANNEL",
    "group",
    "AUTO",
    "OBSERVERS",
    "SCALE_SPELLINGS",
    "scale_kind",
    "nominal_bits_per_weight",
]

Granularity = Literal["tensor", "channel", "group", "block"]

AUTO = "auto"  # scale dtype: the weight's own dtype, as compressed-tensors stores it

# how scales are chosen (compressed-tensors' observer names): "minmax" is the range of the block,
# "mse" the search of qtool.kernels.mse for the scale (and zero point) of least squared error
OBSERVERS = ("minmax", "mse")

# the spellings of the scale types that are not plain storage dtypes, by family
SCALE_SPELLINGS = {"E8M0": "e8m0", "F8_E8M0": "e8m0", "E4M3": "e4m3", "UE4M3": "e4m3", "F8_E4M3": "e4m3"}


def scale_kind(scale_dtype: str) -> str | None:
    """ "auto", "float", "e8m0", "e4m3" or "int" for a scale dtype's spelling; None if unknown."""
    name = scale_dtype.upper()
    if name == AUTO.upper():
        return "auto"
    if name in SCALE_SPELLINGS:
        return SCALE_SPELLINGS[name]
    dtype = DTYPES.get(name)
    if dtype is None:
        return None
    return "float" if dtype.is_float else "int"


Block = tuple["int | None", ...]
TENSOR: Block = (None, None)
CHANNEL: Block = (1, None)


def group(size: int) -> Block:
    return (1, size)


@dataclass(frozen=True)
class QScheme:
    """How one weight is quantized. Invalid combinations can't be constructed."""

    qtype: QType
    block: Block
    symmetric: bool = True
    scale_dtype: str = "F32"  # storage dtype name of the scale ("BF16", "F32", "E8M0", "E4M3", ...)
    zero_point: bool = False  # a zero point is stored (GPTQ stores one even when symmetric)
    global_scale: bool = False  # a second-level per-tensor scale (NVFP4, tensor_group)
    observer: str = "minmax"  # how scales are chosen: part of the math, recorded by the writers
    rule: str | None = None  # the toolchain algorithm that defines the codes and scales ("Q4_K": llama.cpp's)

    def __post_init__(self) -> None:
        if not isinstance(self.qtype, QType):
            raise SchemeError(
                f"a scheme's value type must be a QType, got {self.qtype!r}", hint=f"known: {' '.join(QTYPES)}"
            )
        if not isinstance(self.block, tuple) or not self.block:
            raise SchemeError(
                f"block must be a non-empty tuple, got {self.block!r}",
                hint="e.g. (1, 128) for groups of 128, (1, None) per channel",
            )
        for size in self.block:
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise SchemeError(
                    f"block sizes must be positive ints or None, got {self.block!r}", hint="e.g. (1, 128), (128, 128)"
                )
        if not isinstance(self.scale_dtype, str) or scale_kind(self.scale_dtype) is None:
            raise SchemeError(
                f"unknown scale dtype {self.scale_dtype!r}",
                hint=f"use {AUTO!r} (the weight's dtype), one of {', '.join(SCALE_SPELLINGS)}, or a storage dtype ({' '.join(DTYPES)})",
            )
        if self.observer not in OBSERVERS:
            raise SchemeError(f"unknown observer {self.observer!r}", hint=f"known: {', '.join(OBSERVERS)}")
        if self.observer == "mse" and (self.qtype.kind != "int" or self.rule is not None):
            what = (
                f"{self.rule} is a GGUF block type with llama.cpp's own block math"
                if self.rule
                else f"{self.qtype.name} scales are chosen by min-max"
            )
            raise SchemeError(
                f"the mse observer searches int scales only: {what}",
                hint="use observer mse with int2..int8 schemes (e.g. int4:g128:mse), or minmax here",
            )
        if not self.symmetric and self.qtype.kind != "int":
            raise SchemeError(
                f"{self.qtype.name} is symmetric only", hint="asymmetric (zero point) schemes need an int value type"
            )
        if self.rule is not None and (not isinstance(self.rule, str) or not self.rule):
            raise SchemeError(
                f"a scheme's rule must name an algorithm, got {self.rule!r}",
                hint="e.g. Q4_K for llama.cpp's Q4_K quantizer",
            )

    @property
    def scale_kind(self) -> str:
        """The scale's family, whatever its spelling: "auto", "float", "e8m0", "e4m3" or "int"."""
        return scale_kind(self.scale_dtype) or "float"

    # -- granularity, derived from the block shape -------------------------------------------

    @property
    def granularity(self) -> Granularity:
        *lead, last = self.block
        if all(b is None for b in self.block):
            return "tensor"
        if self.channel_axis is not None:
            return "channel"
        if last is not None and all(b == 1 for b in lead):
            return "group"
        return "block"

    @property
    def channel_axis(self) -> int | None:
        """The block dimension that has one scale per index, for a per-channel scheme; else None.
        (1, None) is per output channel (axis 0); (None, 1), as PyTorch's per_channel_affine with
        axis=1 stores it, is one scale per input column (axis 1)."""
        *lead, last = self.block
        if last is None and lead and all(b == 1 for b in lead):
            return len(self.block) - 2
        ones = [axis for axis, b in enumerate(self.block) if b == 1]
        if (
            len(self.block) >= 2
            and len(ones) == 1
            and all(b is None for axis, b in enumerate(self.block) if axis != ones[0])
        ):
            return ones[0]
        return None

    @property
    def group_size(self) -> int | None:
        return self.block[-1] if self.granularity == "group" else None

    def block_for(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The concrete block for a weight of `shape`: trailing-aligned, `None` = whole dim."""
        if len(shape) < len(self.block):
            # a 1-D weight under a 2-D scheme: drop the leading block dims
            block = self.block[len(self.block) - len(shape) :] if shape else ()
        else:
            block = (1,) * (len(shape) - len(self.block)) + self.block
        if self.granularity == "tensor":
            return tuple(shape)
        return tuple(dim if b is None else b for b, dim in zip(block, shape))

    # -- names ----------------------------------------------------------------------------------

    @property
    def bits(self) -> int:
        return self.qtype.bits

    @property
    def family(self) -> str:
        """Named families where the scale type defines the format: mxfp4, mxfp8, nvfp4."""
        name, scale = self.qtype.name, self.scale_dtype.upper()
        if scale in ("E8M0", "F8_E8M0") and name == "fp4_e2m1":
            return "mxfp4"
        if scale in ("E8M0", "F8_E8M0") and name == "fp8_e4m3":
            return "mxfp8"
        if scale in ("E4M3", "F8_E4M3", "UE4M3") and name == "fp4_e2m1":
            return "nvfp4"
        return name

    @property
    def granularity_label(self) -> str:
        gran = self.granularity
        if gran == "group":
            return f"g{self.group_size}"
        if gran == "block":
            return "block" + "x".join("*" if b is None else str(b) for b in self.block)
        if gran == "channel" and self.block[-1] is not None:
            return f"channel(axis={self.channel_axis})"  # not the usual one scale per output row
        return gran

    @property
    def label(self) -> str:
        """A short human name such as `int4 sym g128`, `fp8_e4m3 block128x128`, `mxfp4 g32`."""
        parts = [self.family]
        if self.qtype.kind == "int":
            parts.append("sym" if self.symmetric else "asym")
        parts.append(self.granularity_label)
        if self.observer != "minmax":
            parts.append(self.observer)  # "int4 sym g128 mse": min-max stays unsaid, the default
        if self.rule and self.rule.lower() != self.family:
            parts.insert(0, self.rule)  # "Q4_K uint4 asym g256": the name llama.cpp users know
        return " ".join(parts)


def nominal_bits_per_weight(scheme: QScheme, shape: tuple[int, int] = (4096, 4096), weight_bits: int = 16) -> float:
    """Storage bits per weight for a `shape` weight: values plus scales, zero points, global scale."""
    rows, cols = shape
    block = scheme.block_for(shape)
    blocks = math.ceil(rows / block[0]) * math.ceil(cols / block[1])
    scale_bits = {AUTO: weight_bits, "F32": 32, "F16": 16, "BF16": 16, "E8M0": 8, "F8_E4M3": 8}.get(
        scheme.scale_dtype, 32
    )
    total = rows * cols * scheme.bits + blocks * scale_bits
    if scheme.zero_point:
        total += blocks * (
            16 if scheme.rule else scheme.bits
        )  # llama.cpp's f16 minimum, else packed at the value width
    if scheme.global_scale:
        total += 32
    return total / (rows * cols)
