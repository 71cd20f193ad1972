"""torchao's tensor subclasses, in its prototype safetensors layout and in `.pt` pickles (CONVENTIONS §7).

Safetensors (pytorch/ao `torchao/prototype/safetensors/safetensors_support.py`, torchao 0.18):

    {module}._{param}_{data_name}    one tensor per entry of `_tensor_data_names`
    __metadata__["tensor_names"]     JSON list of the original names ("0.weight", "0.bias")
    __metadata__[name]               JSON {"_type": "Int8Tensor", "_data": {block_size, dtype, ...},
                                           "_tensor_data_names": ["qdata", "scale", ...]}

Pickles: `qtool.formats.torch_pickle` reads each subclass's pickled state, without torch, into
`{name}.{data_name}` stored tensors plus a `Subclass` record holding its other attributes
(`block_size`, `target_dtype`, ...: what `__tensor_flatten__`'s context holds). Which torchao
classes a pickle may name is a table, `qtool.formats.torchao_classes` (every type in SUPPORTED
among its tensor subclasses): the reader decides from it while unpickling, below this layer,
and never imports torchao.

    type                       qdata                     scale / zero_point               x =
    Int8Tensor                 int8 [*shape]             grid of block_size; zp int8 0s   (q - zp) * scale
    Float8Tensor               float8 [*shape]           grid of block_size               q * scale
    IntxUnpackedToInt8Tensor   int8 [*shape], one        grid of block_size, zp int       (q - zp) * scale
                               intN value a byte
    Int4Tensor                 int8 [..., N, K/2]: two   [..., K/g, N] (transposed), zp   q * scale + zp
                               int4, even k low nibble   a float offset (mslk/fbgemm)

The grid of block_size is ceil(shape / block_size) per dim (torchao's `quant_primitives`). The
first three decode as torchao's `dequantize()` does, which computes `(q - zp)` exactly and one
product; qtool's float32 product cast once to the logical dtype gives the same bits (tested
against torchao). Int4Tensor has no CPU dequantize in torchao; its formula is mslk's
`int4_row_quantize_zp` read backwards: q in [-8, 7], `zeros = min + 8 * scale`.

A torchao type qtool doesn't decode (MXTensor, NVFP4Tensor, the CUDA-packed int4 layouts)
stays plain, with a note naming it. So does a record whose fields have the wrong JSON type
(`"_tensor_data_names": 5`), or whose scale or zero point is stored in a dtype no kernel reads
(F6, F4). "tensor_names" and a tensor's name are ordinary words another exporter may use for
plain text: a value that is not JSON, or breaks qtool.formats.untrusted_json's limits, is not
torchao's and is ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.conventions.base import (
    Pool,
    metadata_json,
    plain_weights,
    require_convention,
    unusable_scale,
    unusable_zero_point,
)
from qtool.dtypes import WEIGHT_FLOATS, decoded_dtype, float_dtype_named
from qtool.errors import CheckpointError, JsonTypeError
from qtool.formats.checkpoint import SMALL_TENSOR_LIMIT, Checkpoint, StoredTensor
from qtool.formats.untrusted_json import Anything, Integer, ListOf, Record, String
from qtool.qtypes import qtype
from qtool.scheme import QScheme
from qtool.weight import DATA, Provenance, Weight

if TYPE_CHECKING:
    import torch

__all__ = ["Torchao", "NAME", "SUPPORTED", "decode"]

NAME = "torchao"
SUPPORTED = ("Int8Tensor", "Float8Tensor", "IntxUnpackedToInt8Tensor", "Int4Tensor")
_ROLES = {"qdata": DATA, "scale": "scale", "zero_point": "zero_point"}
_FLOAT8 = {"F8_E4M3": "fp8_e4m3", "F8_E5M2": "fp8_e5m2", "F8_E4M3FNUZ": "fp8_e4m3fnuz", "F8_E5M2FNUZ": "fp8_e5m2fnuz"}
_TARGET = re.compile(r"(u?)int([1-8])")  # IntxUnpackedToInt8Tensor's target_dtype, "torch." removed

# One tensor's record, and the `_data` attributes qtool reads (after `_unwrap`).
_RECORD = Record({"_type": String(), "_tensor_data_names": ListOf(String()), "_data": Anything()})
_ATTRIBUTES = Record(
    {"shape": ListOf(Integer(min=0)), "block_size": ListOf(Integer(min=1)), "dtype": String(), "target_dtype": String()}
)


@dataclass(frozen=True)
class _Entry:
    """One subclass weight, from either container: its type, logical shape and dtype, its
    `_data` attributes, and its stored tensors by torchao's data name."""

    name: str
    type_name: str
    shape: tuple[int, ...] | None
    dtype: str | None
    attributes: dict[str, Any]
    members: dict[str, StoredTensor]
    problem: str | None = None  # a record qtool can't read (a field of the wrong type): left plain


