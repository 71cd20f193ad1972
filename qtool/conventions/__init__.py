"""Toolchain conventions: which stored tensors make up which logical weight, and how.

Each convention claims tensors from a shared pool, in the fixed order of `REGISTRY`; `plain`
comes last and takes whatever is left, so every stored tensor belongs to exactly one weight.
The write side of the toolchains qtool writes lives in `qtool.layouts`.
"""

from __future__ import annotations

from typing import Any

from qtool.conventions.awq import Awq
from qtool.conventions.base import Convention, Pool
from qtool.conventions.bitsandbytes import Bitsandbytes
from qtool.conventions.burn import Burn
from qtool.conventions.compressed_tensors import CompressedTensors
from qtool.conventions.fp8 import Fp8, GptOssMxfp4
from qtool.conventions.gguf import Gguf
from qtool.conventions.gptq import Gptq
from qtool.conventions.mlx import Mlx
from qtool.conventions.plain import Plain
from qtool.conventions.quanto import Quanto
from qtool.conventions.torch_native import TorchNative
from qtool.conventions.torchao import Torchao
from qtool.errors import InternalError, QtoolError
from qtool.formats.checkpoint import Checkpoint
from qtool.patterns import natural_key
from qtool.weight import Weight

__all__ = ["REGISTRY", "resolve", "Convention", "ClaimConflict", "decoder_for"]

REGISTRY: tuple[Convention, ...] = (CompressedTensors(), Fp8(), Bitsandbytes(), Gguf(), Gptq(), Awq(), Mlx(), Quanto(), GptOssMxfp4(), Torchao(), TorchNative(), Burn(), Plain())


class ClaimConflict(InternalError):
    """Two conventions claimed one tensor: a bug in qtool, never in the checkpoint."""


def resolve(checkpoint: Checkpoint, registry: tuple[Convention, ...] = REGISTRY) -> list[Weight]:
    """Every stored tensor, folded into logical weights, sorted by name (`layers.2` before `layers.10`)."""
    pool: Pool = dict(checkpoint.tensors)
    weights: list[Weight] = []
    for convention in registry:
        claimed = convention.detect(checkpoint, pool)
        for weight in claimed:
            for member in weight.members.values():
                if pool.pop(member.name, None) is None:
                    raise ClaimConflict(f"{convention.name} claimed {member.name!r}, which is not in the pool")
        weights.extend(claimed)
    weights.sort(key=lambda w: natural_key(w.name))
    return weights


def decoder_for(weight: Weight) -> Any:
    """The convention that decodes `weight` to float: `.decode(checkpoint, weight, device)`."""
    for convention in REGISTRY:
        if convention.name == weight.convention and hasattr(convention, "decode"):
            return convention
    raise QtoolError(
        f"weight {weight.name!r}: qtool cannot decode the {weight.convention} convention yet",
        hint="inspect shows it; dequantizing it needs a newer qtool",
    )
