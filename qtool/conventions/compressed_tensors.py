"""compressed-tensors (CONVENTIONS §1): the layout vLLM and transformers load.

Verified against compressed-tensors 0.20.1 (`compressors/*/base.py`, `utils/match.py`).
Per module `m`, by format:

    pack-quantized        m.weight_packed I32 [O, ceil(I*b/32)], m.weight_shape I64|I32 [2],
                          m.weight_scale, m.weight_zero_point I32 [ceil(O*b/32), G] if asym
    naive/int-quantized   m.weight I8 [O, I] (unpacked even for 4-bit), m.weight_scale, ...
    float-quantized       m.weight F8_E4M3 [O, I], m.weight_scale
    nvfp4-pack-quantized  m.weight_packed U8 [O, I/2], m.weight_scale F8_E4M3 [O, I/16],
                          m.weight_global_scale F32 [1]
    mxfp4-pack-quantized  m.weight_packed U8 [O, I/2], m.weight_scale U8 (E8M0) [O, I/32]
    mxfp6-pack-quantized  m.weight_packed U8 [O, I*3/4], m.weight_scale U8 (E8M0) [O, I/32]
    mxfp8-quantized       m.weight F8_E4M3 [O, I], m.weight_scale U8 (E8M0) [O, I/32]

The scheme comes from `quantization_config` when the checkpoint has one (config.json, or the
safetensors `__metadata__` key below for a single file), else from names and shapes. Where the
config and the tensors disagree, the tensors win and the weight carries a note.

`decode` reads these layouts, and `compressed_tensors_encode` writes them, bit for bit as
compressed-tensors 0.20.1 does; tests/test_ct_codec.py proves it against the package. What
qtool writes, per scheme:

    int1..int8, sym or asym, tensor/channel/group/block   pack-quantized (weights only, W*A16)
    fp8_e4m3 with float scales, tensor/channel/block      float-quantized, dynamic fp8 activations
    fp8_e4m3 with E8M0 scales, g32                        mxfp8-quantized (MXFP8A16)
    fp4_e2m1 with E4M3 scales, g16                        nvfp4-pack-quantized (NVFP4A16)
    fp4_e2m1 with E8M0 scales, g32                        mxfp4-pack-quantized (MXFP4A16)

Partial blocks: 2-D blocks (FP8_BLOCK on [200, 300]) are padded, as the package does; groups
that do not divide in_features are refused up front, because compressed-tensors 0.20.1
raises "tensor column shape must be divisble by the given group_size" on them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.conventions.base import (
    Pool,
    block_from_scale,
    by_module,
    metadata_json,
    plain_weights,
    require_convention,
    side_file,
    unusable_scale,
    unusable_zero_point,
)
from qtool.dtypes import WEIGHT_FLOATS
from qtool.errors import JsonTypeError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.untrusted_json import AnyOf, Boolean, Integer, ListOf, MapOf, Record, String, describe, field_path
from qtool.patterns import BoundedRegex, compile_regex
from qtool.qtypes import qtype
from qtool.scheme import QScheme
from qtool.weight import DATA, Provenance, Weight
from qtool.weight_codes import IntCodes

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = [
    "CompressedTensors",
    "METADATA_KEY",
    "quantization_config",
    "config_rules",
    "codes",
    "decode",
]

NAME = "compressed-tensors"
METADATA_KEY = "quantization_config"  # single-file checkpoints carry the config here
_QUANT_METHODS = ("compressed-tensors", "sparseml")

# module leaf -> role; activation parameters belong to the module, so they fold into its weight
_ROLES = {
    "weight_scale": "scale",
    "weight_zero_point": "zero_point",
    "weight_g_idx": "g_idx",
    "weight_global_scale": "global_scale",
    "weight_shape": "shape",
    "input_scale": "input_scale",
    "input_zero_point": "input_zero_point",
    "input_global_scale": "input_global_scale",
    "output_scale": "output_scale",
}
_E8M0 = ("U8", "F8_E8M0")


def config_rules(checkpoint: Checkpoint) -> _Config:
    """The checkpoint's `quantization_config` as the matching rules detection itself uses:
    `.ignored_by(module)`, `.group_for(module)` and `.args_for(module)`, with `re:` targets and
    ignore entries matched as compressed-tensors matches them (re.match, else the exact name)."""
    return _Config(quantization_config(checkpoint))


# The fields of a quantization_config qtool reads, typed as compressed-tensors' pydantic models
# declare them (QuantizationConfig, QuantizationScheme, QuantizationArgs); a config that breaks
# them is one the package refuses to load too, so qtool refuses it (exit 2) naming the field.
_WEIGHT_ARGS = Record(
    {
        "num_bits": Integer(min=1, max=64),
        "type": String(),
        "symmetric": Boolean(),
        "strategy": String(),
        "group_size": Integer(),
        "block_structure": AnyOf(ListOf(Integer(min=1), length=2), String()),  # [rows, cols], or old "RxC"
    }
)
_SCHEME = Record({"targets": ListOf(String()), "weights": _WEIGHT_ARGS, "format": String()})
_CONFIG = Record(
    {
        "quant_method": String(),
        "format": String(),
        "ignore": ListOf(String()),
        "config_groups": MapOf(AnyOf(_SCHEME, ListOf(String()))),  # a scheme, or a preset's targets
    }
)
_CONFIG_HINT = "compressed-tensors would refuse this config too; fix the field, or re-save the model"


def quantization_config(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """The checkpoint's compressed-tensors config, its fields qtool reads type-checked, or None
    if it has none. A field of the wrong type is a JsonTypeError naming the file (exit 2)."""
    config = checkpoint.config.get("quantization_config")
    where, path = "quantization_config", side_file(checkpoint)
    if config is None and METADATA_KEY in checkpoint.metadata:
        config = metadata_json(checkpoint, METADATA_KEY)
        where, path = f'__metadata__["{METADATA_KEY}"]', checkpoint.path
    if not (isinstance(config, dict) and config.get("quant_method") in _QUANT_METHODS):
        return None
    checked = _CONFIG.check(config, where, path, _CONFIG_HINT)
    for name, group in (checked.get("config_groups") or {}).items():
        block = group.get("weights", {}).get("block_structure") if isinstance(group, dict) else None
        if isinstance(block, str):
            at = field_path(field_path(field_path(where, "config_groups"), name), "weights") + ".block_structure"
            group["weights"]["block_structure"] = _block_from_text(block, at, path)
    return checked


def _block_from_text(text: str, where: str, path: str) -> list[int]:
    """compressed-tensors' old block_structure spelling, "128x128"."""
    rows, _, cols = text.partition("x")
    if not (
        rows.isdecimal() and cols.isdecimal() and len(rows) < 10 and len(cols) < 10 and int(rows) > 0 and int(cols) > 0
    ):
        raise JsonTypeError(
            where, describe(text), 'a list of 2 integers ≥ 1, or "<rows>x<cols>"', path=path, hint=_CONFIG_HINT
        )
    return [int(rows), int(cols)]


