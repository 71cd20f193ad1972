"""burn's quantized tensors, as burnpack files hold them (CONVENTIONS §11).

Read from tracel-ai/burn 0.22.0-pre.2 (`crates/burn-std/src/tensor/quantization.rs`,
`crates/burn-flex/src/ops/qtensor.rs`) and cubecl at the revision burn pins (48348968,
`crates/cubecl-common/src/quant/scheme.rs`). A `QFloat` tensor's dtype carries its scheme:

    {"value": "Q4S", "store": {"PackedU32": 0}, "mode": "Symmetric",
     "tensor": null | "F32",                                  per-tensor (or global) scale dtype
     "block": null | {"size": {"storage": [b0..b4], "len": n}, "dtype": "F16"}}

burn 0.19-0.21 wrote `{"value", "param": scale dtype, "store", "level": "Tensor" |
{"Block": {storage, len}}, "mode"}`; both read the same. A scheme with neither level is one
f32 scale per tensor. Block sizes align to the trailing dims (missing leading dims are 1).

    value   range         bits    store                 values in the tensor's bytes
    Q8F     -128..127      8      Native                one i8 each (Q4*/Q2* too: burn-flex
    Q8S     -127..127      8                            keeps sub-byte values one an i8)
    Q4F     -8..7          4      PackedU32(d)          32/b two's-complement values a u32
    Q4S     -7..7          4                            along dim d counted from the last,
    Q2F     -2..1          2                            LSB first; each line padded to whole
    Q2S     -1..1          2                            words
    E4M3    ±448           8      Native | PackedU32    fp8 bit patterns
    E5M2    ±57344         8
    E2M1    ±6             4      PackedNative(d)       two a byte along d, first in the low
                                                        nibble; or PackedU32

The bytes are the values, then one scale per block (row-major over the block grid, in the
scale dtype: F32/F16/BF16 little-endian, UE4M3 and UE8M0 one byte), then for a two-level
scheme (block and tensor levels both set) the f32 per-tensor scale. Nothing pads between them.

    x = scale[block] * q                     one level
    x = (global * scale[block]) * q          two levels

in float32, burn-flex's order. Values are symmetric (no zero point); "Lookup" mode stores
codebook indices whose table is not in the tensor's bytes, so such a tensor stays plain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.conventions.base import Pool, plain_weight, require_convention
from qtool.errors import InternalError
from qtool.formats.burnpack import qfloat_scheme
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.untrusted_json import describe
from qtool.qtypes import qtype
from qtool.scheme import QScheme
from qtool.weight import DATA, Provenance, Weight

if TYPE_CHECKING:
    import torch

__all__ = ["Burn", "NAME", "BurnScheme", "parse_scheme", "decode", "decode_bytes"]

NAME = "burn"
# burn QuantValue -> (qtool value type, bits, range shown in notes)
VALUES: dict[str, tuple[str, int, str]] = {
    "Q8F": ("int8", 8, "-128..127"),
    "Q8S": ("int8", 8, "-127..127"),
    "Q4F": ("int4", 4, "-8..7"),
    "Q4S": ("int4", 4, "-7..7"),
    "Q2F": ("int2", 2, "-2..1"),
    "Q2S": ("int2", 2, "-1..1"),
    "E4M3": ("fp8_e4m3", 8, "±448"),
    "E5M2": ("fp8_e5m2", 8, "±57344"),
    "E2M1": ("fp4_e2m1", 4, "±6"),
}
# burn ScaleDtype (QuantParam before 0.22) -> (qtool scale dtype name, bytes)
SCALES: dict[str, tuple[str, int]] = {
    "F32": ("F32", 4),
    "F16": ("F16", 2),
    "BF16": ("BF16", 2),
    "UE8M0": ("E8M0", 1),
    "UE4M3": ("UE4M3", 1),
}


class UnreadableQFloat(ValueError):
    """A QFloat scheme qtool cannot read: the tensor stays plain, with this as its note."""


@dataclass(frozen=True)
class BurnScheme:
    value: str  # "Q4S"
    store: str  # "Native" | "PackedU32" | "PackedNative"
    store_dim: int  # the packed dim counted from the innermost; 0 for Native
    mode: str  # "Symmetric" | "Lookup"
    block: tuple[int, ...] | None  # block sizes, trailing-aligned; None = per tensor
    scale_dtype: str  # burn's name of the innermost level's scale dtype
    global_scale: bool  # a second, per-tensor f32 level over block scales

    @property
    def bits(self) -> int:
        return VALUES[self.value][1]

    @property
    def per_word(self) -> int:
        """Values in one storage element: 32/b in a u32, 2 e2m1 a byte, else 1."""
        if self.store == "PackedU32":
            return 32 // self.bits
        if self.store == "PackedNative":
            return 2
        return 1

    @property
    def store_label(self) -> str:
        return self.store if self.store == "Native" else f"{self.store}({self.store_dim})"

    def full_block(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """burn's `BlockSize::to_dim_vec`: leading dims the block doesn't name are 1."""
        if self.block is None:
            return tuple(shape)
        block = self.block[-len(shape) :] if shape else ()
        return (1,) * (len(shape) - len(block)) + tuple(block)

    def grid(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(math.ceil(d / b) for d, b in zip(shape, self.full_block(shape))) if self.block else (1,)

    def value_bytes(self, shape: tuple[int, ...]) -> int:
        """burn's `storage_elements` x element size: a packed dim pads per line."""
        if self.store == "Native":
            return math.prod(shape)
        storage = list(shape) or [1]
        dim = len(storage) - self.store_dim - 1
        storage[dim] = math.ceil(storage[dim] / self.per_word)
        return math.prod(storage) * (4 if self.store == "PackedU32" else 1)

    def total_bytes(self, shape: tuple[int, ...]) -> int:
        scales = math.prod(self.grid(shape)) * SCALES[self.scale_dtype][1]
        return self.value_bytes(shape) + scales + (4 if self.global_scale else 0)