class Torchao:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        entries = (
            _pickle_entries(checkpoint, pool)
            if checkpoint.format == "torch"
            else _safetensors_entries(checkpoint, pool)
        )
        return [weight for entry in entries for weight in _weights(checkpoint, entry)]

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)


# -- finding entries -----------------------------------------------------------------------------


def _pickle_entries(checkpoint: Checkpoint, pool: Pool) -> list[_Entry]:
    entries = []
    for name, sub in getattr(checkpoint, "subclasses", {}).items():
        if sub.type_name.split(".")[0] != "torchao":
            continue
        members = {inner: pool[stored] for inner, stored in sub.members.items() if stored in pool}
        try:
            attributes = _ATTRIBUTES.check(dict(sub.attributes), f"{name} attributes", checkpoint.path)
        except JsonTypeError as exc:
            entries.append(_Entry(name, sub.short_name, None, None, {}, members, problem=exc.message))
            continue
        entries.append(_Entry(name, sub.short_name, sub.shape, sub.dtype, attributes, members))
    return entries


def _torchao_json(checkpoint: Checkpoint, key: str) -> Any:
    """The JSON of metadata `key`, or None where it is not JSON within qtool's limits: not torchao's."""
    try:
        return metadata_json(checkpoint, key)
    except CheckpointError:
        return None


def _safetensors_entries(checkpoint: Checkpoint, pool: Pool) -> list[_Entry]:
    names = _torchao_json(checkpoint, "tensor_names")
    if not isinstance(names, list):
        return []
    entries = []
    for name in names:
        if not isinstance(name, str) or "." not in name:
            continue
        info = _torchao_json(checkpoint, name)
        if not isinstance(info, dict) or info.get("_type") in (None, "Tensor", "torch.Tensor"):
            continue
        module, _, param = name.rpartition(".")
        prefix = f"{module}._{param}_"
        found = {k[len(prefix) :]: tensor for k, tensor in pool.items() if k.startswith(prefix)}
        where = f'__metadata__["{name}"]'
        try:
            record = _RECORD.check(info, where, checkpoint.path)
            attributes = _unwrap(record.get("_data") or {})
            attributes = (
                _ATTRIBUTES.check(attributes, f"{where}._data", checkpoint.path) if isinstance(attributes, dict) else {}
            )
        except JsonTypeError as exc:
            if found:
                entries.append(_Entry(name, str(info.get("_type")), None, None, {}, found, problem=exc.message))
            continue
        data_names = record.get("_tensor_data_names") or list(found)
        members = {d: pool[prefix + d] for d in data_names if prefix + d in pool}
        if not members:
            continue
        shape = attributes.get("shape")
        entries.append(
            _Entry(
                name,
                record["_type"],
                tuple(shape) if shape is not None else None,
                attributes.get("dtype"),
                attributes,
                members,
            )
        )
    return entries


def _unwrap(value: Any) -> Any:
    """torchao's JSON encoding as plain values: {"_type": "torch.dtype", "_data": "int4"} -> "int4",
    enums -> member name."""
    if isinstance(value, dict):
        if set(value) >= {"_type", "_data"} and not isinstance(value["_data"], (dict, list)):
            return value["_data"]
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    return value


# -- building weights ----------------------------------------------------------------------------


def _weights(checkpoint: Checkpoint, entry: _Entry) -> list[Weight]:
    members = {_ROLES.get(k, k): v for k, v in entry.members.items()}
    if entry.problem:
        return plain_weights(entry.members, f"torchao record {entry.name}: {entry.problem}; left plain")
    if entry.type_name not in SUPPORTED:
        return plain_weights(
            entry.members,
            f"torchao {entry.type_name} ({entry.name}): qtool does not decode this layout yet; left plain",
        )
    if DATA not in members or "scale" not in members:
        return plain_weights(
            entry.members, f"torchao {entry.type_name} {entry.name} lacks its qdata or scale; left plain"
        )
    problem = unusable_scale(members["scale"], "scale") or (
        unusable_zero_point(members["zero_point"], "zero_point") if "zero_point" in members else None
    )
    if problem:
        return plain_weights(entry.members, f"looks like a torchao {entry.type_name}, but {problem}; left plain")
    try:
        (scheme, provenance), shape, notes = _scheme(checkpoint, entry, members)
    except _Misfit as misfit:
        return plain_weights(entry.members, f"looks like a torchao {entry.type_name}, but {misfit}; left plain")
    dtype = float_dtype_named(str(entry.dtype or ""))
    if dtype is None:  # Int4Tensor records no dtype: it is its scale's (torchao's own rule)
        scale_dtype = members["scale"].dtype.name
        dtype = scale_dtype if scale_dtype in WEIGHT_FLOATS else "F32"
    return [Weight(entry.name, shape, dtype, members, scheme, provenance, notes)]


