"""GGUF block types (CONVENTIONS §10): each block-quantized tensor is one quantized weight.

`qtool.formats.gguf` stores a block-quantized tensor as raw bytes with `encoding` = the GGML
type name and `logical_shape` in PyTorch order. Here each becomes a `Weight` whose scheme is
its type's row in `qtool.ggml_types` (value type, block along the row, scale dtype, and the
rule: llama.cpp's own quantizer), and whose provenance details are the type's name and what
its block holds besides (sub-block scales, codebooks). Plain GGUF types (F32, F16, BF16,
I8..I64, F64) are ordinary stored tensors: the plain convention takes them.

Decoding: `qtool.kernels.gguf_blocks` (torch, any device; its docstring lays out each block)
for the types it lists, bit for bit `gguf.quants.dequantize`, and `qtool.native` on the CPU for
the common ones; every other type the `gguf` package can dequantize goes through it (numpy).
"""

from __future__ import annotations

import math

from qtool.conventions.base import Pool, require_convention
from qtool.errors import QtoolError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.ggml_types import GGML_TYPES, GgmlType, ggml_type, ggml_type_named
from qtool.qtypes import unknown_qtype
from qtool.scheme import TENSOR, QScheme, group
from qtool.weight import DATA, Provenance, Weight
from qtool.weight_codes import IntCodes

__all__ = ["Gguf", "NAME", "codes", "scheme_for_type", "decode_blocks"]

NAME = "gguf"


def scheme_for_type(gtype: GgmlType) -> tuple[QScheme, Provenance, str | None]:
    """The scheme of a GGML block type, the provenance of a weight stored in it, and a note when
    qtool knows only its size."""
    provenance = Provenance(NAME, details=(("gguf_type", gtype.name), *gtype.details))
    if gtype.scheme is not None:
        return gtype.scheme, provenance, None
    scheme = QScheme(unknown_qtype(gtype.name), group(gtype.block_size), True, "F16", rule=gtype.name)
    return (
        scheme,
        provenance,
        f"GGUF type {gtype.name} (id {gtype.id}): qtool knows its block size ({gtype.block_size} in {gtype.type_size} bytes) but not its layout",
    )


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
        require_convention(weight, NAME)
        encoding = weight.data.encoding or ""
        raw = checkpoint.load(weight.data)
        return decode_blocks(raw, encoding, weight.shape, device, name=weight.name)

    def codes(self, checkpoint: Checkpoint, weight: Weight, device: str = "cpu") -> IntCodes:
        return codes(checkpoint, weight, device)


def _weight(tensor: StoredTensor) -> Weight:
    shape = tuple(tensor.logical_shape or ())
    encoding = tensor.encoding or ""
    if encoding.startswith("unknown("):
        type_id = encoding[len("unknown(") : -1]
        scheme = QScheme(unknown_qtype(type_id), TENSOR, True, "F16")
        provenance = Provenance(NAME, details=(("gguf_type_id", type_id),))
        note = (
            f"GGML type id {type_id} is unknown to qtool and to the installed gguf package: "
            f"its {tensor.nbytes} bytes are sized by where the next tensor starts, and it cannot be decoded"
        )
        return Weight(tensor.name, shape, tensor.dtype.name, {DATA: tensor}, scheme, provenance, [note])
    scheme, provenance, note = scheme_for_type(_type_of(encoding))
    # GGUF records no dtype the weights had before quantization, so `dtype` is the storage
    # dtype (DESIGN: "logical dtype where the file records it"); decoding gives float32.
    return Weight(tensor.name, shape, tensor.dtype.name, {DATA: tensor}, scheme, provenance, [note] if note else [])


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
    if gtype.torch_decoder is None:
        return _decode_numpy(raw, gtype, shape, name).to(device)
    return gguf_blocks.decode(raw.to(device), gtype.torch_decoder, gtype.block_size, gtype.type_size, shape)


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


def codes(checkpoint: Checkpoint, weight: Weight, device: str = "cpu") -> IntCodes:
    """A plain-grid weight's codes as stored (`GgmlType.plain_grid`: Q4_0, Q4_1, Q8_0), one
    group per 32-value block, in the FILE's row order: a GGUF of the llama architecture stores
    attn_q / attn_k rows permuted for its rotary layout, and these codes keep that order (the
    caller undoes it). Grid mapping, as gguf-py (`gguf/quants.py`, `Q4_0` / `Q4_1` / `Q8_0`
    `dequantize_blocks`) and ggml (`ggml-quants.c`, `dequantize_row_q4_0` ...) compute it, in
    float32 after widening the float16 d and m:

        Q4_0  codes = nibble (low j, high j+16)   zero = 8     W = d * (q - 8)
        Q8_0  codes = int8 q + 128                zero = 128   W = d * q
        Q4_1  codes = nibble                      minimum = m  W = d * q + m (two roundings)

    A symmetric type's zero is 2^(b-1) (its scheme's qtype is signed); an asymmetric one has a
    float minimum instead. Other types, and tensors that are not 2-D, raise a UsageError."""
    import torch

    from qtool.errors import UsageError
    from qtool.kernels import gguf_blocks

    require_convention(weight, NAME)
    encoding = weight.data.encoding or ""
    gtype = _type_of(encoding) if encoding and not encoding.startswith("unknown(") else None
    if gtype is None or not gtype.plain_grid or gtype.scheme is None or len(weight.shape) != 2:
        plain = ", ".join(row.name for row in GGML_TYPES.values() if row.plain_grid)
        raise UsageError(
            f"weight {weight.name!r}: integer codes are read from 2-D {plain} tensors, "
            f"not a {len(weight.shape)}-D {encoding or 'plain'} one"
        )
    rows, cols = weight.shape
    raw = checkpoint.load(weight.data).to(device)
    if raw.numel() != gtype.nbytes(rows * cols) or cols % gtype.block_size:
        raise QtoolError(f"weight {weight.name!r}: {raw.numel()} bytes do not hold {rows}x{cols} {gtype.name} values")
    scheme = gtype.scheme
    symmetric = scheme.symmetric
    values, d, m = gguf_blocks.block_codes(raw, gtype.type_size, scheme.bits, minimum=not symmetric)
    groups = cols // gtype.block_size
    zero = torch.full((rows, groups), 1 << (scheme.bits - 1), dtype=torch.int32, device=raw.device)
    return IntCodes(
        codes=values.reshape(rows, cols),
        scale=d.reshape(rows, groups),
        zero=zero if symmetric else None,
        minimum=None if m is None else m.reshape(rows, groups),
        bits=scheme.bits,
        group=gtype.block_size,
        arithmetic=torch.float32,
    )
