"""Value types and quantization schemes.

A `QType` is one row of facts about a quantized value type (int4, fp8_e4m3, nf4, ...).
A `QScheme` says how a weight was quantized: value type, block shape, symmetry, scale dtype,
zero point, packing, convention.

Granularity is a block shape (see DESIGN "Granularity is a block shape"). A block entry of
`None` means "the whole dimension", so a scheme stays independent of any one weight's shape
and resolves against it with `QScheme.block_for(shape)`. Blocks align to the trailing
dimensions; leading dimensions (MoE experts, say) get 1.

    granularity   block for [out, in]   resolved for [4096, 11008]
    tensor        (None, None)          (4096, 11008)
    channel       (1, None)             (1, 11008)
    group g128    (1, 128)              (1, 128)
    block         (128, 128)            (128, 128)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "QType",
    "QTYPES",
    "qtype",
    "unknown_qtype",
    "QScheme",
    "Granularity",
    "TENSOR",
    "CHANNEL",
    "group",
]

QKind = Literal["int", "float", "codebook", "unknown"]
Granularity = Literal["tensor", "channel", "group", "block"]


@dataclass(frozen=True)
class QType:
    """Facts about one quantized value type. `qmin`/`qmax` are the representable range."""

    name: str
    bits: int
    kind: QKind
    qmin: float | None = None
    qmax: float | None = None
    signed: bool = True


def _int_types() -> list[QType]:
    out = []
    for bits in range(1, 9):
        out.append(QType(f"int{bits}", bits, "int", -(2 ** (bits - 1)), 2 ** (bits - 1) - 1))
        out.append(QType(f"uint{bits}", bits, "int", 0, 2**bits - 1, signed=False))
    return out


_FLOAT_TYPES = [
    QType("fp8_e4m3", 8, "float", -448.0, 448.0),
    QType("fp8_e5m2", 8, "float", -57344.0, 57344.0),
    QType("fp8_e4m3fnuz", 8, "float", -240.0, 240.0),
    QType("fp8_e5m2fnuz", 8, "float", -57344.0, 57344.0),
    QType("fp6_e2m3", 6, "float", -7.5, 7.5),
    QType("fp6_e3m2", 6, "float", -28.0, 28.0),
    QType("fp4_e2m1", 4, "float", -6.0, 6.0),
    # scale-only types: an exponent (MX) and an unsigned e4m3 (NVFP4 block scales)
    QType("e8m0", 8, "float", 2.0**-127, 2.0**127, signed=False),
    QType("ue4m3", 8, "float", 0.0, 448.0, signed=False),
]

_CODEBOOK_TYPES = [
    QType("nf4", 4, "codebook", -1.0, 1.0),
    QType("fp4_bnb", 4, "codebook", -1.0, 1.0),
]

QTYPES: dict[str, QType] = {q.name: q for q in (*_int_types(), *_FLOAT_TYPES, *_CODEBOOK_TYPES)}


def qtype(name: str) -> QType:
    """Look up a value type by name; the KeyError lists the valid names."""
    try:
        return QTYPES[name]
    except KeyError:
        raise KeyError(f"unknown value type {name!r} (known: {' '.join(QTYPES)})") from None


def unknown_qtype(label: str, bits: int = 0) -> QType:
    """A value type qtool can name but not decode, e.g. a GGUF type id newer than qtool."""
    return QType(f"unknown({label})", bits, "unknown")


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
    packing: str | None = None  # how values sit in storage words, e.g. "int32 along in, LSB first"
    convention: str = "qtool"
    extra: tuple[tuple[str, str], ...] = field(default=())  # convention-specific facts, shown in notes

    def __post_init__(self) -> None:
        if not isinstance(self.block, tuple) or not self.block:
            raise ValueError(f"block must be a non-empty tuple, got {self.block!r}")
        for size in self.block:
            if size is not None and (not isinstance(size, int) or size < 1):
                raise ValueError(f"block sizes must be positive ints or None, got {self.block!r}")

    # -- granularity, derived from the block shape -------------------------------------------

    @property
    def granularity(self) -> Granularity:
        *lead, last = self.block
        if all(b is None for b in self.block):
            return "tensor"
        if last is None and all(b == 1 for b in lead):
            return "channel"
        if last is not None and all(b == 1 for b in lead):
            return "group"
        return "block"

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
        return gran

    @property
    def label(self) -> str:
        """A short human name such as `int4 sym g128`, `fp8_e4m3 block128x128`, `mxfp4 g32`."""
        parts = [self.family]
        if self.qtype.kind == "int":
            parts.append("sym" if self.symmetric else "asym")
        parts.append(self.granularity_label)
        return " ".join(parts)
