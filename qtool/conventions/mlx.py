"""MLX / mlx-lm (CONVENTIONS §5).

Verified against mlx 0.32.4 (`mlx/ops.cpp` `affine_dequantize` / `fp_dequantize` /
`fp_quantize`, `python/mlx/nn/layers/quantized.py`) and mlx-lm (`utils.py` `quantize_model`,
`load_model`, `save_model`), and proven bit for bit against `mx.dequantize` by
tests/test_mlx.py on fixtures that `mx.quantize` wrote. Per module `m` (`[..., O, I]`, any
leading dims, e.g. the experts of a SwitchLinear):

    m.weight   U32 [..., O, I*b/32]  each row an LSB-first bit stream in little-endian words:
                                     element k sits at bits k*b.. of the row, so b = 3, 5, 6
                                     straddle words
    m.scales   [..., O, I/gs]        affine: the model dtype (F16/BF16/F32); mxfp4, mxfp8:
                                     U8 E8M0 exponents; nvfp4: U8 holding E4M3 bits
    m.biases   [..., O, I/gs]        affine only (`m.bias`, singular, is the layer's plain bias)

    mode     group size        bits                 w =
    affine   32, 64*, 128      1 2 3 4* 5 6 8       scale * q + bias, q unsigned
    mxfp4    32                4                    e2m1(q) * 2^(e - 127)
    mxfp8    32                8                    e4m3(q) * 2^(e - 127)
    nvfp4    16                4                    e2m1(q) * e4m3(scale)

Settings come from config.json's `quantization` (mirrored into `quantization_config`):
`{"group_size", "bits", "mode"}` plus per-module entries keyed by module path, either a dict
that mlx passes to `to_quantized(**entry)` (so a missing `mode` means affine and a missing
group size or bit width means that mode's default) or `false`. Without a config they are read
from the shapes: the scales' dtype and `biases` name the mode, and the packed width gives
group_size * bits = 32 * words / groups. Where that product fits several pairs, MLX's default
group size 64 is taken, then 32, then 128, and a note names the alternatives. Where the config
and the tensors disagree, the tensors win and the weight carries a note.

Decoding, vectorized torch. Affine runs in the scales' dtype exactly as mx does on CPU:
`q * scale` rounded to that dtype, then `+ bias` rounded again; this is bit-identical to
`mx.dequantize` for float16, bfloat16 and float32. The fp modes are computed in float32, where
every product is exact, and cast once: equal to `mx.dequantize(..., dtype=...)` for float32 and
bfloat16. mlx 0.32's nvfp4 also takes a per-tensor `global_scale` argument, but neither
`nn.QuantizedLinear` nor mlx-lm stores one, so no checkpoint carries it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.conventions.base import Pool, by_module, plain_weights, require_convention, side_file
from qtool.dtypes import decoded_dtype, float_dtype_named
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.untrusted_json import AnyOf, Anything, Integer, Record, String
from qtool.qtypes import qtype
from qtool.scheme import QScheme
from qtool.weight import DATA, Provenance, Weight

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = ["AFFINE_BITS", "AFFINE_GROUP_SIZES", "MODES", "Mlx", "decode", "settings_for"]

NAME = "mlx"
AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)  # what mx.quantize 0.32 accepts
AFFINE_GROUP_SIZES = (64, 32, 128)  # MLX's default first: the order shapes are resolved in
# mode -> (group size, bits, value type, scale dtype label); affine's entries are its defaults
MODES: dict[str, tuple[int, int, str, str]] = {
    "affine": (64, 4, "uint4", "float"),
    "mxfp4": (32, 4, "fp4_e2m1", "E8M0"),
    "mxfp8": (32, 8, "fp8_e4m3", "E8M0"),
    "nvfp4": (16, 4, "fp4_e2m1", "E4M3"),
}
_FLOAT_SCALES = ("F16", "BF16", "F32")
_PACKING = "uint32 words along in, LSB-first bit stream (3/5/6-bit values straddle words)"


@dataclass(frozen=True)
class Settings:
    mode: str
    group_size: int
    bits: int


class _Unfit(ValueError):
    pass


# What qtool reads of mlx-lm's `quantization`: the top level's settings, and the same three in
# each per-module dict entry (another per-module value, `false`, is read as it is).
_SETTINGS = {"mode": String(max_chars=64), "group_size": Integer(min=1), "bits": Integer(min=1, max=32)}
_CONFIG = Record(_SETTINGS, rest=AnyOf(Record(_SETTINGS), Anything()))


def _config(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """mlx-lm's `quantization` dict, or its mirror in `quantization_config` (which other
    toolchains also use, so only when it carries no `quant_method`), its settings type-checked:
    `"mode": {}` is a JsonTypeError naming config.json (exit 2), as mlx-lm cannot load it either."""
    config = checkpoint.config
    for key in ("quantization", "quantization_config"):
        value = config.get(key)
        if isinstance(value, dict) and "quant_method" not in value and ("bits" in value or "group_size" in value):
            return _CONFIG.check(
                value, key, side_file(checkpoint), "mlx-lm would refuse this config too; fix the field"
            )
    return None


def settings_for(config: dict[str, Any] | None, module: str) -> Settings | None | bool:
    """What the config says about `module`: Settings, False (listed as not quantized), or None
    (no config). mlx passes a per-module dict to `to_quantized(**entry)`: missing keys take
    that function's defaults, not the top level's."""
    if config is None:
        return None
    entry = config.get(module)
    if entry is False:
        return False
    if isinstance(entry, dict):
        mode = entry.get("mode", "affine")
        source = entry
    else:
        mode = config.get("mode", "affine")
        source = config
    if mode not in MODES:
        return None
    default_group, default_bits = MODES[mode][:2]
    group_size, bits = source.get("group_size") or default_group, source.get("bits") or default_bits
    if not isinstance(group_size, int) or not isinstance(bits, int):
        return None
    return Settings(mode, group_size, bits)


class Mlx:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        config = _config(checkpoint)
        weights: list[Weight] = []
        for module, leaves in by_module(pool).items():
            data, scales = leaves.get("weight"), leaves.get("scales")
            if data is None or scales is None or data.dtype.name != "U32":
                continue
            members = {DATA: data, "scale": scales}
            if "biases" in leaves:
                members["bias"] = leaves["biases"]
            try:
                weights.append(_resolve(checkpoint, module, members, settings_for(config, module)))
            except _Unfit as exc:
                weights.extend(plain_weights(members, f"looks like an MLX quantized weight, but {exc}; left plain"))
        return weights

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)


def _settings_from_shapes(members: dict[str, StoredTensor], hinted: Settings | None) -> tuple[Settings, list[Settings]]:
    """The mode, group size and bits the tensors show, and the other settings they also fit
    when the config did not settle it."""
    data, scales = members[DATA], members["scale"]
    words, groups = data.shape[-1], scales.shape[-1]
    if groups < 1 or (words * 32) % groups:
        raise _Unfit(f"{words} words per row cannot split into {groups} groups")
    product = words * 32 // groups  # group_size * bits
    if "bias" not in members:
        if scales.dtype.name != "U8":
            raise _Unfit(f"scales are {scales.dtype.name} without biases (MX scales are U8)")
        for mode in ("mxfp4", "mxfp8", "nvfp4"):
            group_size, bits = MODES[mode][:2]
            if group_size * bits == product:
                return Settings(mode, group_size, bits), []
        raise _Unfit(f"{words} words per {groups} U8 scales fit none of mxfp4, mxfp8, nvfp4")
    if scales.dtype.name not in _FLOAT_SCALES:
        raise _Unfit(f"affine scales are {scales.dtype.name}, expected F16, BF16 or F32")
    pairs = [(g, product // g) for g in AFFINE_GROUP_SIZES if product % g == 0 and product // g in AFFINE_BITS]
    if not pairs:
        raise _Unfit(f"group_size * bits = {product} fits no affine setting")
    if hinted is not None and hinted.mode == "affine":
        for keep in ("both", "group_size", "bits"):
            for group_size, bits in pairs:
                if (keep == "both" and (group_size, bits) == (hinted.group_size, hinted.bits)) or (
                    keep == "group_size" and group_size == hinted.group_size) or (
                    keep == "bits" and bits == hinted.bits):  # fmt: skip
                    return Settings("affine", group_size, bits), []
    return Settings("affine", *pairs[0]), [Settings("affine", *pair) for pair in pairs[1:]]


def _resolve(
    checkpoint: Checkpoint, module: str, members: dict[str, StoredTensor], said: Settings | None | bool
) -> Weight:
    data, scales, biases = members[DATA], members["scale"], members.get("bias")
    if len(data.shape) < 2 or data.shape[:-1] != scales.shape[:-1]:
        raise _Unfit(f"scales {list(scales.shape)} do not fit weight {list(data.shape)}")
    if biases is not None and (biases.shape != scales.shape or biases.dtype != scales.dtype):
        raise _Unfit(
            f"biases {biases.dtype.name} {list(biases.shape)} differ from scales {scales.dtype.name} {list(scales.shape)}"
        )
    hinted = said if isinstance(said, Settings) else None
    settings, alternatives = _settings_from_shapes(members, hinted)
    notes = []
    if said is False:
        notes.append("config.json lists this module as not quantized; its tensors are quantized")
    elif hinted is not None and hinted != settings:
        notes.append(
            f"config.json says {hinted.mode} {hinted.bits}-bit g{hinted.group_size}, the tensors show "
            f"{settings.mode} {settings.bits}-bit g{settings.group_size}; read as the tensors show"
        )
    elif said is None and not alternatives:
        notes.append("no MLX config: settings read from the shapes")
    if alternatives:
        others = ", ".join(f"{s.bits}-bit g{s.group_size}" for s in alternatives)
        prefix = "no config names its settings: " if said is None else ""
        notes.append(f"{prefix}read as {settings.bits}-bit g{settings.group_size} (MLX's default group first); "
                     f"the shapes also fit {others}")  # fmt: skip
    columns = data.shape[-1] * 32 // settings.bits
    if columns != scales.shape[-1] * settings.group_size:
        raise _Unfit(f"{columns} values per row are not {scales.shape[-1]} groups of {settings.group_size}")
    shape = (*data.shape[:-1], columns)
    value_type, scale_label = MODES[settings.mode][2:]
    if settings.mode == "affine":
        value_type, scale_label = f"uint{settings.bits}", scales.dtype.name
        details: tuple[tuple[str, str], ...] = (("mode", "affine"), ("bias", "float, w = scale * q + bias"))
    else:
        details = (("mode", settings.mode),)
    scheme = QScheme(
        qtype=qtype(value_type),
        block=(1, settings.group_size),
        symmetric=settings.mode != "affine",
        scale_dtype=scale_label,
        zero_point=settings.mode == "affine",
    )
    if settings.mode == "affine":
        dtype = scales.dtype.name
    else:  # U8 scales record no dtype: the config's, else what mx.dequantize returns (bfloat16)
        recorded = str(checkpoint.config.get("torch_dtype") or checkpoint.config.get("dtype") or "bfloat16")
        dtype = float_dtype_named(recorded) or "BF16"
    return Weight(
        f"{module}.weight" if module else "weight",
        shape,
        dtype,
        members,
        scheme,
        Provenance(NAME, _PACKING, details),
        notes,
    )


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float weight in its logical shape and dtype, as `mx.dequantize` computes it."""
    import torch

    from qtool import kernels

    scheme = weight.require_scheme()
    require_convention(weight, NAME)
    mode = weight.provenance.detail("mode")
    group_size, bits = scheme.block[-1], scheme.bits
    *lead, columns = weight.shape
    words = checkpoint.load(weight.data).to(device).view(torch.int32)  # U32 bits, as int32
    codes = kernels.unpack_int32(words, bits, columns, dim=-1)  # [..., O, I] uint8
    grouped = (*lead, columns // group_size, group_size)
    scales = checkpoint.load(weight.members["scale"]).to(device)
    if mode == "affine":
        biases = checkpoint.load(weight.members["bias"]).to(device)
        out = codes.reshape(grouped).to(scales.dtype) * scales.unsqueeze(-1)  # rounded to the scale dtype
        return (out + biases.unsqueeze(-1)).reshape(weight.shape)  # and rounded again, as mx does
    if mode == "mxfp8":
        values = codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        values = kernels.fp4_e2m1_decode(codes)
    if mode == "nvfp4":
        effective = scales.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    else:
        effective = kernels.e8m0_decode(scales.view(torch.uint8))
    dtype = decoded_dtype(weight.dtype)
    return (values.reshape(grouped) * effective.unsqueeze(-1)).reshape(weight.shape).to(dtype)
