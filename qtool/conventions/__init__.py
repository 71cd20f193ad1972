"""Toolchain conventions: which stored tensors make up which logical weight, and how.

Each convention claims tensors from a shared pool, in the fixed order of `REGISTRY`; `plain`
comes last and takes whatever is left, so every stored tensor belongs to exactly one weight.
The write side of the toolchains qtool writes lives in `qtool.layouts`.

Conventions load lazily. Importing all of them cost ~0.14 s, most of `qtool inspect`'s start-up,
and each walks the whole pool, which a header of 1.6M tensors makes slow. So `resolve` first
asks a cheap question per convention (`_Entry.may_claim`: the container format, or a leaf name
its layout needs, found by one substring search over all names) and imports and runs only the
ones that can claim something. When a side file or the metadata carries quantization settings,
every convention runs, as each reads its own config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from qtool.conventions.base import Convention, Pool
from qtool.conventions.plain import Plain
from qtool.errors import ClaimConflict, QtoolError
from qtool.formats.checkpoint import Checkpoint
from qtool.patterns import natural_key
from qtool.weight import Weight

__all__ = ["REGISTRY", "resolve", "Convention", "ClaimConflict", "decoder_for", "convention_named"]


class _Names:
    """Every tensor name of the pool, joined once, so "does any name end with `.qweight`?" is
    one substring search. A newline inside a name can only make a search say yes wrongly, which
    costs a convention run, never a missed claim."""

    def __init__(self, pool: Pool) -> None:
        self.text = "\n" + "\n".join(pool) + "\n"

    def has_leaf(self, *leaves: str) -> bool:
        """Some name is `leaf` or ends with `.leaf`."""
        text = self.text
        return any(f".{leaf}\n" in text or f"\n{leaf}\n" in text for leaf in leaves)

    def has(self, *fragments: str) -> bool:
        text = self.text
        return any(fragment in text for fragment in fragments)


ClaimSignal = Callable[[Checkpoint, _Names], bool]  # whether a convention may claim anything here


@dataclass(frozen=True)
class _Entry:
    name: str  # Convention.name, also Weight.convention
    module: str
    cls: str
    may_claim: ClaimSignal  # False only when detect() would certainly claim nothing


def _format(name: str) -> ClaimSignal:
    return lambda checkpoint, names: checkpoint.format == name


_ENTRIES: tuple[_Entry, ...] = (
    _Entry("compressed-tensors", "compressed_tensors", "CompressedTensors", lambda c, n: n.has_leaf("weight_scale")),
    _Entry("fp8", "fp8", "Fp8", lambda c, n: n.has_leaf("weight_scale", "weight_scale_inv")),
    _Entry(
        "bitsandbytes",
        "bitsandbytes",
        "Bitsandbytes",
        lambda c, n: n.has_leaf("SCB") or n.has(".quant_state.bitsandbytes__"),
    ),
    _Entry("gguf", "gguf", "Gguf", _format("gguf")),
    _Entry("gptq", "gptq", "Gptq", lambda c, n: n.has_leaf("qweight")),
    _Entry("awq", "awq", "Awq", lambda c, n: n.has_leaf("qweight")),
    _Entry("mlx", "mlx", "Mlx", lambda c, n: n.has_leaf("scales")),
    _Entry("quanto", "quanto", "Quanto", lambda c, n: n.has("._data\n")),
    _Entry("gpt-oss", "fp8", "GptOssMxfp4", lambda c, n: n.has("_blocks\n")),
    _Entry("torchao", "torchao", "Torchao", lambda c, n: c.format == "torch" or "tensor_names" in c.metadata),
    _Entry("torch-native", "torch_native", "TorchNative", _format("torch")),
    _Entry("burn", "burn", "Burn", _format("burnpack")),
)
_PLAIN = Plain()
_LOADED: dict[str, Convention] = {}

# Where a checkpoint keeps quantization settings; any of them present and every convention runs.
_CONFIG_KEYS = ("quantization_config", "quantization")
_METADATA_KEYS = ("quantization_config", "tensor_names")


def _load(entry: _Entry) -> Convention:
    convention = _LOADED.get(entry.name)
    if convention is None:
        module = importlib.import_module(f"qtool.conventions.{entry.module}")
        convention = _LOADED[entry.name] = getattr(module, entry.cls)()
    return convention


def _has_settings(checkpoint: Checkpoint) -> bool:
    config = checkpoint.config
    return (
        any(name != "config.json" for name in checkpoint.side_files)
        or any(key in config for key in _CONFIG_KEYS)
        or any(key in checkpoint.metadata for key in _METADATA_KEYS)
    )


def __getattr__(name: str) -> Any:
    if name == "REGISTRY":  # every convention, imported: for code that walks them all
        return (*(_load(entry) for entry in _ENTRIES), _PLAIN)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _candidates(checkpoint: Checkpoint, pool: Pool) -> list[Convention]:
    if _has_settings(checkpoint):
        return [_load(entry) for entry in _ENTRIES]
    names = _Names(pool)
    return [_load(entry) for entry in _ENTRIES if entry.may_claim(checkpoint, names)]


def resolve(checkpoint: Checkpoint, registry: tuple[Convention, ...] | None = None) -> list[Weight]:
    """Every stored tensor, folded into logical weights, sorted by name (`layers.2` before
    `layers.10`). `registry` replaces the conventions asked (all of them run, in its order)."""
    pool: Pool = dict(checkpoint.tensors)
    conventions = [*_candidates(checkpoint, pool), _PLAIN] if registry is None else list(registry)
    weights: list[Weight] = []
    for convention in conventions:
        claimed = convention.detect(checkpoint, pool)
        for weight in claimed:
            for member in weight.members.values():
                if pool.pop(member.name, None) is None:
                    raise ClaimConflict(f"{convention.name} claimed {member.name!r}, which is not in the pool")
        weights.extend(claimed)
    weights.sort(key=lambda w: natural_key(w.name))
    return weights


def convention_named(name: str) -> Convention | None:
    """The convention called `name` (Weight.convention), imported on first use; None if none is."""
    if name == _PLAIN.name:
        return _PLAIN
    for entry in _ENTRIES:
        if entry.name == name:
            return _load(entry)
    return None


def decoder_for(weight: Weight) -> Any:
    """The convention that decodes `weight` to float: `.decode(checkpoint, weight, device)`."""
    convention = convention_named(weight.convention)
    if convention is not None and hasattr(convention, "decode"):
        return convention
    raise QtoolError(
        f"weight {weight.name!r}: qtool cannot decode the {weight.convention} convention yet",
        hint="inspect shows it; dequantizing it needs a newer qtool",
    )