def _shown(value: Any) -> str:
    """A scheme value as a note shows it: a short string as repr, anything else cut short."""
    return repr(value) if isinstance(value, str) and len(value) <= 60 else describe(value)


def parse_scheme(scheme: dict[str, Any], rank: int) -> BurnScheme:
    """A QuantScheme map, in burn 0.22's or burn 0.19-0.21's form."""
    value = scheme.get("value")
    if not isinstance(value, str) or value not in VALUES:  # a JSON object or list is no key (unhashable)
        raise UnreadableQFloat(f"unknown burn quant value {_shown(value)} (known: {' '.join(VALUES)})")
    store_raw = scheme.get("store")
    if store_raw == "Native":
        store, dim = "Native", 0
    elif isinstance(store_raw, dict) and len(store_raw) == 1 and next(iter(store_raw)) in ("PackedU32", "PackedNative"):
        store, dim = next(iter(store_raw.items()))
        if type(dim) is not int or not 0 <= dim < max(rank, 1):
            raise UnreadableQFloat(f"store {store}({_shown(dim)}) packs a dim the rank-{rank} tensor does not have")
    else:
        raise UnreadableQFloat(f"unknown burn quant store {_shown(store_raw)}")
    mode = scheme.get("mode", "Symmetric")
    if mode not in ("Symmetric", "Lookup"):
        raise UnreadableQFloat(f"unknown burn quant mode {_shown(mode)}")
    if "level" in scheme or "param" in scheme:  # burn <= 0.21
        param = scheme.get("param", "F32")
        level = scheme.get("level", "Tensor")
        block = None if level == "Tensor" else _block_size(level.get("Block") if isinstance(level, dict) else None)
        tensor_dtype, block_dtype = (param, None) if block is None else (None, param)
    else:
        tensor_dtype = scheme.get("tensor")
        block_level = scheme.get("block")
        block = _block_size(block_level.get("size")) if isinstance(block_level, dict) else None
        block_dtype = block_level.get("dtype") if isinstance(block_level, dict) else None
        if block_level is not None and block is None:
            raise UnreadableQFloat(f"block level {_shown(block_level)} has no readable size")
        if block is None and tensor_dtype is None:
            tensor_dtype = "F32"  # burn: a scheme with no level is one f32 scale per tensor
    scale_dtype = block_dtype if block is not None else tensor_dtype
    if not isinstance(scale_dtype, str) or scale_dtype not in SCALES:
        raise UnreadableQFloat(f"unknown burn scale dtype {_shown(scale_dtype)} (known: {' '.join(SCALES)})")
    global_scale = block is not None and tensor_dtype is not None
    if global_scale and tensor_dtype != "F32":
        raise UnreadableQFloat(f"a two-level scheme stores its per-tensor scale as F32, this one says {tensor_dtype}")
    if store == "PackedNative" and value != "E2M1":
        raise UnreadableQFloat(f"burn packs only E2M1 natively, not {value}")
    if store == "Native" and value == "E2M1":
        raise UnreadableQFloat("burn cannot store E2M1 values natively (Native), one a byte")
    return BurnScheme(value, store, dim, mode, block, scale_dtype, global_scale)


