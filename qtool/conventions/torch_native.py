"""PyTorch's native quantized tensors, as pickles hold them (CONVENTIONS §9).

    t.qscheme()                           stored tensors (qtool.formats.torch_pickle)
    per_tensor_affine                     <name>  int_repr bytes; scale, zero point pickled inline
    per_channel_affine (axis a)           <name>, <name>.q_per_channel_scales (F64),
                                          <name>.q_per_channel_zero_points (I64)
    per_channel_affine_float_qparams      <name>, scales F32 and zero points F32 (embeddings)

    x = (q - zero_point) * scale, per tensor or per slice along `axis`

`qtool.formats.torch_pickle` marks each with `encoding = "torch.<qscheme>"` and keeps its
quantizer as pickled (`TorchCheckpoint.quantization`): detecting needs no torch, and reads only
the zero points of per-channel qint8/qint32 tensors. A dynamic-quantized `nn.Linear` state dict
holds `{m}._packed_params._packed_params` = (qint8 weight, bias): that tuple is one weight,
reported as `{m}.weight`, and its bias as the plain weight `{m}.bias`. (`{m}.scale` and
`{m}.zero_point`, a static Linear's output qparams, are plain tensors.)

Decoding rebuilds the torch quantized tensor from its stored bytes and quantizer
(`TorchCheckpoint.quantized_tensor`) and calls PyTorch's own `t.dequantize()`, so it matches
PyTorch bit for bit by construction; it gives float32, cast once to the requested dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.conventions.base import Pool, require_convention
from qtool.errors import CheckpointError, InternalError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.message_text import excerpt
from qtool.qtypes import QType, qtype
from qtool.scheme import TENSOR, QScheme
from qtool.weight import DATA, PLAIN, Provenance, Weight

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
        if checkpoint.format != "torch" or not hasattr(checkpoint, "quantization"):
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
    info = checkpoint.quantization(tensor)
    qscheme = info.qscheme
    torch_dtype = info.dtype
    shape = tuple(tensor.logical_shape or tensor.shape)
    members = {DATA: tensor}
    for role, suffix in (("scale", ".q_per_channel_scales"), ("zero_point", ".q_per_channel_zero_points")):
        member = pool.get(tensor.name + suffix)
        if member is not None:
            members[role] = member
    details: list[tuple[str, str]] = [("qscheme", qscheme), ("torch_dtype", torch_dtype)]
    notes: list[str] = []
    if qscheme == "per_tensor_affine" and info.scale is not None and info.zero_point is not None:
        block = TENSOR if len(shape) >= 2 else (None,)
        scale_dtype = "F64"  # a Python float: the quantizer keeps it as a double
        zero_points = [info.zero_point]
        details += [("scale", repr(info.scale)), ("zero_point", str(info.zero_point))]
        notes.append(f"scale {info.scale!r} and zero point {info.zero_point} are pickled inline")
    elif (
        qscheme in ("per_channel_affine", "per_channel_affine_float_qparams")
        and info.axis is not None
        and "zero_point" in members
    ):
        axis = info.axis
        block = tuple(1 if dim == axis else None for dim in range(len(shape)))
        scale_dtype = members["scale"].dtype.name if "scale" in members else "F64"
        needed = qscheme == "per_channel_affine" and torch_dtype in _MIDPOINT
        zero_points = _integers(checkpoint, members["zero_point"]) if needed else [None]
        details.append(("axis", str(axis)))
    else:
        note = f"PyTorch qscheme {qscheme} ({torch_dtype}): qtool does not read this layout"
        return [Weight(tensor.name, shape, tensor.dtype.name, members, None, PLAIN, [note])]
    value = qtype(_VALUE_TYPES[torch_dtype]) if torch_dtype in _VALUE_TYPES else _INT32
    midpoint = _MIDPOINT.get(torch_dtype)
    symmetric = midpoint is not None and all(z == midpoint for z in zero_points)
    scheme = QScheme(
        qtype=value,
        block=block,
        symmetric=symmetric,
        scale_dtype=scale_dtype,
        zero_point=True,
    )
    provenance = Provenance(NAME, details=tuple(details))
    if tensor.name.endswith(PACKED + ".0"):
        module = tensor.name[: -len(PACKED + ".0")]
        weights = [Weight(f"{module}.weight", shape, "F32", members, scheme, provenance, notes)]
        bias = pool.get(f"{module}{PACKED}.1")
        if bias is not None:
            weights.append(Weight(f"{module}.bias", bias.shape, bias.dtype.name, {DATA: bias}, None, PLAIN, []))
        return weights
    return [Weight(tensor.name, shape, "F32", members, scheme, provenance, notes)]


def _integers(checkpoint, tensor: StoredTensor) -> list[int | None]:
    """A per-channel zero-point tensor's values (I64 or I32), read without torch."""
    import numpy as np

    kind = {"I64": "<i8", "I32": "<i4", "I8": "i1", "U8": "u1"}.get(tensor.dtype.name)
    if kind is None:
        return [None]
    return np.frombuffer(bytes(checkpoint.read_bytes(tensor)), dtype=kind).tolist()


def decode(checkpoint: Checkpoint, weight: Weight, device: str | torch.device = "cpu") -> torch.Tensor:
    """PyTorch's own `dequantize()` of the tensor rebuilt from its bytes: float32, on `device`."""
    require_convention(weight, NAME)
    if not hasattr(checkpoint, "quantized_tensor"):
        raise InternalError(
            f"{weight.name} is a PyTorch native quantized tensor, but its checkpoint is not a PyTorch pickle"
        )
    tensor = checkpoint.quantized_tensor(weight.data)
    try:
        values = tensor.dequantize()
    except RuntimeError as exc:  # torch checks the pickled quantizer here: the file's fault
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise CheckpointError(
            f"quantized tensor {weight.data.name!r} does not dequantize: {excerpt(first)}", path=weight.data.file
        ) from None
    return values.to(device)
