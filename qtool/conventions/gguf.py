"""GGUF block types (CONVENTIONS §10): each block-quantized tensor is one quantized weight.

`qtool.formats.gguf` stores a block-quantized tensor as raw bytes with `encoding` = the GGML
type name and `logical_shape` in PyTorch order. Here each becomes a `Weight` whose scheme maps
the type onto qtool's: value type, block (the GGML block along the row), scale dtype, and in
`extra` the type name and whatever the block holds besides (sub-block scales, codebooks).
Plain GGUF types (F32, F16, BF16, I8..I64, F64) are ordinary stored tensors: the plain
convention takes them.

Decoding: `qtool.kernels.gguf_blocks` (torch, any device; its docstring lays out each block)
for the types it lists, bit for bit `gguf.quants.dequantize`, and `qtool.native` on the CPU for
the common ones; every other type the `gguf` package can dequantize goes through it (numpy).
"""

from __future__ import annotations

import math

from qtool.conventions.base import Pool
from qtool.errors import QtoolError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.gguf import GgmlType, ggml_type, ggml_type_named
from qtool.scheme import TENSOR, QScheme, QType, group, parse_scheme, qtype, unknown_qtype
from qtool.weight import DATA, Weight

__all__ = ["Gguf", "NAME", "scheme_for_type", "decode_blocks"]

NAME = "gguf"


def _codebook(name: str, bits: int) -> QType:
    return QType(name, bits, "codebook")


_TERNARY = QType("ternary", 2, "int", -1, 1)


def _k(name: str, value: str, symmetric: bool, sub_blocks: str, scale: str = "F16") -> QScheme:
    return QScheme(
        qtype(value), group(256), symmetric, scale, zero_point=not symmetric, convention=NAME,
        extra=(("gguf_type", name), ("super_block", f"256 = {sub_blocks}")),
    )


def _other(name: str, value: QType, block: int, scale: str = "F16", **facts: str) -> QScheme:
    extra = (("gguf_type", name), *((k, v) for k, v in facts.items()))
    return QScheme(value, group(block), True, scale, convention=NAME, extra=extra)


# GGML type name -> scheme. The types qtool also writes (32-blocks, K-quants) come from scheme.py's short forms,
# so a file qtool wrote and a scheme the user typed compare equal.
_SCHEMES: dict[str, QScheme] = {
    **{name: parse_scheme(name.lower()) for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
    "Q8_1": _other("Q8_1", qtype("int8"), 32, sum="f16 d·Σq per block, for dot products"),
    "Q8_K": _k("Q8_K", "int8", True, "one f32 scale, 16 int16 block sums", scale="F32"),
    "IQ1_S": _other("IQ1_S", _codebook("iq1_s", 1), 256, super_block="256 = 8 × 32, 3-bit scales, ±1/8 shift", codebook="2048 × 8 values in {-1, 0, 1}"),
    "IQ1_M": _other("IQ1_M", _codebook("iq1_m", 1), 256, super_block="256 = 16 × 16, 3-bit scales, ±1/8 shift", codebook="2048 × 8 values in {-1, 0, 1}"),
    "IQ2_XXS": _other("IQ2_XXS", _codebook("iq2_xxs", 2), 256, super_block="256 = 8 × 32, 4-bit scales", codebook="256 × 8 magnitudes, 7-bit sign masks"),
    "IQ2_XS": _other("IQ2_XS", _codebook("iq2_xs", 2), 256, super_block="256 = 16 × 16, 4-bit scales", codebook="512 × 8 magnitudes, 7-bit sign masks"),
    "IQ2_S": _other("IQ2_S", _codebook("iq2_s", 2), 256, super_block="256 = 16 × 16, 4-bit scales", codebook="1024 × 8 magnitudes, sign bits"),
    "IQ3_XXS": _other("IQ3_XXS", _codebook("iq3_xxs", 3), 256, super_block="256 = 8 × 32, 4-bit scales", codebook="256 × 4 magnitudes, 7-bit sign masks"),
    "IQ3_S": _other("IQ3_S", _codebook("iq3_s", 3), 256, super_block="256 = 8 × 32, 4-bit scales", codebook="512 × 4 magnitudes, sign bits"),
    "IQ4_NL": _other("IQ4_NL", _codebook("iq4_nl", 4), 32, codebook="16 non-linear values (kvalues_iq4nl)"),
    "IQ4_XS": _other("IQ4_XS", _codebook("iq4_xs", 4), 256, super_block="256 = 8 × 32, 6-bit scales", codebook="16 non-linear values (kvalues_iq4nl)"),
    "TQ1_0": _other("TQ1_0", _TERNARY, 256, packing="base 3, 5 trits a byte"),
    "TQ2_0": _other("TQ2_0", _TERNARY, 256, packing="2 bits a trit"),
    "MXFP4": _other("MXFP4", qtype("fp4_e2m1"), 32, scale="E8M0"),
    "NVFP4": _other("NVFP4", qtype("fp4_e2m1"), 16, scale="UE4M3", super_block="64 = 4 × 16, ue4m3 scales"),
}


def scheme_for_type(gtype: GgmlType) -> tuple[QScheme, str | None]:
    """The scheme of a GGML block type, and a note when qtool knows only its size."""
    known = _SCHEMES.get(gtype.name)
    if known is not None:
        return known, None
    scheme = QScheme(unknown_qtype(gtype.name), group(gtype.block_size), True, "F16", convention=NAME, extra=(("gguf_type", gtype.name),))
    return scheme, f"GGUF type {gtype.name} (id {gtype.id}): qtool knows its block size ({gtype.block_size} in {gtype.type_size} bytes) but not its layout"


class Gguf:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        if checkpoint.format != "gguf":
            return []
        weights = []
        for tensor in pool.values():
            if tensor.encoding is None or tensor.logical_shape is None:
                continue  # a plain GGUF type: the plain convention's
            weights.append(_weight(tensor))
        return weights

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str):
        """The weight as float32 in its logical shape, on `device`."""
        encoding = weight.data.encoding or ""
        raw = checkpoint.load(weight.data)
        return decode_blocks(raw, encoding, weight.shape, device, name=weight.name)


