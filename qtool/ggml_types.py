"""ggml's tensor types, one row each: id, name, values per block and bytes per block (gguf-py's
`GGML_QUANT_SIZES`, checked against the installed package by the tests), the scheme a block type
is, what its block holds besides (shown as a GGUF weight's details), the `llama_ftype` a file
mostly of this type is named by, whose quantizer qtool's bytes follow, what llama.cpp says of an
importance matrix for it, llama.cpp's fallback for rows that fit no block, and the entries the
kernels know it by.

Everything about a GGML type lives here, and a `GgmlType` (never its name) is what the rest of
qtool passes on once it has looked one up: the GGUF reader sizes tensors from it, the GGUF
convention reads a block type's scheme from it, `--scheme q4_k` is its row's scheme, the GGUF
layout stamps `general.file_type` from it, the selection (`qtool.llamacpp.mixes`) reads its
fallback and its importance rule, and the GGUF block encoder (`qtool.encoders.ggml_blocks`) and
decoders (`qtool.conventions.gguf`, `qtool.native_decoders`) call the kernel entries it names.
The kernels (`qtool.native`'s C tables, `qtool.kernels.gguf_blocks`) register each type under
its name and know nothing else of it; tests/test_ggml_types.py checks that they and the rows
agree. A new type is its row and its kernels.

llama.cpp's own types (Q4_0 ... Q6_K, the IQ and TQ types) are schemes with a `rule`: their
codes and scales come from llama.cpp's quantizers, which no other layout reproduces. MXFP4 and
NVFP4 are the OCP and NVIDIA formats, no rule: compressed-tensors' MXFP4A16 is the same math.

The importance rule is llama.cpp's, in two strengths (`imatrix`): ggml's quantizer cannot make
IQ2_XXS, IQ2_XS and IQ1_S without one (`ggml_quantize_requires_imatrix`, ggml/src/ggml.c: it
asserts), and llama-quantize refuses those and IQ3_XXS, IQ2_S, IQ1_M without one too
(`tensor_requires_imatrix`, src/llama-quant.cpp: the output would be garbage; Q2_K only in a
Q2_K_S file, a rule of that mix). Q8_0's quantizer ignores one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from qtool.errors import UnknownNameError
from qtool.qtypes import QType, qtype
from qtool.scheme import QScheme, group

__all__ = [
    "GgmlType",
    "GGML_TYPES",
    "GGUF_PY",
    "LLAMA_CPP",
    "IGNORED",
    "OPTIONAL",
    "LLAMA_QUANTIZE",
    "REQUIRED",
    "LLAMA_FTYPES",
    "GGML_QUANT_VERSION",
    "ggml_type",
    "ggml_type_named",
    "type_for",
]

GGML_QUANT_VERSION = 2  # general.quantization_version, as llama-quantize stamps it

# llama.cpp's `llama_ftype` (gguf-py's LlamaFileType): the number general.file_type holds. Here so
# writing a GGUF needs no import of gguf-py (numpy and its own tables: ~1 s of a small run); a test
# checks the table against the installed package.
LLAMA_FTYPES = {
    "ALL_F32": 0, "MOSTLY_F16": 1, "MOSTLY_Q4_0": 2, "MOSTLY_Q4_1": 3, "MOSTLY_Q8_0": 7, "MOSTLY_Q5_0": 8,
    "MOSTLY_Q5_1": 9, "MOSTLY_Q2_K": 10, "MOSTLY_Q3_K_S": 11, "MOSTLY_Q3_K_M": 12, "MOSTLY_Q3_K_L": 13,
    "MOSTLY_Q4_K_S": 14, "MOSTLY_Q4_K_M": 15, "MOSTLY_Q5_K_S": 16, "MOSTLY_Q5_K_M": 17, "MOSTLY_Q6_K": 18,
    "MOSTLY_IQ2_XXS": 19, "MOSTLY_IQ2_XS": 20, "MOSTLY_Q2_K_S": 21, "MOSTLY_IQ3_XS": 22, "MOSTLY_IQ3_XXS": 23,
    "MOSTLY_IQ1_S": 24, "MOSTLY_IQ4_NL": 25, "MOSTLY_IQ3_S": 26, "MOSTLY_IQ3_M": 27, "MOSTLY_IQ2_S": 28,
    "MOSTLY_IQ2_M": 29, "MOSTLY_IQ4_XS": 30, "MOSTLY_IQ1_M": 31, "MOSTLY_BF16": 32, "MOSTLY_TQ1_0": 36,
    "MOSTLY_TQ2_0": 37, "MOSTLY_MXFP4_MOE": 38, "MOSTLY_NVFP4": 39, "MOSTLY_Q1_0": 40,
}  # fmt: skip


# whose quantizer qtool's bytes of a type follow (`GgmlType.quantizer`)
GGUF_PY = (
    "gguf-py"  # gguf-py's numpy quantizer, which qtool runs; the C kernel, where there is one, is byte for byte it
)
LLAMA_CPP = "llama.cpp"  # llama.cpp's reference quantizers, in qtool's C kernels only (rows with inf/NaN included)

# what llama.cpp says of an importance matrix for a type (`GgmlType.imatrix`)
IGNORED = "ignored"  # its quantizer takes none (quantize_q8_0)
OPTIONAL = "optional"  # weighed where one is given, quantized without one otherwise
LLAMA_QUANTIZE = "llama-quantize"  # llama-quantize refuses it without one (tensor_requires_imatrix)
REQUIRED = "required"  # ggml's quantizer cannot make it without one (ggml_quantize_requires_imatrix); llama-quantize refuses it too


@dataclass(frozen=True)
class GgmlType:
    """One row of ggml's type table: `block_size` elements take `type_size` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int
    scheme: QScheme | None = None  # a block type's scheme; None for the plain types and the unknown
    details: tuple[tuple[str, str], ...] = ()  # what a block holds besides its codes, in words
    file_type: str | None = None  # gguf.LlamaFileType member naming a file mostly of this type
    quantizer: str | None = None  # GGUF_PY or LLAMA_CPP: whose bytes qtool writes; None: qtool writes none
    imatrix: str = OPTIONAL  # IGNORED, OPTIONAL, LLAMA_QUANTIZE or REQUIRED (llama.cpp's rule)
    fallback: str | None = None  # llama.cpp's type for rows that are not a multiple of the block (tensor_type_fallback)
    # the entry each kernel knows this type by (its name, as ggml's tables do), None where it has none
    native_encoder: str | None = None  # qtool.native.encode_gguf / transcode_gguf (C: gguf_encode.c's qt_encoders)
    native_decoder: str | None = None  # qtool.native.decode_gguf (C: gguf.c's qt_gguf_types)
    torch_decoder: str | None = None  # qtool.kernels.gguf_blocks.decode
    # a plain integer grid: one float16 d (and, asymmetric, one float16 m) per block and codes
    # as they are, q - 2^(b-1) (symmetric) or q (W = d*q + m): qtool.kernels.gguf_blocks.block_codes
    # reads them and qtool.layouts.moves writes them, so codes move in and out without requantizing
    plain_grid: bool = False

    def nbytes(self, numel: int) -> int:
        return numel // self.block_size * self.type_size

    @property
    def quantizer_needs_imatrix(self) -> bool:
        """ggml's quantizer cannot make this type without importance weights."""
        return self.imatrix == REQUIRED

    @property
    def llama_quantize_needs_imatrix(self) -> bool:
        """llama-quantize refuses a tensor of this type without an importance matrix (except
        token_embd and output, which `qtool.llamacpp.mixes.requires_imatrix` leaves out)."""
        return self.imatrix in (LLAMA_QUANTIZE, REQUIRED)

    @property
    def takes_imatrix(self) -> bool:
        """An importance matrix changes this type's bytes (llama.cpp's weighted quantizer)."""
        return self.imatrix != IGNORED


