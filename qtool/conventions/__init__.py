"""Toolchain conventions: which stored tensors make up which logical weight, and how.

Each convention claims tensors from a shared pool, in the fixed order of `REGISTRY`; `plain`
comes last and takes whatever is left, so every stored tensor belongs to exactly one weight.
A convention that qtool also writes provides `encode` / `encoded_layout` / `config_for` in its
module; `encoder_for(scheme)` finds them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
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
from qtool.errors import QtoolError
from qtool.formats.checkpoint import Checkpoint
from qtool.patterns import natural_key
from qtool.scheme import QScheme
from qtool.weight import Weight

__all__ = ["REGISTRY", "resolve", "Convention", "ClaimConflict", "Encoder", "encoder_for", "decoder_for"]

REGISTRY: tuple[Convention, ...] = (CompressedTensors(), Fp8(), Bitsandbytes(), Gguf(), Gptq(), Awq(), Mlx(), Quanto(), GptOssMxfp4(), Torchao(), TorchNative(), Burn(), Plain())


class ClaimConflict(RuntimeError):
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


_WRITERS = {"compressed-tensors": "qtool.conventions.compressed_tensors_encode", "bitsandbytes": "qtool.conventions.bitsandbytes"}


@dataclass(frozen=True)
class Encoder:
    """A convention's writer: the layout to plan, the tensors to write, the config to record."""

    module: ModuleType
    convention: Any

    def encoded_layout(self, name: str, shape: tuple[int, ...], dtype: str, scheme: QScheme):
        return self.module.encoded_layout(name, shape, dtype, scheme)

    def encode(self, name: str, weight, scheme: QScheme) -> dict[str, Any]:
        return self.module.encode(name, weight, scheme)

    def config_for(self, schemes: dict[str, QScheme], ignore: list[str], dtype: str) -> dict[str, Any]:
        return self.module.config_for(schemes, ignore, dtype)

    def reconstruct(self, name: str, encoded: dict[str, Any], scheme: QScheme, shape: tuple[int, ...], dtype: str):
        """Decode freshly encoded tensors through this convention's own reader."""
        from qtool.formats.memory import MemoryCheckpoint

        module_name = name.rpartition(".")[0]
        config = {"quantization_config": self.config_for({module_name: scheme}, [], dtype)}
        checkpoint = MemoryCheckpoint(encoded, {"config.json": config})
        weights = [w for w in self.convention.detect(checkpoint, dict(checkpoint.tensors)) if w.quantized]
        if len(weights) != 1 or weights[0].shape != tuple(shape):
            raise RuntimeError(f"{name}: qtool cannot read back what it encoded ({[(w.name, w.shape) for w in weights]})")
        device = next(iter(encoded.values())).device
        return self.convention.decode(checkpoint, weights[0], device)


def encoder_for(scheme: QScheme) -> Encoder:
    module_name = _WRITERS.get(scheme.convention)
    if module_name is None:
        raise QtoolError(f"qtool cannot write the {scheme.convention} layout ({scheme.label}) yet")
    module = importlib.import_module(module_name)
    convention = next(c for c in REGISTRY if c.name == scheme.convention)
    return Encoder(module, convention)
