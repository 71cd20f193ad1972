"""Moving a weight's integer codes into another format as they are, or saying why that is not exact.

A quantized weight read from one toolchain (`IntCodes`, from a convention's `codes`) goes into
another toolchain's layout without being decoded and quantized again: the same codes, scales
and zero points, repacked. A move is *exact* when the target toolchain's own dequantization of
what is written equals the source's (`IntCodes.dequantized()`) bit for bit. Each function here
returns the target's tensors or bytes, or a one-line reason why the target cannot hold the
weight exactly. They are pure: nothing is read or written.

Grid mappings (the source side is in `qtool.weight_codes`):

    compressed-tensors pack-quantized int (0.20.1: `compressors/pack_quantized/base.py`
    `compress` / `decompress`, `quantization/lifecycle/forward_helpers.py` `_dequantize`):
        stored codes  q_ct = q - 2^(b-1), packed by `pack_int_codes` (u = q, LSB first)
        zero point    none when every zero is 2^(b-1) (sym), else zp_ct = z - 2^(b-1) packed along O
        scale         stored in the model's dtype, which the package casts `weight_scale` to
                      (`initialize_qparams`) and `_dequantize` computes `(q_ct - zp_ct) * scale`
                      in: float16 for a float16 GPTQ, AWQ or compressed-tensors source; float32
                      for GGUF, whose float16 d ggml widens to float32
        a float minimum (GGUF Q4_1) becomes zero point z = -m / d where that is an integer in
        0 .. 2^b - 1: then d*q + m (two float32 roundings, both exact) equals d*(q - z)
    GGUF Q4_0 / Q8_0 / Q4_1 (gguf-py `gguf/quants.py` `Q4_0.dequantize_blocks` ...; ggml
    `ggml-quants.c` `dequantize_row_q4_0` ...; blocks of 32 inputs, one float16 d each):
        Q4_0  nibble = q - z + 8, needs q - z in -8 .. 7       W = d * (nibble - 8)
        Q8_0  int8   = q - z,     needs q - z in -128 .. 127   W = d * int8
        Q4_1  nibble = q, m = -d*z (exactly a float16), or the source's own m; W = d*q + m
        d = the group's scale, which must be a float16 value; a group of 32k inputs repeats it
        over its k blocks

Where exactness can fail although the grid coincides: the arithmetic. GPTQ (AutoGPTQ's torch
path), AutoAWQ and compressed-tensors round `(q - z) * s` to float16 or bfloat16; ggml widens d
to float32, where the product is exact. The two agree only on products a float16 holds, so a
float16 GPTQ or compressed-tensors weight going to Q4_0 is usually *not* bit for bit the same,
although its codes and scales are, and so is a GGUF weight going into a float16
compressed-tensors model: `grid_only=True` accepts such a move (the report should
call it "same grid", not "exact"). compressed-tensors 0.20.1 reads no `weight_g_idx` (its
"group" activation ordering was removed), so a GPTQ desc_act g_idx that permutes inputs across
groups cannot move there; one that keeps each group's inputs together (a "grouped" g_idx, or a
trivial one) becomes plain groups with the scales reordered.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtool.ggml_types import GGML_TYPES, ggml_type_named
from qtool.qtypes import qtype
from qtool.scheme import CHANNEL, QScheme, group
from qtool.weight_codes import IntCodes

if TYPE_CHECKING:
    import torch

__all__ = ["in_column_groups", "to_compressed_tensors", "to_gguf", "ToCompressedTensors", "ToGguf"]

_FLOAT_NAMES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _FLOAT_NAMES.get(str(dtype).removeprefix("torch."), str(dtype))


def in_column_groups(codes: IntCodes) -> IntCodes | str:
    """The same weight with `g_idx` None: groups of consecutive inputs. A g_idx that is constant
    over runs of inputs (GPTQ desc_act whose permutation keeps each group together, or a
    trivial one) gives groups of the runs' common length, the scale, zero and minimum columns
    taken in run order; one that interleaves groups is refused, with the reason."""
    import torch

    if codes.g_idx is None:
        return codes
    g_idx = codes.g_idx.to(torch.int64)
    inputs = g_idx.numel()
    if not inputs:
        return dataclasses.replace(codes, g_idx=None)
    starts = (torch.nonzero(g_idx[1:] != g_idx[:-1]).flatten() + 1).tolist()
    size = math.gcd(inputs, *starts) if starts else inputs
    if size < min(codes.group, inputs):
        return (
            f"g_idx interleaves groups across inputs (desc_act); compressed-tensors 0.20.1 and GGUF "
            f"read no g_idx, and its runs are as short as {size} input(s)"
        )
    index = g_idx[::size]

    def columns(grid: torch.Tensor | None) -> torch.Tensor | None:
        return None if grid is None else grid.index_select(1, index.to(grid.device)).contiguous()

    return dataclasses.replace(
        codes,
        scale=columns(codes.scale),
        zero=columns(codes.zero),
        minimum=columns(codes.minimum),
        group=size,
        g_idx=None,
    )


def _integer_zero(codes: IntCodes) -> IntCodes | str:
    """A float-minimum grid (Q4_1: W = d*q + m) as an integer zero point z = -m/d, where every
    m is exactly -d*z for an integer z in the codes' range; else the reason."""
    import torch

    if codes.zero is not None or codes.minimum is None:
        return codes
    d, m = codes.scale.double(), codes.minimum.double()
    z = torch.where(d != 0, -m / torch.where(d != 0, d, 1), torch.zeros_like(d)).round()
    bad = ((-d * z) != m) | (z < 0) | (z >= 1 << codes.bits)
    if bool(bad.any()):
        o, g = (int(v) for v in torch.nonzero(bad)[0])
        return (
            f"its float minimum is not -scale x an integer zero point (row {o}, group {g}: "
            f"m = {float(m[o, g]):.9g}, d = {float(d[o, g]):.9g})"
        )
    return dataclasses.replace(codes, zero=z.to(torch.int32), minimum=None)


