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

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from qtool.dtypes import DTYPES
from qtool.errors import UsageError

__all__ = [
    "QType",
    "QTYPES",
    "NF4_CODEBOOK",
    "FP4_BNB_CODEBOOK",
    "qtype",
    "unknown_qtype",
    "QScheme",
    "Granularity",
    "TENSOR",
    "CHANNEL",
    "group",
    "AUTO",
    "PRESETS",
    "SHORT_FORMS",
    "SchemeError",
    "OBSERVERS",
    "parse_scheme",
    "scheme_names",
    "nominal_bits_per_weight",
]

QKind = Literal["int", "float", "codebook", "unknown"]


class SchemeError(UsageError):
    """A scheme that cannot exist, or that a layout cannot store for a weight; says what is allowed."""

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
    codebook: tuple[float, ...] | None = None  # the values a code indexes, for codebook types


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

# bitsandbytes' tables (functional.py get_4bit_type). It writes fp4 index 8 as the int `-0`, so
# its table holds +0.0 there, not -0.0. Kept here, torch-free, so detection can compare a
# checkpoint's stored quant_map without importing torch.
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
FP4_BNB_CODEBOOK = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)

_CODEBOOK_TYPES = [
    QType("nf4", 4, "codebook", -1.0, 1.0, codebook=NF4_CODEBOOK),
    QType("fp4_bnb", 4, "codebook", -1.0, 1.0, codebook=FP4_BNB_CODEBOOK),
]

QTYPES: dict[str, QType] = {q.name: q for q in (*_int_types(), *_FLOAT_TYPES, *_CODEBOOK_TYPES)}


def qtype(name: str) -> QType:
    """Look up a value type by name; the SchemeError lists the valid names."""
    try:
        return QTYPES[name]
    except KeyError:
        raise SchemeError(f"unknown value type {name!r}", hint=f"known: {' '.join(QTYPES)}") from None


def unknown_qtype(label: str, bits: int = 0) -> QType:
    """A value type qtool can name but not decode, e.g. a GGUF type id newer than qtool."""
    return QType(f"unknown({label})", bits, "unknown")


# how scales are chosen (compressed-tensors' observer names); "minmax" is the range of the block
OBSERVERS = ("minmax",)

# the spellings of the scale types that are not plain storage dtypes, by family
SCALE_SPELLINGS = {"E8M0": "e8m0", "F8_E8M0": "e8m0", "E4M3": "e4m3", "UE4M3": "e4m3", "F8_E4M3": "e4m3"}


def scale_kind(scale_dtype: str) -> str | None:
    """"auto", "float", "e8m0", "e4m3" or "int" for a scale dtype's spelling; None if unknown."""
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
    packing: str | None = None  # how values sit in storage words, e.g. "int32 along in, LSB first"
    convention: str = "qtool"
    extra: tuple[tuple[str, str], ...] = field(default=())  # convention-specific facts, shown in notes

    observer: str = "minmax"  # how scales are chosen: part of the math, recorded by the writers

    def __post_init__(self) -> None:
        if not isinstance(self.qtype, QType):
            raise SchemeError(f"a scheme's value type must be a QType, got {self.qtype!r}", hint=f"known: {' '.join(QTYPES)}")
        if not isinstance(self.block, tuple) or not self.block:
            raise SchemeError(f"block must be a non-empty tuple, got {self.block!r}", hint="e.g. (1, 128) for groups of 128, (1, None) per channel")
        for size in self.block:
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise SchemeError(f"block sizes must be positive ints or None, got {self.block!r}", hint="e.g. (1, 128), (128, 128)")
        if not isinstance(self.scale_dtype, str) or scale_kind(self.scale_dtype) is None:
            raise SchemeError(
                f"unknown scale dtype {self.scale_dtype!r}",
                hint=f"use {AUTO!r} (the weight's dtype), one of {', '.join(SCALE_SPELLINGS)}, or a storage dtype ({' '.join(DTYPES)})",
            )
        if self.observer not in OBSERVERS:
            raise SchemeError(f"unknown observer {self.observer!r}", hint=f"known: {', '.join(OBSERVERS)}")
        if not self.symmetric and self.qtype.kind != "int":
            raise SchemeError(f"{self.qtype.name} is symmetric only", hint="asymmetric (zero point) schemes need an int value type")

    @property
    def gguf_type(self) -> str | None:
        """The llama.cpp block type whose own scale rule this scheme is (Q4_0, Q4_K, ...), if any:
        such a scheme is GGUF's math, which no other layout reproduces."""
        return dict(self.extra).get("gguf_type")

    @property
    def gguf_mix(self) -> str | None:
        """The llama.cpp file type (Q4_K_M, ...) this stands for: a mix of GGUF types that the
        gguf layout resolves per tensor (`qtool.layouts.gguf_mix`), not one scheme."""
        return dict(self.extra).get("gguf_mix")

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
        if self.gguf_mix:
            return f"{self.gguf_mix} (llama.cpp file type)"
        parts = [self.family]
        if self.qtype.kind == "int":
            parts.append("sym" if self.symmetric else "asym")
        parts.append(self.granularity_label)
        gguf_type = self.gguf_type
        if self.convention == "gguf" and gguf_type and gguf_type.lower() != self.family:
            parts.insert(0, gguf_type)  # "Q4_K uint4 asym g256": the name llama.cpp users know
        return " ".join(parts)


