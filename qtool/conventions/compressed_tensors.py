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

The codec (`encode`, `encoded_layout`, `config_for`, `decode`) writes and reads these layouts
bit for bit as compressed-tensors 0.20.1 does; tests/test_ct_codec.py proves it against the
package. What qtool writes, per scheme:

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

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.conventions.base import Pool, block_from_scale, by_module, plain_weights
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.scheme import QScheme, QType, qtype
from qtool.weight import DATA, Weight

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = [
    "CompressedTensors",
    "METADATA_KEY",
    "CT_VERSION",
    "quantization_config",
    "config_rules",
    "encode",
    "encoded_layout",
    "config_for",
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


def config_rules(checkpoint: Checkpoint) -> "_Config":
    """The checkpoint's `quantization_config` as the matching rules detection itself uses:
    `.ignored_by(module)`, `.group_for(module)` and `.args_for(module)`, with `re:` targets and
    ignore entries matched as compressed-tensors matches them (re.match, else the exact name)."""
    return _Config(quantization_config(checkpoint))


def quantization_config(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """The checkpoint's compressed-tensors config, or None if it has none."""
    config = checkpoint.config.get("quantization_config")
    if config is None and METADATA_KEY in checkpoint.metadata:
        try:
            config = json.loads(checkpoint.metadata[METADATA_KEY])
        except json.JSONDecodeError:
            return None
    if isinstance(config, dict) and config.get("quant_method") in _QUANT_METHODS:
        return config
    return None


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
        try:
            return re.match(target[3:], module) is not None
        except re.error:
            return False
    if target == module:
        return True
    return "." not in target and target[:1].isupper()


class _Config:
    def __init__(self, config: dict[str, Any] | None) -> None:
        self.config = config or {}
        self.ignore = [str(i) for i in self.config.get("ignore") or []]
        groups = self.config.get("config_groups") or {}
        self.groups = [g for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []

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
                if _matches(str(target), module):
                    return str(target), group
        return None

    def args_for(self, module: str) -> _Args | None:
        found = self.group_for(module)
        if found is None:
            return None
        group = found[1]
        weights = group.get("weights") or {}
        block = weights.get("block_structure")
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
            if raw_config is None and data_leaf == "weight" and data.dtype.name.startswith("F8_") and leaves["weight_scale"].dtype.name not in _E8M0:
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
        packing=packing,
        convention=NAME,
        extra=(("format", args.format if args and args.format else fmt),),
    )
    notes.extend(_disagreements(args, scheme, fmt))
    logical_dtype = scale.dtype.name if scale.dtype.name in ("BF16", "F16", "F32") else "BF16"
    return Weight(name, tuple(shape), logical_dtype, members, scheme, NAME, notes)


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
            raise _Unfit(f"weight_packed has {words} int32 words per row, which no bit width fits for {in_features} inputs")
        bits = config_bits if config_bits in fits else fits[0]
    else:
        bits = config_bits or 4
        in_features = words * 32 // bits
        notes.append(f"no weight_shape tensor: in_features taken as {in_features} from the packed width")
    return (rows, in_features), qtype(f"int{bits}"), "int32 along in, LSB first, stored as q + 2^(b-1)", "pack-quantized"


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
    if args.format and args.format not in (fmt, "mixed-precision") and not (
        {args.format, fmt} <= {"int-quantized", "naive-quantized", "float-quantized"}
    ):
        notes.append(f"config says format {args.format}, tensors look like {fmt}")
    return notes


# -- codec: what compressed-tensors 0.20.1 writes, and reading it back ------------------------

CT_VERSION = "0.20.1"  # the package version whose layouts and config this codec reproduces
_FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class _Target:
    """A scheme as compressed-tensors stores it: the format and its weight QuantizationArgs."""

    format: str
    num_bits: int
    type: str  # "int" | "float"
    strategy: str  # tensor | channel | group | tensor_group | block
    symmetric: bool
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    scale_dtype: str | None = None  # the config's torch dtype string, only where the preset sets one
    activations: str | None = None  # "token" | "group128": dynamic fp8 input activations

    def weights_args(self) -> dict[str, Any]:
        """`QuantizationArgs.model_dump()` as compressed-tensors serializes it: unset
        block_structure, scale_dtype, actorder, observer and zp_dtype are left out."""
        args: dict[str, Any] = {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "dynamic": False,
        }
        if self.block_structure is not None:
            args["block_structure"] = list(self.block_structure)
        if self.scale_dtype is not None:
            args["scale_dtype"] = self.scale_dtype
        return args

    def input_args(self) -> dict[str, Any] | None:
        # qtool does no calibration, so activations are dynamic: per token (the FP8_DYNAMIC
        # preset), or per group of 128 for block weights (the FP8_BLOCK preset). The FP8
        # preset's static per-tensor input_scale would need calibration data; a dynamic
        # per-token scheme with the same weights is what compressed-tensors and vLLM load.
        if self.activations is None:
            return None
        group = 128 if self.activations == "group128" else None
        return {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "group_size": group,
            "strategy": "group" if group else "token",
            "dynamic": True,
        }


def _usage(message: str, hint: str | None = None) -> Exception:
    """A UsageError, imported late (inspect imports this module and must stay light)."""
    from qtool.errors import UsageError

    return UsageError(message, hint=hint)


def _target(scheme: QScheme) -> _Target:
    """The compressed-tensors layout for a scheme, or a UsageError naming what it can store."""
    qt, gran = scheme.qtype, scheme.granularity
    scale = scheme.scale_dtype.upper()
    float_scale = scale in (*_FLOAT_DTYPES, "AUTO")
    e8m0, e4m3 = scale in ("E8M0", "F8_E8M0", "U8"), scale in ("E4M3", "F8_E4M3", "UE4M3")
    strategy = gran  # qtool's granularity names are compressed-tensors' strategy names
    group_size = scheme.group_size if gran == "group" else None
    block = None
    if gran == "block":
        *lead, rows, cols = scheme.block
        if lead and any(b != 1 for b in lead) or rows is None or cols is None:
            raise _usage(f"compressed-tensors blocks are 2-D with fixed sizes, not {list(scheme.block)}")
        block = (rows, cols)
    if qt.kind == "int":
        if not qt.signed:
            raise _usage(f"compressed-tensors stores signed ints: use int{qt.bits} (with :asym for a zero point), not {qt.name}")
        if not float_scale:
            raise _usage(f"compressed-tensors stores int scales as the weight's float dtype, not {scheme.scale_dtype}")
        return _Target("pack-quantized", qt.bits, "int", strategy, scheme.symmetric, group_size, block)
    if not scheme.symmetric:
        raise _usage(f"compressed-tensors quantizes {qt.name} symmetrically only")
    if qt.name == "fp8_e4m3" and float_scale:
        acts = "group128" if gran == "block" else "token"
        return _Target("float-quantized", 8, "float", strategy, True, group_size, block, activations=acts)
    if qt.name == "fp8_e4m3" and e8m0 and group_size == 32:
        return _Target("mxfp8-quantized", 8, "float", "group", True, 32, scale_dtype="torch.uint8")
    if qt.name == "fp4_e2m1" and e4m3 and group_size == 16:
        return _Target("nvfp4-pack-quantized", 4, "float", "tensor_group", True, 16, scale_dtype="torch.float8_e4m3fn")
    if qt.name == "fp4_e2m1" and e8m0 and group_size == 32:
        return _Target("mxfp4-pack-quantized", 4, "float", "group", True, 32, scale_dtype="torch.uint8")
    raise _usage(
        f"compressed-tensors has no layout for {scheme.label} with {scheme.scale_dtype} scales",
        hint="it stores int1..int8 (pack-quantized), fp8_e4m3 with float scales, mxfp8 g32, nvfp4 g16 "
        "and mxfp4 g32; nf4 goes to --format bitsandbytes",
    )


def _module_of(name: str) -> str:
    if not name.endswith(".weight"):
        raise _usage(f"compressed-tensors quantizes Linear weights named '<module>.weight', not {name!r}")
    return name[: -len(".weight")]


def _check_shape(name: str, shape: tuple[int, ...], target: _Target) -> tuple[int, int]:
    if len(shape) != 2:
        raise _usage(f"compressed-tensors quantizes 2-D Linear weights; {name} has shape {list(shape)}")
    rows, cols = shape
    # Groups must divide in_features: compressed-tensors 0.20.1 raises "tensor column shape
    # must be divisble by the given group_size" on a ragged last group. 2-D blocks may be
    # partial (the package pads them), and tensor / channel strategies take any shape.
    if target.group_size and cols % target.group_size:
        divisors = [g for g in (256, 128, 64, 32, 16, 8) if cols % g == 0 and g != target.group_size]
        raise _usage(
            f"compressed-tensors refuses group size {target.group_size} for {name}: "
            f"in_features {cols} is not a multiple of {target.group_size}",
            hint=(f"use a group size that divides {cols} (e.g. {divisors[0]})" if divisors else "use per-channel")
            + ", or leave this weight unquantized",
        )
    return rows, cols


def _scale_storage(scheme: QScheme, dtype: str) -> str:
    """The stored dtype of a float scale: the weight's dtype for "auto", as compressed-tensors
    does (float16 for a weight that is not a float), else the dtype the scheme names."""
    scale = scheme.scale_dtype.upper()
    if scale == "AUTO":
        return dtype if dtype in _FLOAT_DTYPES else "F16"
    return scale


def _block_of(target: _Target, shape: tuple[int, int]) -> tuple[int, int]:
    rows, cols = shape
    if target.strategy == "tensor":
        return rows, cols
    if target.strategy == "channel":
        return 1, cols
    if target.block_structure:
        return target.block_structure
    return 1, target.group_size or cols


def _scale_shape(target: _Target, shape: tuple[int, int]) -> tuple[int, ...]:
    if target.strategy == "tensor":
        return (1,)
    rows, cols = shape
    block_rows, block_cols = _block_of(target, shape)
    return (math.ceil(rows / block_rows), math.ceil(cols / block_cols))


def encoded_layout(name: str, shape: tuple[int, ...], dtype: str, scheme: QScheme) -> list[tuple[str, str, tuple[int, ...]]]:
    """(stored name, safetensors dtype, shape) of every tensor `encode` writes for this weight,
    in that order, computed from the shape alone."""
    module, target = _module_of(name), _target(scheme)
    rows, cols = _check_shape(name, tuple(shape), target)
    grid = _scale_shape(target, (rows, cols))
    bits = target.num_bits
    if target.format == "pack-quantized":
        layout = [(f"{module}.weight_packed", "I32", (rows, math.ceil(cols * bits / 32)))]
        layout.append((f"{module}.weight_scale", _scale_storage(scheme, dtype), grid))
        if not target.symmetric:
            if target.strategy in ("group", "channel"):  # packed along dim 0, as the package does
                layout.append((f"{module}.weight_zero_point", "I32", (math.ceil(rows * bits / 32), grid[1])))
            else:
                layout.append((f"{module}.weight_zero_point", "I8", grid))
        layout.append((f"{module}.weight_shape", "I64", (2,)))
        return layout
    if target.format == "float-quantized":
        return [(f"{module}.weight", "F8_E4M3", (rows, cols)), (f"{module}.weight_scale", _scale_storage(scheme, dtype), grid)]
    if target.format == "mxfp8-quantized":
        return [(f"{module}.weight", "F8_E4M3", (rows, cols)), (f"{module}.weight_scale", "U8", grid)]
    if target.format == "nvfp4-pack-quantized":
        return [
            (f"{module}.weight_packed", "U8", (rows, cols // 2)),
            (f"{module}.weight_scale", "F8_E4M3", grid),
            (f"{module}.weight_global_scale", "F32", (1,)),
        ]
    return [(f"{module}.weight_packed", "U8", (rows, cols // 2)), (f"{module}.weight_scale", "U8", grid)]


def symmetric_int_layout(scheme: QScheme, shape: tuple[int, ...], dtype: str) -> tuple[int, int] | None:
    """(bits, group) when this weight is written as symmetric pack-quantized ints with one
    scale per row group, stored in the weight's own dtype: the layout qtool.native encodes.
    None for every other layout (torch encodes those)."""
    from qtool.errors import QtoolError

    try:
        target = _target(scheme)
    except QtoolError:
        return None
    if target.format != "pack-quantized" or not target.symmetric or target.strategy not in ("channel", "group"):
        return None
    if len(shape) != 2 or dtype not in _FLOAT_DTYPES or _scale_storage(scheme, dtype) != dtype:
        return None
    group = shape[1] if target.strategy == "channel" else target.group_size
    if not group or shape[1] % group:
        return None
    return target.num_bits, group


def encode(name: str, weight: torch.Tensor, scheme: QScheme) -> dict[str, torch.Tensor]:
    """The stored tensors of one Linear weight, exactly as compressed-tensors 0.20.1 writes
    them after min-max calibration (its `calculate_qparams` / `generate_gparam`) and
    `compress_model`. Computes on weight's device, in weight's dtype where the package does."""
    import torch

    from qtool import kernels

    if not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
        raise _usage(f"{name}: encode takes a float16/bfloat16/float32 weight, not {weight.dtype}")
    dtype = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}.get(weight.dtype, "F16")
    layout = encoded_layout(name, tuple(weight.shape), dtype, scheme)
    target = _target(scheme)
    shape = (weight.shape[0], weight.shape[1])
    block = _block_of(target, shape)
    grid = _scale_shape(target, shape)
    names = [entry[0] for entry in layout]
    out: dict[str, torch.Tensor] = {}
    if target.format == "pack-quantized":
        value_type = qtype(f"int{target.num_bits}")
        scale, zero_point = kernels.choose_qparams(weight, block, value_type, target.symmetric, _scale_storage(scheme, dtype))
        values = kernels.quantize(weight, scale, zero_point, block, value_type)
        offset = 1 << (target.num_bits - 1)  # stored as q + 2^(b-1): in uint8, v + offset wraps to exactly that
        unsigned = values.view(torch.uint8).add_(offset)
        out[names[0]] = kernels.pack_int32(unsigned, target.num_bits, dim=-1, check=False)
        out[names[1]] = scale.reshape(grid)
        if zero_point is not None:
            if target.strategy in ("group", "channel"):
                zero_point = kernels.pack_int32(zero_point.reshape(grid).to(torch.int32) + offset, target.num_bits, dim=0)
            out[names[2]] = zero_point.reshape(layout[2][2])
        out[names[-1]] = torch.tensor(list(shape), dtype=torch.int64, device=weight.device)
    elif target.format == "float-quantized":
        value_type = qtype("fp8_e4m3")
        scale, _ = kernels.choose_qparams(weight, block, value_type, True, _scale_storage(scheme, dtype))
        out[names[0]] = kernels.quantize(weight, scale, None, block, value_type)
        out[names[1]] = scale.reshape(grid)
    elif target.format == "mxfp8-quantized":
        value_type = qtype("fp8_e4m3")
        scale = _mx_scale(weight, block, value_type)
        out[names[0]] = kernels.quantize(weight, scale, None, block, value_type)
        out[names[1]] = scale
    elif target.format == "nvfp4-pack-quantized":
        value_type = qtype("fp4_e2m1")
        global_scale = kernels.choose_global_scale(weight, value_type, "ue4m3")
        scale, _ = kernels.choose_qparams(weight, block, value_type, True, "E4M3", global_scale=global_scale)
        codes = kernels.quantize(weight, scale, None, block, value_type, global_scale=global_scale)
        out[names[0]] = kernels.pack_nibbles(codes)  # low nibble = even element
        out[names[1]] = scale
        out[names[2]] = global_scale
    else:  # mxfp4-pack-quantized
        value_type = qtype("fp4_e2m1")
        scale = _mx_scale(weight, block, value_type)
        out[names[0]] = kernels.pack_nibbles(kernels.quantize(weight, scale, None, block, value_type))
        out[names[1]] = scale
    return {key: tensor.contiguous() for key, tensor in out.items()}


def _mx_scale(weight: torch.Tensor, block: tuple[int, int], value_type: QType) -> torch.Tensor:
    """E8M0 exponents as the package stores them. It keeps the scale as 2^(u - 127) in the
    weight's dtype while quantizing; in float16 that underflows to 0 for u <= 102, which it
    then replaces by its eps for uint8 scales, 1.0, i.e. u = 127 (all-zero or tiny groups of
    float16 weights). Mirrored, so the bytes stay identical."""
    import torch

    from qtool import kernels

    scale, _ = kernels.choose_qparams(weight, block, value_type, True, "E8M0")
    if weight.dtype == torch.float16:
        scale = torch.where(scale <= 102, torch.full_like(scale, 127), scale)
    return scale


def config_for(schemes_by_module: dict[str, QScheme], ignore: list[str], dtype: str | None = None) -> dict[str, Any]:
    """The `quantization_config` that compressed-tensors' ModelCompressor writes for these
    modules: one config group per distinct layout, targeting the module names; top-level
    format = the groups' format, or "mixed-precision" when they differ.

    `dtype` (the model's dtype) is accepted for symmetry with the other writers:
    compressed-tensors records no scale dtype for float scales, which follow each weight."""
    from qtool.patterns import natural_key

    if not schemes_by_module:
        raise _usage("no quantized modules: a compressed-tensors config needs at least one")
    if dtype is not None and str(dtype).upper() not in (*_FLOAT_DTYPES, "BFLOAT16", "FLOAT16", "FLOAT32"):
        raise _usage(f"the model dtype must be a float dtype, got {dtype!r}")
    targets: dict[_Target, list[str]] = {}
    for module, scheme in schemes_by_module.items():
        module = module[: -len(".weight")] if module.endswith(".weight") else module
        targets.setdefault(_target(scheme), []).append(module)
    groups = {}
    for index, (target, modules) in enumerate(targets.items()):
        groups[f"group_{index}"] = {
            "targets": sorted(modules, key=natural_key),
            "weights": target.weights_args(),
            "input_activations": target.input_args(),
            "output_activations": None,
            "format": target.format,
        }
    formats = {target.format for target in targets}
    return {
        "config_groups": groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


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
    if scheme.convention != NAME:
        raise _usage(f"{weight.name} is a {scheme.convention} weight, not compressed-tensors")

    def load(role: str):
        return checkpoint.load(weight.members[role]).to(device)

    logical = storage_dtype(weight.dtype)
    dtype = logical.torch_dtype() if weight.dtype in _FLOAT_DTYPES else torch.bfloat16
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
            packed_rows = math.ceil(rows * bits / 32)
            if zero_point.dim() != 2 or zero_point.shape[0] != packed_rows:
                raise CheckpointError(
                    f"{weight.name}: weight_zero_point {list(zero_point.shape)} is not {bits}-bit zero points "
                    f"for {rows} rows packed along dim 0 ([{packed_rows}, groups])",
                    path=data.file,
                )
            zero_point = kernels.unpack_int32(zero_point, bits, rows, dim=0).to(torch.int16) - offset
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
            raise CheckpointError(f"{weight.name}: data unpacks to {list(values.shape)} rows, not {[end - begin, cols]}", path=data.file)
        if block_rows:
            grid_rows = math.ceil(rows / block_rows)
            first, last = begin // block_rows, math.ceil(end / block_rows)
            chunk_scale = scale.reshape(grid_rows, -1)[first:last]
            chunk_zero = zero_point.reshape(grid_rows, -1)[first:last] if zero_point is not None else None
            chunk_block = block
        else:
            chunk_scale, chunk_zero, chunk_block = scale, zero_point, (end - begin, block[1])
        piece = kernels.dequantize(values, chunk_scale, chunk_zero, chunk_block, dtype, qtype=codes_type, global_scale=global_scale)
        if step >= rows:
            return piece
        if out is None:
            out = torch.empty((rows, cols), dtype=piece.dtype, device=piece.device)
        out[begin:end] = piece
    return out
