"""What `qtool inspect` reports: the weights, their summary, and the JSON contract (v1).

The JSON shape is a contract with CI scripts and is documented in the README. Change it only
by adding fields, or by bumping `SCHEMA_VERSION`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from qtool.conventions import resolve
from qtool.formats.checkpoint import Checkpoint
from qtool.scheme import QScheme
from qtool.weight import Weight

__all__ = ["SCHEMA_VERSION", "PLAIN_LABEL", "Inspection", "inspect_checkpoint", "scheme_json", "weight_json"]

SCHEMA_VERSION = 1
PLAIN_LABEL = "plain"  # the by_scheme key for weights that are not quantized


@dataclass
class Inspection:
    checkpoint: Checkpoint
    weights: list[Weight]
    stats: dict[str, dict[str, float | int] | None] = field(default_factory=dict)  # weight name -> stats

    @property
    def conventions(self) -> list[str]:
        counts = Counter(w.convention for w in self.weights)
        return sorted(counts, key=lambda c: (c == "plain", c))

    def summary(self) -> dict[str, Any]:
        tensors = list(self.checkpoint.tensors.values())
        total_bytes = sum(t.nbytes for t in tensors)
        parameters = sum(w.parameters for w in self.weights)
        by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
        for tensor in tensors:
            by_dtype[tensor.dtype.name]["tensors"] += 1
            by_dtype[tensor.dtype.name]["bytes"] += tensor.nbytes
        by_scheme: dict[str, dict[str, int]] = defaultdict(lambda: {"weights": 0, "parameters": 0})
        for weight in self.weights:
            label = weight.scheme.label if weight.scheme else PLAIN_LABEL
            by_scheme[label]["weights"] += 1
            by_scheme[label]["parameters"] += weight.parameters
        return {
            "tensors": len(tensors),
            "weights": len(self.weights),
            "quantized_weights": sum(1 for w in self.weights if w.quantized),
            "parameters": parameters,
            "bytes": total_bytes,
            "bits_per_weight": round(total_bytes * 8 / parameters, 4) if parameters else 0.0,
            "by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1]["bytes"])),
            "by_scheme": dict(sorted(by_scheme.items(), key=lambda kv: -kv[1]["parameters"])),
        }

    def to_json(self) -> dict[str, Any]:
        result = {
            "schema_version": SCHEMA_VERSION,
            "path": self.checkpoint.path,
            "format": self.checkpoint.format,
            "files": list(self.checkpoint.files),
            "metadata": dict(self.checkpoint.metadata),
            "conventions": self.conventions,
            "summary": self.summary(),
            "weights": [weight_json(w) for w in self.weights],
        }
        if self.stats:
            for entry in result["weights"]:
                entry["stats"] = self.stats.get(entry["name"])
        return result


def scheme_json(scheme: QScheme, shape: tuple[int, ...]) -> dict[str, Any]:
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
        "convention": scheme.convention,
        "details": {key: value for key, value in scheme.extra},  # convention facts: format, desc_act, ...
    }


def weight_json(weight: Weight) -> dict[str, Any]:
    return {
        "name": weight.name,
        "shape": list(weight.shape),
        "dtype": weight.dtype,
        "parameters": weight.parameters,
        "bytes": weight.nbytes,
        "bits_per_weight": round(weight.bits_per_weight, 4),
        "quantized": weight.quantized,
        "scheme": scheme_json(weight.scheme, weight.shape) if weight.scheme else None,
        "tensors": [
            {"name": t.name, "role": role, "dtype": t.dtype.name, "shape": list(t.shape)}
            for role, t in weight.members.items()
        ],
        "notes": list(weight.notes),
    }


def inspect_checkpoint(checkpoint: Checkpoint) -> Inspection:
    return Inspection(checkpoint, resolve(checkpoint))
