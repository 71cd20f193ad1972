"""Quantized value types: one `QType` row per type (int1..int8, uint1..uint8, the fp8/fp6/fp4
floats, the codebook types nf4 and fp4_bnb, and the scale-only e8m0 and ue4m3), in one registry.

A value type says what one code means (its range, whether it is an integer, a float format or an
index into a codebook); how codes are grouped and scaled is the scheme's business
(`qtool.scheme`). Nothing else in qtool restates these facts: a failed lookup lists the names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qtool.errors import SchemeError

__all__ = ["QType", "QTYPES", "NF4_CODEBOOK", "FP4_BNB_CODEBOOK", "qtype", "unknown_qtype"]

QKind = Literal["int", "float", "codebook", "unknown"]


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