class _Misfit(ValueError):
    pass


def _scheme(
    checkpoint: Checkpoint, entry: _Entry, members: dict[str, StoredTensor]
) -> tuple[tuple[QScheme, Provenance], tuple[int, ...], list[str]]:
    data, scale = members[DATA], members["scale"]
    zero = members.get("zero_point")
    kind = entry.type_name
    notes: list[str] = []
    if kind == "Int4Tensor":
        shape = tuple(entry.shape or (*data.shape[:-1], data.shape[-1] * 2))
        if data.dtype.name not in ("I8", "U8") or tuple(data.shape) != (*shape[:-1], math.ceil(shape[-1] / 2)):
            raise _Misfit(
                f"qdata {data.dtype.name} {list(data.shape)} does not hold {list(shape)} int4 values two a byte"
            )
        groups = scale.shape[-2] if len(scale.shape) >= 2 else 0
        if tuple(scale.shape) != (*shape[:-2], groups, shape[-2]) or not groups:
            raise _Misfit(f"scale {list(scale.shape)} is not [..., K/group, N] for {list(shape)}")
        group = _given_block(entry, shape)[-1] if entry.attributes.get("block_size") else math.ceil(shape[-1] / groups)
        if math.ceil(shape[-1] / group) != groups:
            notes.append(
                f"block_size says groups of {group}, the scale has {groups} groups along {shape[-1]}: read as the scale shows"
            )
            group = math.ceil(shape[-1] / groups)
        block: tuple[int | None, ...] = (1, group)
        return (
            _make(
                qtype("int4"),
                block,
                False,
                scale,
                zero is not None,
                "int8 [.., N, K/2], even k in the low nibble",
                kind,
            ),
            shape,
            notes,
        )
    shape = tuple(data.shape)
    if entry.shape and tuple(entry.shape) != shape:
        raise _Misfit(f"qdata {list(shape)} differs from the recorded shape {list(entry.shape)}")
    block, note = _block_from_grid(entry, shape, scale)
    if note:
        notes.append(note)
    if zero is not None and math.prod(zero.shape) != math.prod(scale.shape):
        raise _Misfit(f"zero_point {list(zero.shape)} does not match scale {list(scale.shape)}")
    if kind == "Float8Tensor":
        if data.dtype.name not in _FLOAT8:
            raise _Misfit(f"qdata is {data.dtype.name}, not float8")
        return _make(qtype(_FLOAT8[data.dtype.name]), block, True, scale, False, None, kind), shape, notes
    if data.dtype.name != "I8":
        raise _Misfit(f"qdata is {data.dtype.name}, not int8")
    if kind == "Int8Tensor":
        # torchao's Int8Tensor is symmetric; it stores an all-zero int8 zero point anyway
        return _make(qtype("int8"), block, True, scale, zero is not None, None, kind), shape, notes
    target = str(entry.attributes.get("target_dtype") or "int8").removeprefix("torch.")
    parts = _TARGET.fullmatch(target)
    if parts is None:
        raise _Misfit(f"target_dtype {target[:40]!r} is not int1..int8 or uint1..uint8")
    value = qtype(f"{parts[1]}int{parts[2]}")
    symmetric = zero is None or _all_zero(checkpoint, zero, notes)
    return (
        _make(value, block, symmetric, scale, zero is not None, f"{target} values unpacked, one an int8", kind),
        shape,
        notes,
    )


def _all_zero(checkpoint: Checkpoint, zero: StoredTensor, notes: list[str]) -> bool:
    """Whether every zero point is 0: IntxUnpackedToInt8Tensor stores one even under a symmetric
    config (MappingType.SYMMETRIC), so its values, not its presence, say which grid it is.
    A zero point too large to read at inspect is labelled asymmetric, with a note."""
    if zero.nbytes > SMALL_TENSOR_LIMIT:
        notes.append(
            f"zero_point is {zero.nbytes} bytes, too large to read at inspect: labelled asym (zero points are applied either way)"
        )
        return False
    return not any(bytes(checkpoint.read_bytes(zero)))


