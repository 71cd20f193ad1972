"""What `qtool inspect` reports: the weights, their summary, and the JSON contract (v1).

The JSON shape is a contract with CI scripts and is documented in the README. Change it only
by adding fields, or by bumping `SCHEMA_VERSION`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from qtool.conventions import resolve
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.gcpause import paused_gc
from qtool.patterns import compile_pattern
from qtool.weight import Provenance, Weight

if TYPE_CHECKING:
    from qtool.scheme import QScheme

__all__ = [
    "SCHEMA_VERSION",
    "PLAIN_LABEL",
    "Inspection",
    "WeightStats",
    "inspect_checkpoint",
    "scheme_json",
    "weight_json",
]

SCHEMA_VERSION = 1
PLAIN_LABEL = "plain"  # the by_scheme key for weights that are not quantized

WeightStats = Mapping[str, "float | int | None"]  # min, max, mean, std, absmax, nan, inf (qtool.value_stats)


@dataclass(frozen=True, eq=False)  # eq=False: compared by identity, as the Checkpoint it holds
class Inspection:
    """The weights of a checkpoint that a report covers, and what is known about them.

    Immutable: `weights` is a tuple and `stats` a read-only mapping; `with_stats` returns a new
    Inspection. Everything derived (`summary`, `tensors`, `conventions`) is computed from the
    weights reported, so a filtered report describes exactly the weights it lists.
    """

    checkpoint: Checkpoint
    weights: tuple[Weight, ...]
    stats: Mapping[str, WeightStats | None] = field(default_factory=dict)  # weight name -> stats (`--stats`)
    filter: str | None = None  # the pattern `weights` were kept by; None: every weight

    def __post_init__(self) -> None:
        # frozen: the normalised fields are set through object.__setattr__, once, here
        object.__setattr__(self, "weights", tuple(self.weights))
        object.__setattr__(
            self, "stats", MappingProxyType({name: _frozen(entry) for name, entry in self.stats.items()})
        )

    def with_stats(self, stats: Mapping[str, WeightStats | None]) -> Inspection:
        """A new Inspection with `stats` added to (and overriding) the ones already known."""
        return replace(self, stats={**self.stats, **stats})

    @property
    def conventions(self) -> list[str]:
        counts = Counter(w.convention for w in self.weights)
        return sorted(counts, key=lambda c: (c == "plain", c))

    @property
    def tensors(self) -> tuple[StoredTensor, ...]:
        """The stored tensors of the weights reported (every member), in the file's order."""
        members = {t.name: t for w in self.weights for t in w.members.values()}
        ordered = [members.pop(name) for name in self.checkpoint.tensors if name in members]
        return (*ordered, *members.values())  # a member the container does not list: last

    def summary(self) -> dict[str, Any]:
        """Counts and sizes over the weights reported and their member tensors only. One pass
        over each, with plain locals: a header may list 1.6M tensors."""
        tensors = self.tensors
        total_bytes = 0
        by_dtype: dict[str, dict[str, int]] = {}
        for tensor in tensors:
            nbytes = tensor.end - tensor.begin
            total_bytes += nbytes
            counts = by_dtype.get(tensor.dtype.name)
            if counts is None:
                counts = by_dtype[tensor.dtype.name] = {"tensors": 0, "bytes": 0}
            counts["tensors"] += 1
            counts["bytes"] += nbytes
        parameters = quantized = 0
        by_scheme: dict[str, dict[str, int]] = {}
        prod = math.prod
        for weight in self.weights:
            count = prod(weight.shape)
            parameters += count
            scheme = weight.scheme
            if scheme is not None:
                quantized += 1
            label = scheme.label if scheme is not None else PLAIN_LABEL
            entry = by_scheme.get(label)
            if entry is None:
                entry = by_scheme[label] = {"weights": 0, "parameters": 0}
            entry["weights"] += 1
            entry["parameters"] += count
        return {
            "tensors": len(tensors),
            "weights": len(self.weights),
            "quantized_weights": quantized,
            "parameters": parameters,
            "bytes": total_bytes,
            "bits_per_weight": round(total_bytes * 8 / parameters, 4) if parameters else 0.0,
            "by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1]["bytes"])),
            "by_scheme": dict(sorted(by_scheme.items(), key=lambda kv: -kv[1]["parameters"])),
        }

    def to_json(self, lazy: bool = False) -> dict[str, Any]:
        """The JSON document (schema v1). `lazy`: "weights" is an iterator of the entries, made
        one at a time as they are written (`Output` streams it), so 1.6M weights never exist
        as dicts all at once."""
        weights = self.weights_json()
        result = {
            "schema_version": SCHEMA_VERSION,
            "path": self.checkpoint.path,
            "format": self.checkpoint.format,
            "files": list(self.checkpoint.files),
            "metadata": dict(self.checkpoint.metadata),
            "conventions": self.conventions,
            "summary": self.summary(),
            "weights": weights if lazy else list(weights),
        }
        if self.filter is not None:
            result["filter"] = self.filter
        if self.checkpoint.notes:  # how a folder was resolved, when it held other weights files
            result["notes"] = list(self.checkpoint.notes)
        return result

    def weights_json(self) -> Iterator[dict[str, Any]]:
        """The document's "weights" entries, in order, each with its stats when there are any."""
        stats = self.stats
        for weight in self.weights:
            entry = weight_json(weight)
            if stats:
                found = stats.get(weight.name)
                entry["stats"] = None if found is None else dict(found)
            yield entry


