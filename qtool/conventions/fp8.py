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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.conventions.base import Pool, block_from_scale, by_module, plain_weights
from qtool.formats.checkpoint import Checkpoint
from qtool.scheme import QScheme, qtype
from qtool.weight import DATA, Weight

if TYPE_CHECKING:  # torch is imported where data is touched, never at import time
    import torch

__all__ = ["Fp8", "decode"]

NAME = "fp8"
_VALUE_TYPES = {"F8_E4M3": "fp8_e4m3", "F8_E5M2": "fp8_e5m2", "F8_E4M3FNUZ": "fp8_e4m3fnuz", "F8_E5M2FNUZ": "fp8_e5m2fnuz"}


class Fp8:
    name = NAME

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        config = checkpoint.config.get("quantization_config")
        config = config if isinstance(config, dict) else {}
        block_hint = config.get("weight_block_size")
        hint = tuple(block_hint) if isinstance(block_hint, list) and len(block_hint) == 2 else None
        weights: list[Weight] = []
        for module, leaves in by_module(pool).items():
            data = leaves.get("weight")
            if data is None or data.dtype.name not in _VALUE_TYPES:
                continue
            scale_leaf = "weight_scale_inv" if "weight_scale_inv" in leaves else "weight_scale" if "weight_scale" in leaves else None
            if scale_leaf is None:
                continue
            scale = leaves[scale_leaf]
            members = {DATA: data, "scale": scale}
            if "input_scale" in leaves:
                members["input_scale"] = leaves["input_scale"]
            block = block_from_scale(data.shape, scale.shape, hint if scale_leaf == "weight_scale_inv" else None)
            if block is None or not scale.dtype.is_float:
                why = f"{scale_leaf} {scale.dtype.name} {list(scale.shape)} does not fit a {list(data.shape)} weight"
                weights.extend(plain_weights(members, f"looks like an fp8 weight, but {why}; left plain"))
                continue
            scheme = QScheme(
                qtype=qtype(_VALUE_TYPES[data.dtype.name]),
                block=block,
                symmetric=True,
                scale_dtype=scale.dtype.name,
                convention=NAME,
                extra=(("scale", f"{scale_leaf} (multiplied)"),),
            )
            logical = str(config.get("torch_dtype") or checkpoint.config.get("torch_dtype") or "")
            dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(logical, data.dtype.name)
            weights.append(Weight(data.name, data.shape, dtype, members, scheme, NAME))
        return weights


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float weight: w[i, j] * scale[block of (i, j)], in the weight's logical dtype."""
    import torch

    from qtool import kernels
    from qtool.errors import UsageError

    scheme = weight.require_scheme()
    if scheme.convention != NAME:
        raise UsageError(f"{weight.name} is a {scheme.convention} weight, not fp8")
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(weight.dtype, torch.float32)
    values = checkpoint.load(weight.data).to(device)
    scale = checkpoint.load(weight.members["scale"]).to(device)
    return kernels.dequantize(values, scale.float(), None, scheme.block_for(weight.shape), dtype)
