"""optimum-quanto (CONVENTIONS §6).

Verified against optimum-quanto 0.2.7 (`tensor/qtype.py`, `tensor/packed.py`,
`tensor/grouped.py`, `tensor/qbits.py`, `tensor/qbytes.py`, `tensor/weights/qbits.py`,
`nn/qmodule.py`), and proven bit for bit against quanto's own `dequantize()` by
tests/test_quanto.py on fixtures that `quantize` + `freeze` wrote. A frozen QModule `m` saves:

    qint8, qfloat8      m.weight._data        I8 | F8_E4M3 | F8_E5M2 | F8_E4M3FNUZ [O, I]
                        m.weight._scale       [O, 1] (per-axis 0), or [] (one row)
    qint2, qint4        m.weight._data._data  U8 [ceil(R / (8/b)), C], planar: byte r holds
                                              rows r, r + rd, r + 2rd, ... from bit 0 up
                                              (rd = the packed row count)
                        m.weight._scale       [R, 1]
                        m.weight._shift       [R, 1], the scale's dtype (float shift), or
                                              U8 (integer zero point, `zeropoint=True`)
    every QModule       m.input_scale, m.output_scale   0-dim, the weight's dtype

Grouping: for in_features I > 128 quanto picks the first of 128, 96, 64, 32 that divides I
and quantizes W.reshape(O*I/gs, gs) row by row (R = O*I/gs, C = gs); otherwise each of the
O rows is one group (R = O, C = I). Values are unsigned, 0 .. 2^b - 1:

    float shift   w = scale * q - shift        (two roundings, in the scale's dtype)
    int shift     w = scale * (q - shift)      (q - shift in int8)
    8-bit         w = scale * data             (qfloat8: data cast to the scale's dtype first)

qtool computes exactly these torch ops, in the scale's dtype, so it is bit-identical to quanto
in every dtype. Names alone identify the layout: the quantization map (`quanto_qmap.json` from
`QuantizedModel.save_pretrained`, or `quantization_map.json` as quanto's README saves it by
hand) is read when present, to name qint2/qint4 where a tiny R leaves the packing ambiguous and
to note disagreements, and is never required.

The logical shape of a grouped weight is not recorded anywhere: quanto rebuilds it from the
module. qtool lists the in_features that quanto's group rule allows for the stored [R, C];
a `m.bias` beside the weight (its length is O) settles the choice. When more than one shape
remains, the weight is shown as [R, C] with a note, and its parameter count is exact anyway.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from qtool.conventions.base import Pool, plain_weights, require_convention, side_file
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.untrusted_json import MapOf, Record, String
from qtool.qtypes import qtype
from qtool.scheme import CHANNEL, TENSOR, QScheme, group
from qtool.weight import DATA, Provenance, Weight

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = ["MAP_FILES", "Quanto", "decode", "group_size_for", "logical_shapes"]

NAME = "quanto"
MAP_FILES = ("quanto_qmap.json", "quantization_map.json")
_BYTES_TYPES = {"I8": "int8", "F8_E4M3": "fp8_e4m3", "F8_E5M2": "fp8_e5m2", "F8_E4M3FNUZ": "fp8_e4m3fnuz"}
_QUANTO_NAMES = {
    "int8": "qint8",
    "fp8_e4m3": "qfloat8_e4m3fn",
    "fp8_e5m2": "qfloat8_e5m2",
    "fp8_e4m3fnuz": "qfloat8_e4m3fnuz",
}
_FLOAT_SCALES = ("F16", "BF16", "F32")
_PACKED, _BYTES = "._data._data", "._data"


class _Unfit(ValueError):
    pass


def group_size_for(in_features: int) -> int | None:
    """quanto's QModuleMixin: for in_features > 128, the first of 128, 96, 64, 32 dividing it;
    otherwise (and when none divides) None, one group per output row."""
    if in_features <= 128:
        return None
    return next((size for size in (128, 96, 64, 32) if in_features % size == 0), None)


def logical_shapes(rows: int, columns: int) -> list[tuple[int, int]]:
    """Every [O, I] that quanto stores as `rows` x `columns` groups, per its group rule."""
    shapes = []
    if group_size_for(columns) is None:
        shapes.append((rows, columns))  # one group per row: nothing was reshaped
    if columns not in (128, 96, 64, 32):
        return shapes
    factors = {f for d in range(1, math.isqrt(rows) + 1) if rows % d == 0 for f in (d, rows // d)}
    for factor in sorted(factors - {1}):  # in_features = columns * factor, out = rows / factor
        if group_size_for(columns * factor) == columns:
            shapes.append((rows // factor, columns * factor))
    return shapes


# quanto's map: module name -> {"weights": "qint4", "activations": "none"}. A wrong JSON type
# is refused (exit 2) naming the file; quanto's requantize() could not load it either.
_MAP = MapOf(Record({"weights": String(max_chars=64), "activations": String(max_chars=64)}))


def _quantization_map(checkpoint: Checkpoint) -> tuple[dict[str, Any], str | None]:
    for name in MAP_FILES:
        value = checkpoint.side_files.get(name)
        if value is not None:
            return _MAP.check(
                value, "", side_file(checkpoint, name), "quanto could not load this map either; fix or remove it"
            ), name
    return {}, None


class Quanto:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        qmap, map_name = _quantization_map(checkpoint)
        weights: list[Weight] = []
        taken: set[str] = set()
        for name in pool:
            if name in taken:
                continue
            if name.endswith(_PACKED):
                base, packed = name[: -len(_PACKED)], True
            elif name.endswith(_BYTES) and name[: -len(_BYTES)] + "._scale" in pool:
                base, packed = name[: -len(_BYTES)], False
            else:
                continue
            module = base.rpartition(".")[0]
            members = {DATA: pool[name]}
            for role, key in (("scale", base + "._scale"), ("shift", base + "._shift"),
                              ("input_scale", module + ".input_scale"), ("output_scale", module + ".output_scale")):  # fmt: skip
                if key in pool and key not in taken:
                    members[role] = pool[key]
            taken.update(member.name for member in members.values())
            entry = qmap.get(module) if module else None
            said = entry.get("weights") if isinstance(entry, dict) else None
            try:
                if packed:
                    weight = _resolve_packed(checkpoint, base, members, said, map_name)
                else:
                    weight = _resolve_bytes(base, members, said, map_name)
            except _Unfit as exc:
                weights.extend(plain_weights(members, f"looks like an optimum-quanto weight, but {exc}; left plain"))
                continue
            weights.append(weight)
        return weights

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)


def _check_scale(members: dict[str, StoredTensor], rows: int, ndim: int) -> StoredTensor:
    scale = members.get("scale")
    if scale is None:
        raise _Unfit(f"{members[DATA].name} has no _scale")
    if scale.dtype.name not in _FLOAT_SCALES:
        raise _Unfit(f"_scale is {scale.dtype.name}, expected F16, BF16 or F32")
    if math.prod(scale.shape) != rows or (
        scale.shape and (scale.shape[0] != rows or len(scale.shape) not in (1, ndim))
    ):
        raise _Unfit(f"_scale {list(scale.shape)} does not fit {rows} rows")
    return scale


def _disagreement(said: str | None, shown: str, map_name: str | None) -> list[str]:
    if said is None or said == shown:
        return []
    return [f"{map_name} says {said}, the tensors show {shown}; read as the tensors show"]


def _resolve_bytes(base: str, members: dict[str, StoredTensor], said: str | None, map_name: str | None) -> Weight:
    if "shift" in members:
        raise _Unfit("an 8-bit _data has a _shift")
    data = members[DATA]
    value_type = _BYTES_TYPES.get(data.dtype.name)
    if value_type is None or not data.shape:
        raise _Unfit(f"_data is {data.dtype.name} {list(data.shape)}, expected I8 or F8 [out, ...]")
    scale = members["scale"]
    if math.prod(scale.shape) == 1 and data.shape[0] != 1:
        block = TENSOR
    else:
        _check_scale(members, data.shape[0], len(data.shape))
        block = CHANNEL if len(data.shape) == 2 else (1,) + (None,) * (len(data.shape) - 1)
    if scale.dtype.name not in _FLOAT_SCALES:
        raise _Unfit(f"_scale is {scale.dtype.name}, expected F16, BF16 or F32")
    shown = _QUANTO_NAMES[value_type]
    scheme = QScheme(
        qtype=qtype(value_type),
        block=block,
        symmetric=True,
        scale_dtype=scale.dtype.name,
    )
    provenance = Provenance(NAME, details=(("quanto_qtype", shown),))
    return Weight(base, data.shape, scale.dtype.name, members, scheme, provenance, _disagreement(said, shown, map_name))


def _bits(stored_rows: int, rows: int, said: str | None) -> int:
    fits = [bits for bits in (4, 2) if math.ceil(rows / (8 // bits)) == stored_rows]
    if not fits:
        raise _Unfit(f"{stored_rows} packed rows hold {rows} rows at neither 2 nor 4 bits")
    if len(fits) == 2:
        hinted = {"qint4": 4, "qint2": 2}.get(str(said))
        if hinted is None:
            raise _Unfit(
                f"{rows} rows pack into {stored_rows} bytes at 2 and at 4 bits, and no quantization map says which"
            )
        return hinted
    return fits[0]


def _resolve_packed(
    checkpoint: Checkpoint, base: str, members: dict[str, StoredTensor], said: str | None, map_name: str | None
) -> Weight:
    data, shift = members[DATA], members.get("shift")
    if data.dtype.name != "U8" or len(data.shape) < 2:
        raise _Unfit(f"_data._data is {data.dtype.name} {list(data.shape)}, expected U8 [rows, columns]")
    scale = members.get("scale")
    if scale is None or shift is None:
        raise _Unfit(f"{base} needs both _scale and _shift")
    rows = math.prod(scale.shape)
    _check_scale(members, rows, len(data.shape))
    if shift.shape != scale.shape or not (shift.dtype == scale.dtype or shift.dtype.name in ("U8", "I8")):
        raise _Unfit(
            f"_shift {shift.dtype.name} {list(shift.shape)} does not match _scale {scale.dtype.name} {list(scale.shape)}"
        )
    bits = _bits(data.shape[0], rows, said)
    notes = _disagreement(said, f"qint{bits}", map_name)
    columns = data.shape[1]
    if len(data.shape) > 2:  # a conv weight, one group per output channel: nothing was reshaped
        shape: tuple[int, ...] = (rows, *data.shape[1:])
        block = (1,) + (None,) * (len(shape) - 1)
    else:
        shape, block = _shape_2d(checkpoint, base, rows, columns, notes)
    float_shift = shift.dtype.is_float
    scheme = QScheme(
        qtype=qtype(f"uint{bits}"),
        block=block,
        symmetric=False,
        scale_dtype=scale.dtype.name,
        zero_point=True,
    )
    provenance = Provenance(
        NAME,
        f"uint8, {8 // bits} rows per byte, planar along dim 0 of the grouped weight (low bits = first rows)",
        (
            ("quanto_qtype", f"qint{bits}"),
            ("shift", "float, w = scale * q - shift" if float_shift else "integer zero point, w = scale * (q - shift)"),
        ),
    )
    return Weight(base, shape, scale.dtype.name, members, scheme, provenance, notes)


def _shape_2d(
    checkpoint: Checkpoint, base: str, rows: int, columns: int, notes: list[str]
) -> tuple[tuple[int, int], Any]:
    """The [O, I] of a stored [rows, columns] grouped weight, and its block."""
    candidates = logical_shapes(rows, columns)
    bias = checkpoint.tensors.get(base.rpartition(".")[0] + ".bias") if base.endswith(".weight") else None
    if bias is not None and len(bias.shape) == 1:
        fitting = [s for s in candidates if s[0] == bias.shape[0]]
        if not fitting and bias.shape[0] and (rows * columns) % bias.shape[0] == 0:
            in_features = rows * columns // bias.shape[0]
            if in_features % columns == 0:  # not quanto's own rule: a custom group size
                fitting = [(bias.shape[0], in_features)]
                notes.append(
                    f"groups of {columns} over in_features {in_features} do not follow quanto 0.2.7's group rule"
                )
        candidates = fitting or candidates
    if not candidates:
        notes.append(f"[{rows}, {columns}] fits no in_features under quanto's group rule; shown as stored")
        return (rows, columns), group(columns)
    if len(candidates) > 1:
        others = ", ".join(str(list(s)) for s in candidates if s != (rows, columns))
        notes.append(
            f"quanto records no shape: shown as its {rows} groups of {columns}; "
            f"[out, in] may also be {others} (a .bias beside it would tell)"
        )
        return (rows, columns), group(columns)
    shape = candidates[0]
    return shape, (CHANNEL if shape[1] == columns else group(columns))


def _unpack_planar(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """uint8 [rows, ...] from quanto's planar packing: slot i of byte r is row i*len(packed) + r."""
    import torch

    mask = (1 << bits) - 1
    slots = [(packed >> (bits * slot)) & mask for slot in range(8 // bits)]
    return torch.cat(slots, dim=0)[:rows]


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float weight in its logical shape, in the scale's dtype, as quanto's `dequantize()`."""
    import torch

    scheme = weight.require_scheme()
    require_convention(weight, NAME)
    data = checkpoint.load(weight.data).to(device)
    scale = checkpoint.load(weight.members["scale"]).to(device)
    if "shift" not in weight.members:  # qint8 / qfloat8: one multiply in the scale's dtype
        if scale.dim() and scale.dim() < data.dim():
            scale = scale.reshape(scale.shape[0], *([1] * (data.dim() - 1)))
        return (scale * data.to(scale.dtype)).reshape(weight.shape)
    shift = checkpoint.load(weight.members["shift"]).to(device)
    rows = math.prod(scale.shape)
    codes = _unpack_planar(data, scheme.bits, rows)  # [rows, columns, ...] uint8
    scale = scale.reshape(rows, *([1] * (codes.dim() - 1)))
    shift = shift.reshape(rows, *([1] * (codes.dim() - 1)))
    if shift.dtype.is_floating_point:
        out = scale * codes.to(scale.dtype)  # rounded to the scale dtype,
        out = out - shift  # then again, as quanto does
    else:
        out = scale * (codes.to(torch.int8) - shift.to(torch.int8))
    return out.reshape(weight.shape)