def _frozen(entry: WeightStats | None) -> WeightStats | None:
    return None if entry is None else MappingProxyType(dict(entry))


def scheme_json(scheme: QScheme, shape: tuple[int, ...], provenance: Provenance) -> dict[str, Any]:
    """A weight's scheme as the JSON contract shows it: the math, then where it was read from
    (`convention`, and the toolchain's own `details`: format, desc_act, gguf_type, ...)."""
    granularity = scheme.granularity
    return {
        "label": scheme.label,
        "qtype": scheme.qtype.name,
        "bits": scheme.bits,
        "kind": scheme.qtype.kind,
        "symmetric": scheme.symmetric,
        "granularity": granularity,
        "block": None if granularity == "tensor" else list(scheme.block_for(shape)),
        "group_size": scheme.group_size,
        "scale_dtype": scheme.scale_dtype,
        "zero_point": scheme.zero_point,
        "convention": provenance.convention,
        "details": dict(provenance.details),
    }


def weight_json(weight: Weight) -> dict[str, Any]:
    """One entry of the document's "weights"; plain locals, as 1.6M weights make this hot."""
    shape = weight.shape
    parameters = math.prod(shape)
    nbytes = 0
    tensors = []
    for role, tensor in weight.members.items():
        nbytes += tensor.end - tensor.begin
        tensors.append({"name": tensor.name, "role": role, "dtype": tensor.dtype.name, "shape": list(tensor.shape)})
    scheme = weight.scheme
    return {
        "name": weight.name,
        "shape": list(shape),
        "dtype": weight.dtype,
        "parameters": parameters,
        "bytes": nbytes,
        "bits_per_weight": round(nbytes * 8 / parameters, 4) if parameters else 0.0,
        "quantized": scheme is not None,
        "scheme": scheme_json(scheme, shape, weight.provenance) if scheme is not None else None,
        "tensors": tensors,
        "notes": list(weight.notes),
    }


def inspect_checkpoint(checkpoint: Checkpoint, filter: str | None = None) -> Inspection:
    """Every weight of `checkpoint`, from the headers alone; with `filter` (a glob matching the
    whole name, or `re:` and a regex anchored at the start, see `qtool.patterns`), only the
    weights whose logical name matches, and the summary covers only those.

    Conventions still resolve the whole checkpoint first: which tensors make up a weight does
    not depend on which weights are reported."""
    with paused_gc():  # one Weight per tensor and no cycles (qtool.gcpause)
        weights: Iterable[Weight] = resolve(checkpoint)
    if filter is not None:
        keep = compile_pattern(filter)
        weights = [w for w in weights if keep(w.name)]
    return Inspection(checkpoint, tuple(weights), filter=filter)