def _mismatch(expected: torch.Tensor, got: torch.Tensor, target: str, arithmetic: str) -> str | None:
    """None when the two float32 tensors have the same bits, else how many values differ."""
    import torch

    differ = expected.contiguous().view(torch.int32) != got.contiguous().view(torch.int32)
    count = int(differ.sum())
    if not count:
        return None
    o, i = (int(v) for v in torch.nonzero(differ)[0])
    return (
        f"{target} computes in {arithmetic}: {count} of {differ.numel()} values round differently "
        f"(first at [{o}, {i}]: {float(got[o, i]):.9g}, the source gives {float(expected[o, i]):.9g})"
    )


# -- compressed-tensors --------------------------------------------------------------------------


def to_compressed_tensors(
    codes: IntCodes, name: str, dtype: str, *, grid_only: bool = False, symmetric: bool | None = None
) -> tuple[QScheme, dict[str, torch.Tensor]] | str:
    """The pack-quantized tensors of `name` ("<module>.weight") holding these codes, and their
    scheme (for `qtool.layouts.compressed_tensors.config_for`), or the reason the move would
    not be exact. `dtype` ("F16", "BF16", "F32") is the model's dtype: compressed-tensors
    0.20.1 makes each module's `weight_scale` parameter in the weight's dtype
    (`quantization/lifecycle/initialize.py`, `initialize_qparams`), loading casts the stored
    scale to it, and `_dequantize` then computes `(q - zp) * scale` in it. So the scales are
    stored in `dtype`, must be exactly `dtype` values, and the products are formed in `dtype`:
    a GPTQ, AWQ or compressed-tensors float16 weight moves exactly into a float16 model, a GGUF
    weight (float32 arithmetic) into a float32 one. With `grid_only`, a move whose codes and
    scales are the same but whose products round differently is accepted. `symmetric`, where a
    plan fixed it: True refuses codes with any zero point off the midpoint, False stores zero
    points even where every one is the midpoint; None decides from the zero points."""
    import torch

    from qtool.dtypes import storage_dtype
    from qtool.layouts.compressed_tensors import pack_int_codes

    rows, cols = codes.shape
    if not 1 <= codes.bits <= 8:
        return f"{codes.bits}-bit codes: compressed-tensors packs 1 to 8 bits"
    if dtype.upper() not in _FLOAT_NAMES.values():
        return f"model dtype {dtype!r}: compressed-tensors computes in F16, BF16 or F32"
    compute = storage_dtype(dtype.upper()).torch_dtype()
    grid = in_column_groups(codes)
    if isinstance(grid, str):
        return grid
    grid = _integer_zero(grid)
    if isinstance(grid, str):
        return f"{grid}; compressed-tensors has only integer zero points"
    if grid.zero is None:
        return "no zero point and no minimum: not an integer grid"
    if cols % grid.group:
        return f"group {grid.group} does not divide {cols} inputs; compressed-tensors needs whole groups"
    high = (1 << codes.bits) - 1
    low_zero, high_zero = int(grid.zero.min()), int(grid.zero.max())
    if low_zero < 0 or high_zero > high:
        return (
            f"zero points reach {low_zero if low_zero < 0 else high_zero}, outside the {codes.bits}-bit "
            f"range 0..{high} that compressed-tensors stores"
        )
    scale = grid.scale.to(compute)
    lost = scale.to(grid.scale.dtype) != grid.scale
    if bool(lost.any()):
        o, g = (int(v) for v in torch.nonzero(lost)[0])
        return (
            f"scale {float(grid.scale[o, g]):.9g} (row {o}) is not a {_dtype_name(compute)} value, the model "
            f"dtype compressed-tensors casts weight_scale to"
        )
    offset = 1 << (codes.bits - 1)
    centred = bool((grid.zero == offset).all())
    if symmetric and not centred:
        return f"asymmetric codes (zero points off {offset}) planned as symmetric"
    symmetric = centred if symmetric is None else symmetric
    scheme = QScheme(
        qtype=qtype(f"int{codes.bits}"),
        block=CHANNEL if grid.group == cols else group(grid.group),
        symmetric=symmetric,
        scale_dtype=_dtype_name(compute),
        zero_point=not symmetric,
    )
    values = (grid.codes.to(torch.int16) - offset).to(torch.int8)
    zero_point = None if symmetric else (grid.zero - offset).to(torch.int8)
    if not grid_only:  # what compressed-tensors' `_dequantize` computes: x_q.to(s.dtype) - zp.to(s.dtype), * s
        target = values.to(compute)
        if zero_point is not None:
            target = target - grid.per_input(zero_point).to(compute)
        target = (target * grid.per_input(scale)).to(torch.float32)
        reason = _mismatch(codes.dequantized(), target, "compressed-tensors", _dtype_name(compute))
        if reason is not None:
            return f"same grid, but the source rounds products to {_dtype_name(codes.compute_dtype)} and {reason}"
    return scheme, pack_int_codes(name, values, scale, zero_point, scheme, dtype.upper())