@dataclass(frozen=True)
class _Args:
    """The weight arguments of the config group that targets a module."""

    num_bits: int | None = None
    type: str | None = None  # "int" | "float"
    symmetric: bool | None = None
    strategy: str | None = None
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    format: str | None = None


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' `match_name`: `re:` is re.match, else an exact name. A bare class
    name such as "Linear" can't be resolved from a header, so it matches every module."""
    if target.startswith("re:"):
        regex = _config_regex(target)
        return regex is not None and regex.match(module) is not None
    if target == module:
        return True
    return "." not in target and target[:1].isupper()


@functools.lru_cache(maxsize=256)
def _config_regex(target: str) -> BoundedRegex | None:
    """A config's `re:` target, bounded in time as every regex qtool runs (qtool.patterns): the
    config comes from a stranger. An invalid one matches nothing, as before."""
    try:
        return compile_regex(target[3:], f"{target!r} (a quantization_config targets or ignore entry)")
    except ValueError:
        return None


class _Config:
    def __init__(self, config: dict[str, Any] | None) -> None:
        self.config = config or {}  # as quantization_config() checked it
        self.ignore = list(self.config.get("ignore") or [])
        self.groups = [g for g in (self.config.get("config_groups") or {}).values() if isinstance(g, dict)]

    def ignored(self, module: str) -> bool:
        return self.ignored_by(module) is not None

    def ignored_by(self, module: str) -> str | None:
        """The first `ignore` entry that lists `module`, or None."""
        # class names in `ignore` (rare) can't be resolved from a header; only names count here
        return next((t for t in self.ignore if _matches(t, module) and (t.startswith("re:") or t == module)), None)

    def group_for(self, module: str) -> tuple[str, dict[str, Any]] | None:
        """The first target that matches `module`, with its config group; None when the config
        ignores the module or no group targets it."""
        if not self.config or self.ignored(module):
            return None
        for group in self.groups:
            for target in group.get("targets") or []:
                if _matches(target, module):
                    return target, group
        return None

    def args_for(self, module: str) -> _Args | None:
        found = self.group_for(module)
        if found is None:
            return None
        group = found[1]
        weights = group.get("weights") or {}
        block = weights.get("block_structure")  # [rows, cols], each ≥ 1
        return _Args(
            num_bits=weights.get("num_bits"),
            type=weights.get("type"),
            symmetric=weights.get("symmetric"),
            strategy=weights.get("strategy"),
            group_size=weights.get("group_size"),
            block_structure=tuple(block) if isinstance(block, list) and len(block) == 2 else None,
            format=group.get("format") or self.config.get("format"),
        )