def _weight(tensor: StoredTensor) -> Weight:
    shape = tuple(tensor.logical_shape or ())
    encoding = tensor.encoding or ""
    if encoding.startswith("unknown("):
        type_id = encoding[len("unknown(") : -1]
        scheme = QScheme(unknown_qtype(type_id), TENSOR, True, "F16", convention=NAME, extra=(("gguf_type_id", type_id),))
        note = (
            f"GGML type id {type_id} is unknown to qtool and to the installed gguf package: "
            f"its {tensor.nbytes} bytes are sized by where the next tensor starts, and it cannot be decoded"
        )
        return Weight(tensor.name, shape, tensor.dtype.name, {DATA: tensor}, scheme, NAME, [note])
    scheme, note = scheme_for_type(_type_of(encoding))
    # GGUF records no dtype the weights had before quantization, so `dtype` is the storage
    # dtype (DESIGN: "logical dtype where the file records it"); decoding gives float32.
    return Weight(tensor.name, shape, tensor.dtype.name, {DATA: tensor}, scheme, NAME, [note] if note else [])


def _type_of(encoding: str) -> GgmlType:
    """The GGML type the reader named: from qtool's table, else from the installed gguf package
    (which the reader consulted for an id qtool's table lacks)."""
    try:
        return ggml_type_named(encoding)
    except KeyError:
        pass
    try:
        from gguf.constants import GGMLQuantizationType

        found = ggml_type(GGMLQuantizationType[encoding].value)
    except (ImportError, KeyError):
        found = None
    if found is None:
        raise QtoolError(f"GGML type {encoding!r} is unknown to qtool and to the installed gguf package")
    return found


def decode_blocks(raw, encoding: str, shape: tuple[int, ...], device: str = "cpu", *, name: str = "tensor"):
    """Raw GGUF bytes of type `encoding` -> float32 of `shape` (PyTorch order) on `device`:
    torch's decoders (`qtool.kernels.gguf_blocks`) where there is one, else
    `gguf.quants.dequantize`. An unknown or undecodable type raises a `QtoolError`."""
    from qtool.kernels import gguf_blocks

    if encoding.startswith("unknown(") or not encoding:
        raise QtoolError(
            f"weight {name!r}: GGML type {encoding or '?'} is unknown to qtool and to the installed gguf package, so it cannot be decoded",
            hint="upgrade qtool and the gguf package; the other weights can still be read",
        )
    gtype = _type_of(encoding)
    numel = math.prod(shape)
    if raw.numel() != gtype.nbytes(numel):
        raise QtoolError(f"weight {name!r}: {raw.numel()} bytes do not hold {numel} {gtype.name} values")
    if gtype.name not in gguf_blocks.torch_decodable():
        return _decode_numpy(raw, gtype, shape, name).to(device)
    return gguf_blocks.decode(raw.to(device), gtype.name, gtype.block_size, gtype.type_size, shape)


def _decode_numpy(raw, gtype: GgmlType, shape: tuple[int, ...], name: str):
    import torch

    try:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        member = GGMLQuantizationType[gtype.name]
    except (ImportError, KeyError):
        member = None
    if member is not None:
        row_bytes = shape[-1] // gtype.block_size * gtype.type_size if shape else gtype.type_size
        data = raw.to("cpu").numpy().reshape(*shape[:-1], row_bytes)
        try:
            return torch.from_numpy(dequantize(data, member).reshape(shape))
        except NotImplementedError:
            pass
    raise QtoolError(
        f"weight {name!r}: qtool cannot decode GGUF {gtype.name} yet, nor can the installed gguf package",
        hint="inspect shows it; decoding it needs a newer qtool",
    )