# -- GGUF ----------------------------------------------------------------------------------------


def to_gguf(codes: IntCodes, gtype_name: str, *, grid_only: bool = False) -> bytes | str:
    """The GGUF blocks of type `gtype_name` (Q4_0, Q8_0 or Q4_1: `GgmlType.plain_grid`) holding
    these codes, rows in the codes' order (a llama q/k permutation is the caller's), or the
    reason they would not be exact. Exactness is checked on the data by decoding the bytes with
    qtool's GGUF decoder (bit for bit gguf-py's `dequantize`, tests/test_gguf.py). With
    `grid_only`, a move whose grid coincides but whose arithmetic differs (float16 products
    in the source, float32 in ggml) is accepted."""
    import torch

    from qtool.conventions.gguf import decode_blocks

    try:
        gtype = ggml_type_named(gtype_name)
    except KeyError:
        gtype = None
    plain = ", ".join(row.name for row in GGML_TYPES.values() if row.plain_grid)
    if gtype is None or not gtype.plain_grid or gtype.scheme is None:
        return f"{gtype_name} is not a GGUF type of plain integer codes ({plain} are)"
    rows, cols = codes.shape
    block = gtype.block_size
    grid = in_column_groups(codes)
    if isinstance(grid, str):
        return grid
    if cols % block:
        return f"{cols} inputs: {gtype.name} rows are whole blocks of {block}"
    if grid.group % block:
        return f"group {grid.group}, {gtype.name} blocks are {block} (one scale each): groups must be whole blocks"
    per_block = torch.arange(cols // block, device=grid.codes.device) * block // grid.group
    d = grid.scale.index_select(1, per_block)  # [O, blocks]
    d16 = d.to(torch.float16)
    unfit = ~torch.isfinite(d16) | (d16.to(d.dtype) != d)
    if bool(unfit.any()):
        o, b = (int(v) for v in torch.nonzero(unfit)[0])
        return f"scale {float(d[o, b]):.6g} (row {o}) is not a float16; {gtype.name} stores d as float16"
    bits, symmetric = gtype.scheme.bits, gtype.scheme.symmetric
    blocks = grid.codes.reshape(rows, -1, block)
    if symmetric:
        grid = _integer_zero(grid)
        if isinstance(grid, str):
            return f"{grid}; {gtype.name} has no minimum"
        offsets = grid.offsets()
        if offsets is None:
            return "no zero point and no minimum: not an integer grid"
        low, high = int(offsets.min()), int(offsets.max())
        limit = 1 << (bits - 1)
        if low < -limit or high >= limit:
            asymmetric = not bool((grid.zero == 1 << (grid.bits - 1)).all())
            kind = f"asymmetric codes: {gtype.name} has no zero point" if asymmetric else f"{grid.bits}-bit codes"
            return f"{kind} (codes minus zero points span {low}..{high}, {gtype.name} holds {-limit}..{limit - 1})"
        stored = offsets.reshape(rows, -1, block) + (limit if bits == 4 else 0)
        m16 = None
    else:
        if int(grid.codes.max()) >= 1 << bits:
            return f"{grid.bits}-bit codes reach {int(grid.codes.max())}; {gtype.name} holds 0..{(1 << bits) - 1}"
        if grid.minimum is not None:
            m = grid.minimum.index_select(1, per_block)
        elif grid.zero is not None:
            m = -(grid.scale.double() * grid.zero.double()).index_select(1, per_block)
        else:
            return "no zero point and no minimum: not an integer grid"
        m16 = m.to(torch.float16)
        unfit = ~torch.isfinite(m16) | (m16.double() != m.double())
        if bool(unfit.any()):
            o, b = (int(v) for v in torch.nonzero(unfit)[0])
            return f"minimum -scale x zero = {float(m[o, b]):.9g} (row {o}) is not a float16; {gtype.name} stores m as float16"
        stored = blocks
    fields = [d16.reshape(-1, 1).view(torch.uint8)]
    if m16 is not None:
        fields.append(m16.reshape(-1, 1).view(torch.uint8))
    stored = stored.reshape(-1, block)
    if bits == 8:
        fields.append(stored.to(torch.int8).view(torch.uint8))
    else:  # nibbles: byte j holds value j (low) and value j + block/2 (high)
        half = block // 2
        fields.append((stored[:, :half] | (stored[:, half:] << 4)).to(torch.uint8))
    raw = torch.cat(fields, dim=1).contiguous()
    if raw.shape[1] != gtype.type_size:
        from qtool.errors import InternalError

        raise InternalError(f"a {gtype.name} block of {raw.shape[1]} bytes, not {gtype.type_size}")
    if not grid_only:
        target = decode_blocks(raw.reshape(-1).cpu(), gtype.name, (rows, cols), name="moved")
        reason = _mismatch(codes.dequantized().cpu(), target, f"ggml's {gtype.name}", "float32")
        if reason is not None:
            source = _dtype_name(codes.compute_dtype)
            return f"same grid, but the source rounds products to {source} and {reason}"
    return raw.cpu().numpy().tobytes()


# -- what a plan declares ---------------------------------------------------------------------


@dataclass(frozen=True)
class ToCompressedTensors:
    """A plan's mover (`qtool.plan.Moved`) into compressed-tensors: a model of `model_dtype`,
    the weight's symmetry as planned (its tensors are sized by it)."""

    model_dtype: str
    symmetric: bool
    target: str = "compressed-tensors"

    def move(self, name: str, codes: IntCodes) -> tuple[QScheme, dict[str, torch.Tensor]] | str:
        return to_compressed_tensors(codes, name, self.model_dtype, symmetric=self.symmetric)


@dataclass(frozen=True)
class ToGguf:
    """A plan's mover into GGUF blocks of GGML type `target`; `grid_only` accepts a source whose
    products round to float16 where ggml forms them in float32 (the report measures how far)."""

    target: str
    grid_only: bool = False

    def move(self, name: str, codes: IntCodes) -> bytes | str:
        return to_gguf(codes, self.target, grid_only=self.grid_only)