def _block_size(size: Any) -> tuple[int, ...] | None:
    """cubecl's BlockSize {storage: [u8; 5], len}: the first `len` entries."""
    if not isinstance(size, dict):
        return None
    storage, length = size.get("storage"), size.get("len")
    if not isinstance(storage, list) or type(length) is not int or not 0 < length <= len(storage):
        return None
    block = tuple(storage[:length])
    if not all(type(b) is int and b > 0 for b in block):
        return None
    return block


class Burn:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        if checkpoint.format != "burnpack":
            return []
        weights = []
        for tensor in pool.values():
            raw = qfloat_scheme(tensor)
            if raw is not None:
                weights.append(_weight(tensor, raw))
        return weights

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)


def _weight(tensor: StoredTensor, raw: dict[str, Any]) -> Weight:
    shape = tuple(tensor.logical_shape or ())
    try:
        burn = parse_scheme(raw, len(shape))
    except UnreadableQFloat as exc:
        return plain_weight(tensor, f"burn QFloat tensor: {exc}; left plain")
    if burn.mode == "Lookup":
        return plain_weight(
            tensor,
            "burn QFloat in Lookup mode: its lookup table is not in the tensor's bytes, so qtool cannot decode it; left plain",
        )
    expected = burn.total_bytes(shape)
    if expected != tensor.nbytes:
        return plain_weight(
            tensor,
            f"burn QFloat {burn.value} {burn.store_label} of shape {list(shape)} needs {expected} bytes, the tensor has {tensor.nbytes}; left plain",
        )
    value, _, value_range = VALUES[burn.value]
    scale_name = SCALES[burn.scale_dtype][0]
    block: tuple[int | None, ...] = burn.full_block(shape) if burn.block else (None,) * max(len(shape), 1)
    scheme = QScheme(
        qtype=qtype(value),
        block=block or (None,),
        symmetric=True,
        scale_dtype=scale_name,
        global_scale=burn.global_scale,
    )
    provenance = Provenance(
        NAME,
        None
        if burn.store == "Native"
        else f"{burn.store_label}: {burn.per_word} a {'u32' if burn.store == 'PackedU32' else 'byte'}, LSB first",
        (("burn_value", burn.value), ("store", burn.store_label), ("mode", burn.mode), ("scale", burn.scale_dtype)),
    )
    level = f"block {list(burn.full_block(shape))}" if burn.block else "per tensor"
    note = (
        f"burn QFloat: value {burn.value} ({value_range}), store {burn.store_label}, {level}, "
        f"scales {burn.scale_dtype}" + (" under an f32 global scale" if burn.global_scale else "")
    )
    notes = [note]
    if burn.scale_dtype == "UE8M0":
        notes.append("UE8M0 scales: burn itself cannot decode these yet; qtool reads them as 2^(u-127)")
    # burn records no float dtype for a quantized tensor; it dequantizes to f32 by default
    return Weight(tensor.name, shape, "F32", {DATA: tensor}, scheme, provenance, notes)