class CompressedTensors:
    name = NAME

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)

    def codes(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> IntCodes:
        return codes(checkpoint, weight, device)

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        raw_config = quantization_config(checkpoint)
        config = _Config(raw_config)
        weights: list[Weight] = []
        for module, leaves in by_module(pool).items():
            if "weight_scale" not in leaves:
                continue
            data_leaf = "weight_packed" if "weight_packed" in leaves else "weight" if "weight" in leaves else None
            if data_leaf is None:
                continue
            data = leaves[data_leaf]
            # A float8 weight with a scale and no compressed-tensors config is the plain fp8
            # convention's (same math, different toolchain); leave it for that one.
            if (
                raw_config is None
                and data_leaf == "weight"
                and data.dtype.name.startswith("F8_")
                and leaves["weight_scale"].dtype.name not in _E8M0
            ):
                continue
            if data_leaf == "weight" and not (data.dtype.name == "I8" or data.dtype.name.startswith("F8_")):
                continue
            members = {DATA: data}
            for leaf, role in _ROLES.items():
                if leaf in leaves:
                    members[role] = leaves[leaf]
            prefix = f"{module}." if module else ""
            args = config.args_for(module)
            try:
                weight = _resolve(checkpoint, prefix + "weight", members, args)
            except _Unfit as exc:
                weights.extend(plain_weights(members, f"looks like compressed-tensors, but {exc}; left plain"))
                continue
            if config.config and config.ignored(module):
                weight.notes.append("quantized although the config's `ignore` lists this module")
            weights.append(weight)
        return weights


class _Unfit(ValueError):
    """The tensors half-match the layout; the message says which part does not fit."""


def _resolve(checkpoint: Checkpoint, name: str, members: dict[str, StoredTensor], args: _Args | None) -> Weight:
    data, scale = members[DATA], members["scale"]
    notes: list[str] = []
    for role, leaf in (("scale", "weight_scale"), ("global_scale", "weight_global_scale")):
        problem = unusable_scale(members[role], leaf) if role in members else None
        if problem:
            raise _Unfit(problem)
    problem = unusable_zero_point(members["zero_point"], "weight_zero_point") if "zero_point" in members else None
    if problem:
        raise _Unfit(problem)
    if "g_idx" in members and not members["g_idx"].dtype.is_integer:
        raise _Unfit(f"weight_g_idx is {members['g_idx'].dtype.name}, expected integers")
    if data.name.endswith("weight_packed"):
        if data.dtype.name == "I32":
            shape, value_type, packing, fmt = _int_packed(checkpoint, members, args, notes)
        elif data.dtype.name == "U8":
            shape, value_type, packing, fmt = _fp_packed(members, args)
        else:
            raise _Unfit(f"weight_packed is {data.dtype.name}, expected I32 or U8")
    else:
        shape = data.shape
        if data.dtype.name == "I8":
            bits = args.num_bits if args and args.num_bits and args.num_bits <= 8 else 8
            value_type, packing, fmt = qtype(f"int{bits}"), "int8, one value per byte", "int-quantized"
        else:
            value_type = qtype("fp8_e5m2" if data.dtype.name == "F8_E5M2" else "fp8_e4m3")
            packing, fmt = None, "mxfp8-quantized" if scale.dtype.name in _E8M0 else "float-quantized"
    if len(shape) != 2:
        raise _Unfit(f"the weight has {len(shape)} dims, expected 2")

    hint = _block_hint(args)
    block = block_from_scale(shape, scale.shape, hint)
    if block is None:
        raise _Unfit(f"weight_scale shape {list(scale.shape)} does not fit a {list(shape)} weight")
    zero_point = "zero_point" in members
    scheme = QScheme(
        qtype=value_type,
        block=block,
        symmetric=not zero_point,
        scale_dtype="E8M0" if scale.dtype.name in _E8M0 and value_type.kind == "float" else scale.dtype.name,
        zero_point=zero_point,
        global_scale="global_scale" in members,
    )
    provenance = Provenance(NAME, packing, (("format", args.format if args and args.format else fmt),))
    notes.extend(_disagreements(args, scheme, fmt))
    logical_dtype = scale.dtype.name if scale.dtype.name in WEIGHT_FLOATS else "BF16"
    return Weight(name, tuple(shape), logical_dtype, members, scheme, provenance, notes)


def _int_packed(checkpoint: Checkpoint, members: dict[str, StoredTensor], args: _Args | None, notes: list[str]):
    data = members[DATA]
    if len(data.shape) != 2:
        raise _Unfit(f"weight_packed has shape {list(data.shape)}, expected 2 dims")
    rows, words = data.shape
    stored_shape = _read_weight_shape(checkpoint, members.get("shape"))
    config_bits = args.num_bits if args and args.num_bits else None
    if stored_shape is not None:
        out_features, in_features = stored_shape
        if out_features != rows:
            raise _Unfit(f"weight_shape {list(stored_shape)} does not match weight_packed rows {rows}")
        fits = [b for b in range(1, 9) if math.ceil(in_features * b / 32) == words]
        if not fits:
            raise _Unfit(
                f"weight_packed has {words} int32 words per row, which no bit width fits for {in_features} inputs"
            )
        bits = config_bits if config_bits in fits else fits[0]
    else:
        bits = config_bits or 4
        in_features = words * 32 // bits
        notes.append(f"no weight_shape tensor: in_features taken as {in_features} from the packed width")
    return (
        (rows, in_features),
        qtype(f"int{bits}"),
        "int32 along in, LSB first, stored as q + 2^(b-1)",
        "pack-quantized",
    )


def _fp_packed(members: dict[str, StoredTensor], args: _Args | None):
    data, scale = members[DATA], members["scale"]
    if len(data.shape) != 2 or len(scale.shape) != 2:
        raise _Unfit("weight_packed and weight_scale must both be 2-D")
    rows, cols = data.shape
    if scale.dtype.name == "F8_E4M3":
        if "global_scale" not in members:
            raise _Unfit("an fp8 weight_scale with packed fp4 needs weight_global_scale (nvfp4)")
        return (rows, cols * 2), qtype("fp4_e2m1"), "uint8, two per byte, low nibble first", "nvfp4-pack-quantized"
    if scale.dtype.name in _E8M0:
        scale_cols = scale.shape[1]
        if args and args.num_bits == 6 or cols == 24 * scale_cols:
            return (rows, cols * 4 // 3), qtype("fp6_e2m3"), "uint8, 6-bit stream", "mxfp6-pack-quantized"
        return (rows, cols * 2), qtype("fp4_e2m1"), "uint8, two per byte, low nibble first", "mxfp4-pack-quantized"
    raise _Unfit(f"weight_scale is {scale.dtype.name}, expected F8_E4M3 (nvfp4) or U8 (mxfp4)")


def _read_weight_shape(checkpoint: Checkpoint, tensor: StoredTensor | None) -> tuple[int, int] | None:
    """`weight_shape` is a 2-element I64 (old files: I32) tensor: metadata stored as data."""
    if tensor is None:
        return None
    if tensor.dtype.name not in ("I64", "I32") or tensor.numel != 2:
        raise _Unfit(f"weight_shape is {tensor.dtype.name} {list(tensor.shape)}, expected 2 integers")
    raw = checkpoint.read_small(tensor)
    width = tensor.dtype.bits // 8
    values = [int.from_bytes(raw[i : i + width], "little", signed=True) for i in range(0, len(raw), width)]
    if any(v < 0 for v in values):
        raise _Unfit(f"weight_shape holds negative sizes {values}")
    return values[0], values[1]


def _block_hint(args: _Args | None) -> tuple[int, int] | None:
    if args is None:
        return None
    if args.block_structure:
        return args.block_structure
    if args.group_size and args.group_size > 0:
        return (1, args.group_size)
    return None


def _disagreements(args: _Args | None, scheme: QScheme, fmt: str) -> list[str]:
    if args is None:
        return []
    notes = []
    if args.num_bits and args.num_bits != scheme.bits:
        notes.append(f"config says {args.num_bits}-bit, tensors show {scheme.bits}-bit")
    if args.symmetric is not None and args.symmetric != scheme.symmetric and scheme.qtype.kind == "int":
        said = "symmetric" if args.symmetric else "asymmetric"
        notes.append(f"config says {said}, tensors show {'symmetric' if scheme.symmetric else 'asymmetric'}")
    strategy = {"tensor_group": "group"}.get(args.strategy or "", args.strategy)
    if strategy in ("tensor", "channel", "group", "block") and strategy != scheme.granularity:
        notes.append(f"config says strategy {args.strategy}, tensors show {scheme.granularity}")
    if args.group_size and args.group_size > 0 and scheme.group_size and args.group_size != scheme.group_size:
        notes.append(f"config says group_size {args.group_size}, tensors show {scheme.group_size}")
    if (
        args.format
        and args.format not in (fmt, "mixed-precision")
        and not ({args.format, fmt} <= {"int-quantized", "naive-quantized", "float-quantized"})
    ):
        notes.append(f"config says format {args.format}, tensors look like {fmt}")
    return notes


# -- reading values back ----------------------------------------------------------------------


def _usage(message: str, hint: str | None = None) -> Exception:
    """A UsageError, imported late (inspect imports this module and must stay light)."""
    from qtool.errors import UsageError

    return UsageError(message, hint=hint)


_DECODE_CHUNK = 4 << 20  # elements of float temporaries per row chunk when decoding


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float weight, in its logical shape and dtype, from any layout `detect` recognizes:
    pack-quantized (incl. odd in_features and a packed asymmetric zero point), naive/int-
    quantized (4-bit values in int8 too), float-quantized (partial blocks too), nvfp4, mxfp4,
    mxfp6 and mxfp8; an old `weight_g_idx` is honoured. Bit for bit what the package returns."""
    import torch

    from qtool import kernels
    from qtool.dtypes import storage_dtype
    from qtool.errors import CheckpointError

    scheme = weight.require_scheme()
    require_convention(weight, NAME)

    def load(role: str):
        return checkpoint.load(weight.members[role]).to(device)

    logical = storage_dtype(weight.dtype)
    dtype = logical.torch_dtype() if weight.dtype in WEIGHT_FLOATS else torch.bfloat16
    rows, cols = weight.shape
    value_type = scheme.qtype
    data = weight.data
    scale = load("scale")
    zero_point = load("zero_point") if "zero_point" in weight.members else None
    global_scale = load("global_scale").float() if "global_scale" in weight.members else None
    codes_type = None
    packed = load(DATA)  # a view of the file (mmap) until rows are unpacked below
    if data.name.endswith("weight_packed") and data.dtype.name == "I32":
        bits = value_type.bits
        offset = 1 << (bits - 1)

        def values_of(begin: int, end: int):
            unsigned = kernels.unpack_int32(packed[begin:end], bits, cols, dim=-1)
            if bits == 8:  # u - 128 is u with its top bit flipped, read as int8; one pass, no copy of the file
                return (unsigned ^ 0x80).view(torch.int8)
            return unsigned.sub_(offset).view(torch.int8)  # a fresh tensor: wraps to exactly u - offset

        if zero_point is not None and zero_point.dtype == torch.int32:
            zero_point = _unpacked_zero_points(weight, zero_point, bits, rows) - offset
    elif data.name.endswith("weight_packed"):  # U8: fp4 pairs, or fp6 quads
        if value_type.name == "fp6_e2m3":
            codes_type = value_type

            def values_of(begin: int, end: int):
                return kernels.unpack_fp6(packed[begin:end])
        else:
            codes_type = qtype("fp4_e2m1")

            def values_of(begin: int, end: int):
                return kernels.unpack_nibbles(packed[begin:end])
    else:  # int8 (int/naive-quantized) or float8 (float-quantized, mxfp8)

        def values_of(begin: int, end: int):
            return packed[begin:end]

    if packed.shape[0] != rows:
        raise CheckpointError(f"{weight.name}: data has {packed.shape[0]} rows, not {rows}", path=data.file)
    block = scheme.block_for((rows, cols))
    if "g_idx" in weight.members:  # activation order: column c uses group g_idx[c]
        g_idx = load("g_idx").long()
        scale = scale.reshape(rows, -1).index_select(1, g_idx)
        if zero_point is not None:
            zero_point = zero_point.reshape(rows, -1).index_select(1, g_idx)
        block = (1, 1)

    # Row chunks bound the float temporaries to ~_DECODE_CHUNK elements whatever the weight's
    # size; each chunk is the same arithmetic on the same values, so the result is identical.
    block_rows = block[0] if block[0] < rows else 0  # 0: one scale row covers every row
    unit = block_rows or 1
    step = max(unit, (_DECODE_CHUNK // max(cols, 1)) // unit * unit)
    out = None
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        values = values_of(begin, end)
        if tuple(values.shape) != (end - begin, cols):
            raise CheckpointError(
                f"{weight.name}: data unpacks to {list(values.shape)} rows, not {[end - begin, cols]}", path=data.file
            )
        if block_rows:
            grid_rows = math.ceil(rows / block_rows)
            first, last = begin // block_rows, math.ceil(end / block_rows)
            chunk_scale = scale.reshape(grid_rows, -1)[first:last]
            chunk_zero = zero_point.reshape(grid_rows, -1)[first:last] if zero_point is not None else None
            chunk_block = block
        else:
            chunk_scale, chunk_zero, chunk_block = scale, zero_point, (end - begin, block[1])
        piece = kernels.dequantize(
            values, chunk_scale, chunk_zero, chunk_block, dtype, qtype=codes_type, global_scale=global_scale
        )
        if step >= rows:
            return piece
        if out is None:
            out = torch.empty((rows, cols), dtype=piece.dtype, device=piece.device)
        out[begin:end] = piece
    return out


def _unpacked_zero_points(weight: Weight, zero_point: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int16 [rows, groups]: a packed asymmetric zero point unpacked along dim 0, as stored
    (zp + 2^(b-1), unsigned), as compressed-tensors' `PackedQuantizationCompressor.decompress`
    unpacks it."""
    import torch

    from qtool import kernels
    from qtool.errors import CheckpointError

    packed_rows = math.ceil(rows * bits / 32)
    if zero_point.dim() != 2 or zero_point.shape[0] != packed_rows:
        raise CheckpointError(
            f"{weight.name}: weight_zero_point {list(zero_point.shape)} is not {bits}-bit zero points "
            f"for {rows} rows packed along dim 0 ([{packed_rows}, groups])",
            path=weight.data.file,
        )
    return kernels.unpack_int32(zero_point, bits, rows, dim=0).to(torch.int16)


def codes(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> IntCodes:
    """A pack-quantized int weight's grid as stored, grid mapping of compressed-tensors 0.20.1
    (`compressors/pack_quantized/base.py`, `decompress`; `quantization/lifecycle/
    forward_helpers.py`, `_dequantize`): the stored words hold u = q + 2^(b-1), and so do
    packed asymmetric zero points, so `codes` = u and `zero` = stored zero point (an unpacked
    I8 zero point + 2^(b-1)), or 2^(b-1) everywhere for a symmetric weight. Group and channel
    strategies (a tensor-wide scale is spread to every row); an old `weight_g_idx` is kept.
    The product is formed in the scale's dtype (`_dequantize`). Other layouts (float codes,
    2-D blocks, int8 unpacked) raise a UsageError."""
    import torch

    from qtool import kernels

    scheme = weight.require_scheme()
    require_convention(weight, NAME)
    data = weight.data
    if not (data.name.endswith("weight_packed") and data.dtype.name == "I32") or scheme.qtype.kind != "int":
        raise _usage(
            f"{weight.name}: only pack-quantized int weights have integer codes qtool reads, not {scheme.label}"
        )
    rows, cols = weight.shape
    block = scheme.block_for((rows, cols))
    if block[0] not in (1, rows) or (block[0] == rows and rows > 1 and block[1] != cols):
        raise _usage(f"{weight.name}: {scheme.granularity_label} blocks span rows; integer codes need row groups")

    def load(role: str):
        return checkpoint.load(weight.members[role]).to(device)

    bits = scheme.bits
    offset = 1 << (bits - 1)
    unsigned = kernels.unpack_int32(load(DATA), bits, cols, dim=-1).to(torch.int16)
    if tuple(unsigned.shape) != (rows, cols):
        raise _checkpoint_error(weight, f"data unpacks to {list(unsigned.shape)}, not {[rows, cols]}")
    scale = load("scale")
    groups = math.ceil(cols / block[1])
    scale = scale.reshape(-1, groups).expand(rows, groups) if scale.numel() in (groups, rows * groups) else None
    if scale is None:
        raise _checkpoint_error(weight, f"weight_scale {list(weight.members['scale'].shape)} is not [{rows}, {groups}]")
    if "zero_point" in weight.members:
        zero_point = load("zero_point")
        if zero_point.dtype == torch.int32:
            zero = _unpacked_zero_points(weight, zero_point, bits, rows).reshape(rows, groups).to(torch.int32)
        else:
            zero = zero_point.to(torch.int32).reshape(-1, groups).expand(rows, groups) + offset
    else:
        zero = torch.full((rows, groups), offset, dtype=torch.int32, device=scale.device)
    g_idx = load("g_idx").to(torch.int32) if "g_idx" in weight.members else None
    return IntCodes(
        codes=unsigned,
        scale=scale.contiguous(),
        zero=zero.contiguous(),
        minimum=None,
        bits=bits,
        group=block[1],
        g_idx=g_idx,
    )


def _checkpoint_error(weight: Weight, message: str) -> Exception:
    from qtool.errors import CheckpointError

    return CheckpointError(f"{weight.name}: {message}", path=weight.data.file)