def _make(
    value, block, symmetric: bool, scale: StoredTensor, zero_point: bool, packing: str | None, kind: str
) -> tuple[QScheme, Provenance]:
    scheme = QScheme(qtype=value, block=block, symmetric=symmetric, scale_dtype=scale.dtype.name, zero_point=zero_point)
    return scheme, Provenance(NAME, packing, (("torchao_type", kind),))


def _given_block(entry: _Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    given = entry.attributes.get("block_size")
    if not isinstance(given, list) or not all(isinstance(b, int) and b > 0 for b in given):
        return tuple(shape)
    given = [1] * (len(shape) - len(given)) + list(given)[-len(shape) :] if shape else []
    return tuple(given)


def _block_from_grid(
    entry: _Entry, shape: tuple[int, ...], scale: StoredTensor
) -> tuple[tuple[int | None, ...], str | None]:
    """The block shape: torchao's block_size where the scale's grid fits it, else what the scale
    shows (each dim is whole, per element, or divided), with a note naming the disagreement."""
    given = _given_block(entry, shape)
    grid = tuple(math.ceil(d / b) for d, b in zip(shape, given))
    count = math.prod(scale.shape)
    if count == math.prod(grid) and _fits(scale.shape, grid):
        return _as_block(given, shape), None
    inferred = _infer(shape, tuple(scale.shape))
    if inferred is None:
        raise _Misfit(f"scale {list(scale.shape)} fits neither block_size {list(given)} nor the {list(shape)} shape")
    note = (
        f"block_size says {list(given)}, the scale {list(scale.shape)} shows {list(inferred)}: read as the scale shows"
    )
    return _as_block(inferred, shape), note


def _fits(scale_shape: tuple[int, ...], grid: tuple[int, ...]) -> bool:
    trimmed = tuple(d for d in scale_shape if d != 1)
    return trimmed == tuple(d for d in grid if d != 1)


def _infer(shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    if math.prod(scale_shape) == 1:
        return shape
    padded = (1,) * (len(shape) - len(scale_shape)) + scale_shape if len(scale_shape) <= len(shape) else None
    if padded is None:
        return None
    block = []
    for dim, count in zip(shape, padded):
        if count < 1 or dim % count:
            return None
        block.append(dim // count)
    return tuple(block)


def _as_block(block: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int | None, ...]:
    """torchao's concrete block_size as a qtool block: a dim the block spans whole is None."""
    out = tuple(None if b >= d else b for b, d in zip(block, shape))
    if all(b is None for b in out):
        return (None,) * max(len(shape), 1)
    return out


# -- decoding ------------------------------------------------------------------------------------


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float weight in its logical dtype, on `device`."""

    from qtool import kernels

    scheme = weight.require_scheme()
    require_convention(weight, NAME)
    dtype = decoded_dtype(weight.dtype)
    kind = weight.provenance.detail("torchao_type")
    data = checkpoint.load(weight.data).to(device)
    scale = checkpoint.load(weight.members["scale"]).to(device)
    zero = weight.members.get("zero_point")
    zero_point = checkpoint.load(zero).to(device) if zero is not None else None
    if kind == "Int4Tensor":
        return _int4(data, scale, zero_point, weight.shape, dtype)
    block = scheme.block_for(weight.shape)
    return kernels.dequantize(data, scale.float(), zero_point, block, dtype, qtype=scheme.qtype)


def _int4(packed, scale, zero_point, shape: tuple[int, ...], dtype) -> torch.Tensor:
    """Int4Tensor: q*scale + zero per group; scale and zero point are [..., K/g, N]."""
    import torch

    codes = packed.view(torch.uint8)
    low = (codes & 0xF).view(torch.int8)
    high = (codes >> 4).view(torch.int8)
    values = torch.stack((low, high), dim=-1).reshape(*codes.shape[:-1], -1)[..., : shape[-1]]
    values = torch.where(values > 7, values - 16, values).to(torch.float32)  # sign-extend the nibble
    groups = scale.shape[-2]
    group = math.ceil(shape[-1] / groups)
    scale_rows = scale.float().transpose(-1, -2).repeat_interleave(group, dim=-1)[..., : shape[-1]]
    out = values * scale_rows
    if zero_point is not None:
        out = out + zero_point.float().transpose(-1, -2).repeat_interleave(group, dim=-1)[..., : shape[-1]]
    return out.to(dtype)
