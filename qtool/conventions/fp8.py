"""FP8 checkpoints outside compressed-tensors (CONVENTIONS §8).

    DeepSeek-V3 block scales   m.weight F8_E4M3 [O, I], m.weight_scale_inv F32 [ceil(O/128), ceil(I/128)]
                               W = w * scale_inv[i // 128, j // 128]  (multiplied, despite the name)
    per-tensor / per-channel   m.weight F8_E4M3 [O, I], m.weight_scale F32 () | (1,) | (O,) | (O, 1)
                               (vLLM fp8, transformers fbgemm_fp8), optional m.input_scale

A float8 weight with neither scale is a low-precision float tensor, not a quantized one: the
plain convention takes it.

`decode` multiplies in float32 and casts once to the weight's logical dtype (config
`torch_dtype`; float32 when the checkpoint names none), as DeepSeek's `weight_dequant` and
vLLM do. Partial edge blocks take their block's scale.

gpt-oss MXFP4 (transformers `integrations/mxfp4.py`, `GptOssExperts`) is the `GptOssMxfp4`
convention below: `{p}_blocks` U8 `(..., G, B)` and `{p}_scales` U8 `(..., G)` are one weight `{p}`.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from qtool.conventions.base import (
    Pool,
    block_from_scale,
    by_module,
    plain_weights,
    require_convention,
    side_file,
    unusable_scale,
)
from qtool.dtypes import decoded_dtype, float_dtype_named
from qtool.formats.checkpoint import Checkpoint
from qtool.formats.untrusted_json import Integer, ListOf, Record, String
from qtool.qtypes import qtype
from qtool.scheme import QScheme
from qtool.weight import DATA, Provenance, Weight

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = ["Fp8", "decode", "GptOssMxfp4", "GPT_OSS", "decode_mxfp4"]

NAME = "fp8"
_VALUE_TYPES = {
    "F8_E4M3": "fp8_e4m3",
    "F8_E5M2": "fp8_e5m2",
    "F8_E4M3FNUZ": "fp8_e4m3fnuz",
    "F8_E5M2FNUZ": "fp8_e5m2fnuz",
}

# What qtool reads of an fp8 or mxfp4 quantization_config (transformers' FineGrainedFP8Config,
# Mxfp4Config). Checked only where quant_method names that toolchain: another toolchain's
# config is not held to these types, and its fields are not read.
_FP8_METHODS = ("fp8", "fbgemm_fp8")
_FP8_CONFIG = Record(
    {
        "weight_block_size": ListOf(Integer(min=1), length=2),
        "torch_dtype": String(),
        "modules_to_not_convert": ListOf(String()),
    }
)
_MXFP4_CONFIG = Record({"modules_to_not_convert": ListOf(String())})
_HINT = "transformers would refuse this config too; fix the field"


def _config(checkpoint: Checkpoint, methods: tuple[str, ...], spec: Record) -> dict:
    """quantization_config, type-checked by `spec`, when its quant_method is one of `methods`;
    else {}. A wrong type is a JsonTypeError naming config.json (exit 2)."""
    config = checkpoint.config.get("quantization_config")
    if not isinstance(config, dict) or str(config.get("quant_method") or "").lower() not in methods:
        return {}
    return spec.check(config, "quantization_config", side_file(checkpoint), _HINT)


class Fp8:
    name = NAME

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        config = _config(checkpoint, _FP8_METHODS, _FP8_CONFIG)
        block_hint = config.get("weight_block_size")  # [rows, cols], each ≥ 1
        hint = (block_hint[0], block_hint[1]) if block_hint else None
        weights: list[Weight] = []
        for leaves in by_module(pool).values():
            data = leaves.get("weight")
            if data is None or data.dtype.name not in _VALUE_TYPES:
                continue
            scale_leaf = (
                "weight_scale_inv"
                if "weight_scale_inv" in leaves
                else "weight_scale"
                if "weight_scale" in leaves
                else None
            )
            if scale_leaf is None:
                continue
            scale = leaves[scale_leaf]
            members = {DATA: data, "scale": scale}
            if "input_scale" in leaves:
                members["input_scale"] = leaves["input_scale"]
            block = block_from_scale(data.shape, scale.shape, hint if scale_leaf == "weight_scale_inv" else None)
            if block is None or not scale.dtype.is_float or unusable_scale(scale, scale_leaf):
                why = f"{scale_leaf} {scale.dtype.name} {list(scale.shape)} does not fit a {list(data.shape)} weight"
                weights.extend(plain_weights(members, f"looks like an fp8 weight, but {why}; left plain"))
                continue
            scheme = QScheme(
                qtype=qtype(_VALUE_TYPES[data.dtype.name]),
                block=block,
                symmetric=True,
                scale_dtype=scale.dtype.name,
            )
            provenance = Provenance(NAME, details=(("scale", f"{scale_leaf} (multiplied)"),))
            logical = str(config.get("torch_dtype") or checkpoint.config.get("torch_dtype") or "")
            dtype = float_dtype_named(logical) or data.dtype.name
            weights.append(Weight(data.name, data.shape, dtype, members, scheme, provenance))
        return weights


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float weight: w[i, j] * scale[block of (i, j)], in the weight's logical dtype."""

    from qtool import kernels

    scheme = weight.require_scheme()
    require_convention(weight, NAME)
    dtype = decoded_dtype(weight.dtype)
    values = checkpoint.load(weight.data).to(device)
    scale = checkpoint.load(weight.members["scale"]).to(device)
    return kernels.dequantize(values, scale.float(), None, scheme.block_for(weight.shape), dtype)