# -- scheme strings ------------------------------------------------------------------------------
#
# The CLI accepts compressed-tensors preset names where they exist, and a short form
# `<type>[:<granularity>][:sym|asym]`, granularity being tensor | channel | g<N> | block<H>x<W>.
# Presets and words such as "channel" and "g128" become a block shape here, once.

AUTO = "auto"  # scale dtype: the weight's own dtype, as compressed-tensors stores it

CT = "compressed-tensors"
BNB = "bitsandbytes"
GGUF = "gguf"


def _ct(name: str, block: Block, symmetric: bool = True, scale: str = AUTO, global_scale: bool = False) -> QScheme:
    return QScheme(qtype(name), block, symmetric, scale, zero_point=not symmetric, global_scale=global_scale, convention=CT)


def _gguf(value: str, gguf_type: str, symmetric: bool, scale: str = "F16") -> QScheme:
    return QScheme(qtype(value), group(32), symmetric, scale, zero_point=not symmetric, convention=GGUF, extra=(("gguf_type", gguf_type),))


def _gguf_k(value: str, gguf_type: str, symmetric: bool, sub_blocks: str) -> QScheme:
    """A K-quant: 256-value super-blocks of sub-blocks with their own quantized scales."""
    return QScheme(
        qtype(value), group(256), symmetric, "F16", zero_point=not symmetric, convention=GGUF,
        extra=(("gguf_type", gguf_type), ("super_block", f"256 = {sub_blocks}")),
    )  # fmt: skip


# name -> (scheme, what it is). Presets are matched case-insensitively.
PRESETS: dict[str, tuple[QScheme, str]] = {
    "W8A16": (_ct("int8", group(128)), "int8 weights, symmetric, group 128 (compressed-tensors preset)"),
    "W4A16": (_ct("int4", group(128)), "int4 weights, symmetric, group 128 (compressed-tensors preset)"),
    "W4A16_ASYM": (_ct("int4", group(128), symmetric=False), "int4 weights with zero points, group 128"),
    "FP8": (_ct("fp8_e4m3", TENSOR), "fp8 e4m3 weights, one scale per tensor"),
    "FP8_DYNAMIC": (_ct("fp8_e4m3", CHANNEL), "fp8 e4m3 weights, one scale per output channel; dynamic per-token activations"),
    "FP8_BLOCK": (_ct("fp8_e4m3", (128, 128)), "fp8 e4m3 weights in 128x128 blocks (DeepSeek-V3 style)"),
    "NVFP4A16": (_ct("fp4_e2m1", group(16), scale="F8_E4M3", global_scale=True), "fp4 e2m1, e4m3 scales per 16, one f32 global scale"),
    "MXFP4A16": (_ct("fp4_e2m1", group(32), scale="E8M0"), "fp4 e2m1 with power-of-two e8m0 scales per 32 (OCP MX)"),
}

