"""PyTorch's native quantized tensors, as pickles hold them (CONVENTIONS §9).

    t.qscheme()                           stored tensors (qtool.formats.torch_pickle)
    per_tensor_affine                     <name>  int_repr bytes; scale, zero point pickled inline
    per_channel_affine (axis a)           <name>, <name>.q_per_channel_scales (F64),
                                          <name>.q_per_channel_zero_points (I64)
    per_channel_affine_float_qparams      <name>, scales F32 and zero points F32 (embeddings)

    x = (q - zero_point) * scale, per tensor or per slice along `axis`

`qtool.formats.torch_pickle` marks each with `encoding = "torch.<qscheme>"`, having asked
`qscheme()` only of tensors that are `is_quantized`. A dynamic-quantized `nn.Linear` state dict
holds `{m}._packed_params._packed_params` = (qint8 weight, bias): that tuple is one weight,
reported as `{m}.weight`, and its bias as the plain weight `{m}.bias`. (`{m}.scale` and
`{m}.zero_point`, a static Linear's output qparams, are plain tensors.)

Decoding is PyTorch's own `t.dequantize()` on the loaded tensor, so it matches PyTorch bit for
bit by construction; it gives float32, cast once to the requested dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.conventions.base import Pool
from qtool.errors import UsageError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.scheme import TENSOR, QScheme, QType, qtype
from qtool.weight import DATA, Weight

if TYPE_CHECKING:
    import torch

__all__ = ["TorchNative", "NAME", "decode"]

NAME = "torch-native"
PACKED = "._packed_params._packed_params"
_PREFIX = "torch."
_VALUE_TYPES = {"qint8": "int8", "quint8": "uint8", "quint4x2": "uint4", "quint2x4": "uint2"}
_INT32 = QType("int32", 32, "int", -(2**31), 2**31 - 1)
# the integer value each dtype reads as zero: a zero point there means a symmetric grid
_MIDPOINT = {"qint8": 0, "qint32": 0}


class TorchNative:
    name = NAME

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        if checkpoint.format != "torch" or not hasattr(checkpoint, "original"):
            return []
        weights: list[Weight] = []
        for tensor in list(pool.values()):
            if not (tensor.encoding or "").startswith(_PREFIX) or tensor.name not in pool:
                continue
            weights.extend(_weights(checkpoint, pool, tensor))
        return weights

    def decode(self, checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
        return decode(checkpoint, weight, device)


def _weights(checkpoint, pool: Pool, tensor: StoredTensor) -> list[Weight]:
    original = checkpoint.original(tensor)
    qscheme = (tensor.encoding or "")[len(_PREFIX) :]
    torch_dtype = str(original.dtype).removeprefix("torch.")
    shape = tuple(tensor.logical_shape or tensor.shape)
    members = {DATA: tensor}
    for role, suffix in (("scale", ".q_per_channel_scales"), ("zero_point", ".q_per_channel_zero_points")):
        member = pool.get(tensor.name + suffix)
        if member is not None:
            members[role] = member
    extra: list[tuple[str, str]] = [("qscheme", qscheme), ("torch_dtype", torch_dtype)]
    notes: list[str] = []
    if qscheme == "per_tensor_affine":
        block = TENSOR if len(shape) >= 2 else (None,)
        scale_dtype = "F64"  # a Python float: the quantizer keeps it as a double
        zero_points = [int(original.q_zero_point())]
        extra += [("scale", repr(float(original.q_scale()))), ("zero_point", str(zero_points[0]))]
        notes.append(f"scale {float(original.q_scale())!r} and zero point {zero_points[0]} are pickled inline")
    elif qscheme in ("per_channel_affine", "per_channel_affine_float_qparams"):
        axis = int(original.q_per_channel_axis())
        block = tuple(1 if dim == axis else None for dim in range(len(shape)))
        scale_dtype = members["scale"].dtype.name if "scale" in members else "F64"
        zero_points = original.q_per_channel_zero_points().tolist() if qscheme == "per_channel_affine" else [None]
        extra.append(("axis", str(axis)))
    else:
        note = f"PyTorch qscheme {qscheme} ({torch_dtype}): qtool does not read this layout"
        return [Weight(tensor.name, shape, tensor.dtype.name, members, None, "plain", [note])]
    value = qtype(_VALUE_TYPES[torch_dtype]) if torch_dtype in _VALUE_TYPES else _INT32
    midpoint = _MIDPOINT.get(torch_dtype)
    symmetric = midpoint is not None and all(z == midpoint for z in zero_points)
    scheme = QScheme(
        qtype=value,
        block=block,
        symmetric=symmetric,
        scale_dtype=scale_dtype,
        zero_point=True,
        convention=NAME,
        extra=tuple(extra),
    )
    if tensor.name.endswith(PACKED + ".0"):
        module = tensor.name[: -len(PACKED + ".0")]
        weights = [Weight(f"{module}.weight", shape, "F32", members, scheme, NAME, notes)]
        bias = pool.get(f"{module}{PACKED}.1")
        if bias is not None:
            weights.append(Weight(f"{module}.bias", bias.shape, bias.dtype.name, {DATA: bias}, None, "plain", []))
        return weights
    return [Weight(tensor.name, shape, "F32", members, scheme, NAME, notes)]


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """PyTorch's own `dequantize()` of the loaded tensor: float32, on `device`."""
    scheme = weight.require_scheme()
    if scheme.convention != NAME or not hasattr(checkpoint, "original"):
        raise UsageError(f"{weight.name} is a {scheme.convention} weight, not a PyTorch native quantized tensor")
    return checkpoint.original(weight.data).dequantize().to(device)
