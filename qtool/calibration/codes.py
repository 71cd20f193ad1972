"""What a quantizing calibration step makes (GPTQ, AWQ, round to nearest): each calibrated
weight's integer codes, set into the layer as their dequantized values (so the layer's next
run sees the quantized weight) and packed as compressed-tensors' tensors into `Calibration`
(spilled to disk as each layer finishes, `qtool.calibration.spill`); and the rounding each step
takes of a weight's scheme."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qtool.errors import SchemeError

if TYPE_CHECKING:
    import torch

    from qtool.scheme import QScheme

__all__ = [
    "Calibration",
    "LayerResult",
    "check_scheme",
    "new_spill",
    "store",
    "round_to_nearest",
    "rounding",
    "group_of",
    "rtn_values",
]


@dataclass
class LayerResult:
    index: int
    seconds: float
    output_error: float  # sum (y_quantized - y_float)^2 / sum y_float^2 over the calibration samples
    weights: list[str]
    unrouted: list[str] = field(default_factory=list)  # experts no calibration token reached: rounded to nearest

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.index, "seconds": round(self.seconds, 3), "output_rel_mse": self.output_error,
            "weights": list(self.weights), "unrouted": list(self.unrouted),
        }  # fmt: skip


@dataclass
class Calibration:
    """What calibration produced: each calibrated weight's layout tensors, and per layer its
    time and output error."""

    algorithm: str
    samples: int
    seq_len: int
    seed: int
    encoded: dict[str, dict[str, Any]] = field(default_factory=dict)
    # float tensors the calibration changed but does not quantize (AWQ's smoothed norms), float32 on the CPU
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)
    layers: list[LayerResult] = field(default_factory=list)
    seconds: float = 0.0
    spill: Any = None  # qtool.calibration.spill.Spill: where `encoded`'s tensors wait, on disk; None: in memory

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "samples": self.samples,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "seconds": round(self.seconds, 3),
            "layers": [layer.to_json() for layer in self.layers],
        }


def check_scheme(name: str, scheme: QScheme) -> None:
    """GPTQ and AWQ here write int2..int8 per channel or per group."""
    if scheme.qtype.kind != "int" or not 2 <= scheme.qtype.bits <= 8 or scheme.granularity not in ("channel", "group"):
        raise SchemeError(
            f"GPTQ and AWQ calibrate int2..int8 per channel or per group, not {scheme.label} ({name})",
            hint="use e.g. W4A16, int4:g64:asym or int8:channel",
        )


def new_spill():
    """A spill file for the codes, or None (kept in memory) where no temporary file can be made."""
    from qtool.calibration.spill import Spill

    try:
        return Spill()
    except OSError:
        return None


def _scale_dtype(scheme: QScheme, dtype: str):
    from qtool.dtypes import storage_dtype
    from qtool.layouts.compressed_tensors import scale_storage

    return storage_dtype(scale_storage(scheme, dtype)).torch_dtype()


def store(name: str, module, codes, scheme: QScheme, dtype: str, result: Calibration) -> None:
    """The codes into the layer (the next layer sees the quantized outputs) and the layout's tensors."""
    from qtool.layouts.compressed_tensors import pack_int_codes

    module.weight.data = codes.dequantized().to(module.weight.device)
    packed = pack_int_codes(name, codes.codes, codes.scale, codes.zero_point, scheme, dtype)
    if result.spill is not None:
        try:
            result.encoded[name] = result.spill.store(packed)
            return
        except OSError:  # the temporary directory full: the codes from here on stay in memory
            result.spill = None
    result.encoded[name] = {k: v.cpu() for k, v in packed.items()}


def round_to_nearest(name: str, module, scheme: QScheme, dtype: str, result: Calibration) -> None:
    """The weight rounded to nearest (`awq.rtn`), stored as `store` stores codes."""
    from qtool.calibration import awq

    store(name, module, awq.rtn(module.weight.data, **rounding(scheme, dtype)), scheme, dtype, result)


def group_of(scheme: QScheme) -> int | None:
    """The scheme's quantization group (columns), None per channel."""
    return scheme.group_size if scheme.granularity == "group" else None


def rounding(scheme: QScheme, dtype: str) -> dict[str, Any]:
    """What GPTQ and round to nearest take of `scheme` (a weight of `dtype`): the integer
    width, the group, symmetry, the stored scale dtype and the observer that chooses the scales."""
    return {
        "bits": scheme.qtype.bits, "group_size": group_of(scheme), "symmetric": scheme.symmetric,
        "scale_dtype": _scale_dtype(scheme, dtype), "observer": scheme.observer,
    }  # fmt: skip


def rtn_values(weight, **rounding):
    """The rounded-to-nearest values of `weight` (`awq.rtn`, dequantized in its dtype)."""
    from qtool.calibration import awq

    return awq.rtn(weight, **rounding).dequantized(weight.dtype)