def _llama(name: str, value: str | QType, block: int, *, symmetric: bool = True, scale: str = "F16") -> QScheme:
    """A llama.cpp block type's scheme: its values, block and scale; the rule is its name."""
    value_type = qtype(value) if isinstance(value, str) else value
    return QScheme(value_type, group(block), symmetric, scale, zero_point=not symmetric, rule=name)


def _codebook(name: str, bits: int) -> QType:
    return QType(name, bits, "codebook")


_TERNARY = QType("ternary", 2, "int", -1, 1)


def _row(
    id: int, name: str, block: int, size: int, scheme: QScheme | None = None, file_type: str | None = None, *,
    kernels: str = "", by: str | None = None, imatrix: str = OPTIONAL, fallback: str | None = None, **details: str,
) -> GgmlType:  # fmt: skip
    """`kernels`: which kernels have the type, "e" qtool.native's encoder, "d" its decoder, "t"
    the torch decoder, "g" a plain integer grid (`GgmlType.plain_grid`); `by`: whose quantizer
    the bytes follow."""
    entry = {kind: name if kind in kernels else None for kind in "edt"}
    return GgmlType(
        id,
        name,
        block,
        size,
        scheme,
        tuple(details.items()),
        file_type,
        by,
        imatrix,
        fallback,
        entry["e"],
        entry["d"],
        entry["t"],
        "g" in kernels,
    )