# -- gpt-oss MXFP4 ---------------------------------------------------------------------------------
#
#     {p}_blocks  U8 (..., G, B)   B bytes = 2B fp4 e2m1 codes per 32-value block: byte k holds
#                                  element 2k in its low nibble and 2k+1 in its high nibble
#     {p}_scales  U8 (..., G)      E8M0: the block's scale is 2^(u - 127)
#
#     w[..., g, 2k]   = e2m1(byte & 0xF) * 2^(scale - 127)
#     w[..., g, 2k+1] = e2m1(byte >> 4)  * 2^(scale - 127)
#
# In stored order the values are (..., G*2B): [E, out, in] for gpt-oss's experts. transformers'
# `convert_moe_packed_tensors` then swaps dims 1 and 2 into `GptOssExperts`' [E, in, out]
# parameter layout (`gate_up_proj` [E, hidden, 2*intermediate]), and so does qtool for 3-D and
# larger weights: the logical weight is the model's parameter, and `qtool dequantize` writes
# what transformers' bf16 gpt-oss checkpoints hold. Its 32-value blocks then run along dim -2.
# A 2-D `_blocks` tensor (no expert dim) has nothing to swap and keeps its (rows, G*2B) order.

GPT_OSS = "gpt-oss"
_BLOCKS, _SCALES = "_blocks", "_scales"


class GptOssMxfp4:
    name = GPT_OSS

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        ignored = set(_config(checkpoint, ("mxfp4",), _MXFP4_CONFIG).get("modules_to_not_convert") or ())
        logical = str(checkpoint.config.get("torch_dtype") or checkpoint.config.get("dtype") or "bfloat16")
        dtype = float_dtype_named(logical) or "BF16"
        weights: list[Weight] = []
        for name, blocks in pool.items():
            if not name.endswith(_BLOCKS):
                continue
            prefix = name[: -len(_BLOCKS)]
            scales = pool.get(prefix + _SCALES)
            if scales is None:
                continue
            members = {DATA: blocks, "scale": scales}
            if (
                blocks.dtype.name != "U8"
                or scales.dtype.name != "U8"
                or len(blocks.shape) < 2
                or tuple(blocks.shape[:-1]) != tuple(scales.shape)
            ):
                why = f"{name} {blocks.dtype.name} {list(blocks.shape)} and {prefix + _SCALES} {scales.dtype.name} {list(scales.shape)}"
                weights.extend(
                    plain_weights(
                        members, f"looks like gpt-oss MXFP4, but {why} are not U8 (..., G, B) and (..., G); left plain"
                    )
                )
                continue
            if any(fnmatch.fnmatchcase(prefix, m) or prefix.startswith(m + ".") for m in ignored):
                continue  # listed as not converted: the plain convention takes both tensors
            *lead, groups, width = blocks.shape
            values = groups * width * 2
            stored = (*lead, values)
            shape = (stored[0], stored[2], stored[1], *stored[3:]) if len(stored) >= 3 else stored
            # the 32-value blocks run along the stored last dim, which the swap moves to dim 1
            block: tuple[int | None, ...] = (width * 2, 1) if len(stored) == 3 else (1, width * 2)
            scheme = QScheme(
                qtype=qtype("fp4_e2m1"),
                block=block,
                symmetric=True,
                scale_dtype="E8M0",
            )
            provenance = Provenance(
                GPT_OSS, "u8, element 2k in the low nibble", (("blocks", f"{groups} x {width} bytes"),)
            )
            notes = []
            if len(stored) >= 3:
                notes.append(
                    f"stored as {list(stored)}; dims 1 and 2 swapped into the model's layout, as transformers' convert_moe_packed_tensors does"
                )
            weights.append(Weight(prefix, shape, dtype, members, scheme, provenance, notes))
        return weights

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode_mxfp4(checkpoint, weight, device)


def decode_mxfp4(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float weight in its logical dtype and layout, on `device`."""

    from qtool import kernels

    require_convention(weight, GPT_OSS)
    dtype = decoded_dtype(weight.dtype)
    blocks = checkpoint.load(weight.data).to(device)
    scales = checkpoint.load(weight.members["scale"]).to(device)
    codes = kernels.unpack_nibbles(blocks)  # (..., G, 2B), low nibble first
    values = kernels.fp4_e2m1_decode(codes) * kernels.e8m0_decode(scales).unsqueeze(-1)
    values = values.reshape(*values.shape[:-2], -1)
    if values.dim() >= 3:
        values = values.transpose(1, 2)
    return values.contiguous().to(dtype)