# -- decoding ------------------------------------------------------------------------------------


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float32 weight on `device`."""
    require_convention(weight, NAME)
    raw = qfloat_scheme(weight.data)
    if raw is None:
        raise InternalError(f"the burn decoder was handed {weight.name}, which holds no QFloat scheme")
    burn = parse_scheme(raw, len(weight.shape))
    return decode_bytes(checkpoint.load(weight.data).to(device), burn, weight.shape)


def decode_bytes(raw: torch.Tensor, burn: BurnScheme, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values of a QFloat tensor's bytes (uint8, on any device), vectorized."""
    import torch

    from qtool import kernels

    raw = raw.reshape(-1).view(torch.uint8)
    value_end = burn.value_bytes(shape)
    grid = burn.grid(shape)
    scale_count = math.prod(grid)
    scale_end = value_end + scale_count * SCALES[burn.scale_dtype][1]
    q = _values(raw[:value_end], burn, shape)
    scale = _scales(raw[value_end:scale_end], burn.scale_dtype)
    if burn.global_scale:
        global_scale = raw[scale_end : scale_end + 4].clone().view(torch.float32)
        scale = global_scale * scale  # burn-flex: (global * scale[block]) * q
    qt = qtype(VALUES[burn.value][0])
    return kernels.dequantize(q, scale, None, burn.full_block(shape), torch.float32, qtype=qt)


def _values(raw, burn: BurnScheme, shape: tuple[int, ...]):
    """Unpacked values in the logical shape: int8 for Q*, float8 for E4M3/E5M2, uint8 e2m1 codes."""
    import torch

    from qtool import kernels

    bits = burn.bits
    if burn.store == "Native":
        values = raw.reshape(shape)
    else:
        dims = list(shape) or [1]
        dim = len(dims) - burn.store_dim - 1
        storage = list(dims)
        storage[dim] = math.ceil(dims[dim] / burn.per_word)
        if burn.store == "PackedU32":
            words = raw.clone().view(torch.int32).reshape(storage)  # little-endian u32 words
            values = kernels.unpack_int32(words, bits, dims[dim], dim=dim)
        else:  # PackedNative: e2m1 pairs, the first in the low nibble
            packed = raw.reshape(storage).movedim(dim, -1)
            values = kernels.unpack_nibbles(packed)[..., : dims[dim]].movedim(-1, dim)
        values = values.reshape(shape)
    if burn.value in ("E4M3", "E5M2"):
        return values.contiguous().view(torch.uint8).view(kernels.float8_dtype(VALUES[burn.value][0]))
    if burn.value == "E2M1":
        return values.contiguous().view(torch.uint8)
    values = values.contiguous().view(torch.uint8) if values.dtype != torch.uint8 else values.contiguous()
    if bits < 8:  # two's complement in `bits` bits: sign-extend
        shift = 8 - bits
        return (values << shift).view(torch.int8) >> shift
    return values.view(torch.int8)


def _scales(raw, dtype: str):
    """float32 scales from their stored bytes."""
    import torch

    from qtool import kernels

    raw = raw.clone()
    if dtype == "F32":
        return raw.view(torch.float32)
    if dtype == "F16":
        return raw.view(torch.float16).float()
    if dtype == "BF16":
        return raw.view(torch.bfloat16).float()
    if dtype == "UE4M3":
        return raw.view(torch.float8_e4m3fn).float()
    return kernels.e8m0_decode(raw)