# short-form aliases of named formats whose granularity is fixed
_FIXED = {
    "mxfp4": PRESETS["MXFP4A16"][0],
    "nvfp4": PRESETS["NVFP4A16"][0],
    "q8_0": _gguf("int8", "Q8_0", True),
    "q4_0": _gguf("int4", "Q4_0", True),
    "q4_1": _gguf("uint4", "Q4_1", False),
    "q5_0": _gguf("int5", "Q5_0", True),
    "q5_1": _gguf("uint5", "Q5_1", False),
    "q2_k": _gguf_k("uint2", "Q2_K", False, "16 × 16, 4-bit scales and mins"),
    "q3_k": _gguf_k("int3", "Q3_K", True, "16 × 16, 6-bit scales"),
    "q4_k": _gguf_k("uint4", "Q4_K", False, "8 × 32, 6-bit scales and mins"),
    "q5_k": _gguf_k("uint5", "Q5_K", False, "8 × 32, 6-bit scales and mins"),
    "q6_k": _gguf_k("int6", "Q6_K", True, "16 × 16, int8 scales"),
}
_DEFAULT_BLOCK = {"int8": CHANNEL, "int4": group(128), "int3": group(128), "int2": group(64), "fp8_e4m3": TENSOR, "fp8_e5m2": TENSOR, "nf4": group(64)}
_ALIASES = {"fp8": "fp8_e4m3", "int8": "int8", "int4": "int4", "int3": "int3", "int2": "int2", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "nf4": "nf4"}

# the examples `qtool schemes` lists besides the presets; every one must parse
SHORT_FORMS = (
    "int8", "int4:g128", "int4:g64:asym", "int2:g64", "fp8_e4m3:channel", "fp8:block128x128",
    "nf4:g64", "mxfp4", "nvfp4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
)


def scheme_names() -> list[str]:
    return [*PRESETS, *SHORT_FORMS]


def parse_scheme(text: str) -> QScheme:
    """A preset name or short form -> QScheme. ValueError lists the valid names and a close match."""
    name = text.strip()
    for preset, (scheme, _) in PRESETS.items():
        if name.upper() == preset:
            return scheme
    lowered = name.lower()
    if lowered in _FIXED:
        return _FIXED[lowered]
    head, *mods = lowered.split(":")
    if head in _FIXED:
        raise _unknown(text, f"{head} has a fixed layout; write just {head!r}")
    if head not in _ALIASES:
        raise _unknown(text)
    value = _ALIASES[head]
    block: Block = _DEFAULT_BLOCK[value]
    symmetric = True
    for mod in mods:
        if mod in ("sym", "asym"):
            symmetric = mod == "sym"
        elif mod == "tensor":
            block = TENSOR
        elif mod == "channel":
            block = CHANNEL
        elif re.fullmatch(r"g[1-9]\d*", mod):
            block = group(int(mod[1:]))
        elif re.fullmatch(r"block[1-9]\d*x[1-9]\d*", mod):
            rows, cols = mod[5:].split("x")
            block = (int(rows), int(cols))
        else:
            raise _unknown(text, f"unknown part {mod!r}: use tensor, channel, g<N>, block<H>x<W>, sym or asym")
    if not symmetric and value.startswith(("fp8", "nf4")):
        raise _unknown(text, f"{value} is symmetric only")
    if value == "nf4":
        if block[0] != 1 or block[-1] is None:
            raise _unknown(text, "nf4 takes a group size, e.g. nf4:g64")
        return QScheme(qtype("nf4"), block, True, "F32", convention=BNB)
    return _ct(value, block, symmetric)


def _unknown(text: str, why: str | None = None) -> SchemeError:
    import difflib

    if why is None and re.fullmatch(r"Q[2-6]_K_[SML]", text.strip().upper()):
        why = "a llama.cpp file type (a mix of GGUF types), which only quantize --scheme takes; name one type here, e.g. q4_k"

    names = scheme_names()
    close = difflib.get_close_matches(text, names, n=1, cutoff=0.5) or difflib.get_close_matches(
        text.upper(), [n.upper() for n in names], n=1, cutoff=0.5
    )
    message = f"unknown scheme {text!r}" + (f": {why}" if why else "")
    hint = (f"did you mean {close[0]!r}? " if close else "") + "valid: " + ", ".join(names)
    return SchemeError(message, hint=hint)


def nominal_bits_per_weight(scheme: QScheme, shape: tuple[int, int] = (4096, 4096), weight_bits: int = 16) -> float:
    """Storage bits per weight for a `shape` weight: values plus scales, zero points, global scale."""
    rows, cols = shape
    block = scheme.block_for(shape)
    blocks = math.ceil(rows / block[0]) * math.ceil(cols / block[1])
    scale_bits = {AUTO: weight_bits, "F32": 32, "F16": 16, "BF16": 16, "E8M0": 8, "F8_E4M3": 8}.get(scheme.scale_dtype, 32)
    total = rows * cols * scheme.bits + blocks * scale_bits
    if scheme.zero_point:
        total += blocks * (16 if scheme.gguf_type else scheme.bits)  # GGUF's f16 minimum, else packed at the value width
    if scheme.global_scale:
        total += 32
    return total / (rows * cols)
