"""Toolchain conventions: which stored tensors make up which logical weight, and how.

Each convention claims tensors from a shared pool, in the fixed order of `REGISTRY`; `plain`
comes last and takes whatever is left, so every stored tensor belongs to exactly one weight.
"""

from __future__ import annotations

from qtool.conventions.base import Convention, Pool
from qtool.conventions.compressed_tensors import CompressedTensors
from qtool.conventions.fp8 import Fp8
from qtool.conventions.plain import Plain
from qtool.formats.checkpoint import Checkpoint
from qtool.patterns import natural_key
from qtool.weight import Weight

__all__ = ["REGISTRY", "resolve", "Convention", "ClaimConflict"]

REGISTRY: tuple[Convention, ...] = (CompressedTensors(), Fp8(), Plain())


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