def _k(
    id: int,
    name: str,
    size: int,
    value: str,
    symmetric: bool,
    sub_blocks: str,
    file_type: str | None = None,
    scale: str = "F16",
    kernels: str = "edt",
    fallback: str | None = None,
) -> GgmlType:
    """A K-quant: 256-value super-blocks of sub-blocks with their own quantized scales."""
    scheme = _llama(name, value, 256, symmetric=symmetric, scale=scale)
    by = LLAMA_CPP if "e" in kernels else None
    return _row(
        id,
        name,
        256,
        size,
        scheme,
        file_type,
        kernels=kernels,
        by=by,
        fallback=fallback,
        super_block=f"256 = {sub_blocks}",
    )


def _iq(
    id: int,
    name: str,
    size: int,
    bits: int,
    file_type: str | None = None,
    *,
    kernels: str = "ed",
    imatrix: str = OPTIONAL,
    **details: str,
) -> GgmlType:
    """An IQ type of 256-value super-blocks: llama.cpp falls back to IQ4_NL for rows they do not fit."""
    by = LLAMA_CPP if "e" in kernels else None
    return _row(
        id,
        name,
        256,
        size,
        _llama(name, _codebook(name.lower(), bits), 256),
        file_type,
        kernels=kernels,
        by=by,
        imatrix=imatrix,
        fallback="IQ4_NL",
        **details,
    )


# (id, name, values per block, bytes per block, scheme, llama_ftype, kernels, quantizer, importance, fallback, details)
_ROWS = (
    _row(0, "F32", 1, 4, file_type="ALL_F32"),
    _row(1, "F16", 1, 2, file_type="MOSTLY_F16"),
    _row(2, "Q4_0", 32, 18, _llama("Q4_0", "int4", 32), "MOSTLY_Q4_0", kernels="edtg", by=GGUF_PY),
    _row(3, "Q4_1", 32, 20, _llama("Q4_1", "uint4", 32, symmetric=False), "MOSTLY_Q4_1", kernels="edtg", by=GGUF_PY),
    _row(6, "Q5_0", 32, 22, _llama("Q5_0", "int5", 32), "MOSTLY_Q5_0", kernels="edt", by=GGUF_PY),
    _row(7, "Q5_1", 32, 24, _llama("Q5_1", "uint5", 32, symmetric=False), "MOSTLY_Q5_1", kernels="edt", by=GGUF_PY),
    _row(8, "Q8_0", 32, 34, _llama("Q8_0", "int8", 32), "MOSTLY_Q8_0", kernels="edtg", by=GGUF_PY, imatrix=IGNORED),
    _row(9, "Q8_1", 32, 40, _llama("Q8_1", "int8", 32), sum="f16 d·Σq per block, for dot products"),
    # a K-quant file is named by its commonest type as llama.cpp's loader names it (the _M mixes)
    _k(10, "Q2_K", 84, "uint2", False, "16 × 16, 4-bit scales and mins", "MOSTLY_Q2_K", fallback="Q4_0"),
    _k(11, "Q3_K", 110, "int3", True, "16 × 16, 6-bit scales", "MOSTLY_Q3_K_M", fallback="Q4_0"),
    _k(12, "Q4_K", 144, "uint4", False, "8 × 32, 6-bit scales and mins", "MOSTLY_Q4_K_M", fallback="Q5_0"),
    _k(13, "Q5_K", 176, "uint5", False, "8 × 32, 6-bit scales and mins", "MOSTLY_Q5_K_M", fallback="Q5_1"),
    _k(14, "Q6_K", 210, "int6", True, "16 × 16, int8 scales", "MOSTLY_Q6_K", fallback="Q8_0"),
    _k(15, "Q8_K", 292, "int8", True, "one f32 scale, 16 int16 block sums", scale="F32", kernels="t"),
    _iq(
        16,
        "IQ2_XXS",
        66,
        2,
        imatrix=REQUIRED,
        super_block="256 = 8 × 32, 4-bit scales",
        codebook="256 × 8 magnitudes, 7-bit sign masks",
    ),
    _iq(
        17,
        "IQ2_XS",
        74,
        2,
        imatrix=REQUIRED,
        super_block="256 = 16 × 16, 4-bit scales",
        codebook="512 × 8 magnitudes, 7-bit sign masks",
    ),
    _iq(
        18,
        "IQ3_XXS",
        98,
        3,
        imatrix=LLAMA_QUANTIZE,
        super_block="256 = 8 × 32, 4-bit scales",
        codebook="256 × 4 magnitudes, 7-bit sign masks",
    ),
    _iq(
        19,
        "IQ1_S",
        50,
        1,
        kernels="",
        imatrix=REQUIRED,
        super_block="256 = 8 × 32, 3-bit scales, ±1/8 shift",
        codebook="2048 × 8 values in {-1, 0, 1}",
    ),
    _row(
        20,
        "IQ4_NL",
        32,
        18,
        _llama("IQ4_NL", _codebook("iq4_nl", 4), 32),
        "MOSTLY_IQ4_NL",
        kernels="edt",
        by=LLAMA_CPP,
        codebook="16 non-linear values (kvalues_iq4nl)",
    ),
    _iq(
        21,
        "IQ3_S",
        110,
        3,
        "MOSTLY_IQ3_S",
        super_block="256 = 8 × 32, 4-bit scales",
        codebook="512 × 4 magnitudes, sign bits",
    ),
    _iq(
        22,
        "IQ2_S",
        82,
        2,
        imatrix=LLAMA_QUANTIZE,
        super_block="256 = 16 × 16, 4-bit scales",
        codebook="1024 × 8 magnitudes, sign bits",
    ),
    _iq(
        23,
        "IQ4_XS",
        136,
        4,
        "MOSTLY_IQ4_XS",
        kernels="edt",
        super_block="256 = 8 × 32, 6-bit scales",
        codebook="16 non-linear values (kvalues_iq4nl)",
    ),
    _row(24, "I8", 1, 1),
    _row(25, "I16", 1, 2),
    _row(26, "I32", 1, 4),
    _row(27, "I64", 1, 8),
    _row(28, "F64", 1, 8),
    _iq(
        29,
        "IQ1_M",
        56,
        1,
        kernels="",
        imatrix=LLAMA_QUANTIZE,
        super_block="256 = 16 × 16, 3-bit scales, ±1/8 shift",
        codebook="2048 × 8 values in {-1, 0, 1}",
    ),
    _row(30, "BF16", 1, 2, file_type="MOSTLY_BF16"),
    _row(
        34,
        "TQ1_0",
        256,
        54,
        _llama("TQ1_0", _TERNARY, 256),
        kernels="t",
        fallback="Q4_0",
        packing="base 3, 5 trits a byte",
    ),
    _row(35, "TQ2_0", 256, 66, _llama("TQ2_0", _TERNARY, 256), kernels="t", fallback="Q4_0", packing="2 bits a trit"),
    _row(
        39,
        "MXFP4",
        32,
        17,
        QScheme(qtype("fp4_e2m1"), group(32), True, "E8M0"),
        "MOSTLY_MXFP4_MOE",
        kernels="dt",
        by=GGUF_PY,
    ),
    _row(
        40,
        "NVFP4",
        64,
        36,
        QScheme(qtype("fp4_e2m1"), group(16), True, "UE4M3"),
        kernels="dt",
        super_block="64 = 4 × 16, ue4m3 scales",
    ),
    _row(41, "Q1_0", 128, 18),
)

GGML_TYPES: dict[int, GgmlType] = {row.id: row for row in _ROWS}
_BY_NAME = {row.name: row for row in _ROWS}


@functools.lru_cache(maxsize=64)  # a file of 32k tensors of one unknown id asks 32k times
def ggml_type(type_id: int) -> GgmlType | None:
    """The type with this id, or None. An id qtool's table lacks is looked up in the installed
    `gguf` package, so a newer package extends what qtool can size (this imports numpy)."""
    known = GGML_TYPES.get(type_id)
    if known is not None:
        return known
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        member = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[member]
    except (ImportError, ValueError, KeyError):
        return None
    return GgmlType(type_id, member.name, block_size, type_size)


def ggml_type_named(name: str) -> GgmlType:
    """Look up a type by name ("Q4_K"); the UnknownNameError (a KeyError) lists the valid names."""
    try:
        return _BY_NAME[name.upper()]
    except KeyError:
        raise UnknownNameError(f"unknown GGML type {name!r}", hint=f"known: {' '.join(_BY_NAME)}") from None


def _math(scheme: QScheme) -> tuple:
    """A scheme as a block type stores it: the observer (how an encoder picks scales) aside."""
    return (
        scheme.qtype,
        scheme.block,
        scheme.symmetric,
        scheme.scale_kind,
        scheme.zero_point,
        scheme.global_scale,
        scheme.rule,
    )


_BY_MATH = {_math(row.scheme): row for row in _ROWS if row.scheme is not None and row.scheme.rule is None}


def type_for(scheme: QScheme) -> GgmlType | None:
    """The GGML type that holds `scheme`: its rule's type, or the format type whose math it is
    (MXFP4A16 is GGML's MXFP4); None when no GGML type does."""
    if scheme.rule is not None:
        row = _BY_NAME.get(scheme.rule)
        return row if row is not None and row.scheme == scheme else None
    return _BY_MATH.get(_math(scheme))
