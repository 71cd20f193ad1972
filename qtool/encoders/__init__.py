"""Which kernel encodes a job: encoder backends register here by capability, and the executor
(and a layout checking a plan) asks `choose` / `can_encode`. Adding a backend (CUDA, another C
kernel) is one entry in `_BACKENDS`.

    backend        writes                                   where
    moved          a quantized input's own codes, repacked for the target (`Moved`, qtool convert)  any device
    precomputed    the tensors a calibration stage encoded before the run (`Precomputed`)   any device
    native-int     compressed-tensors pack-quantized int2/4/8 rows (`IntRows`), fused   CPU, float input
    native-gguf    GGML blocks qtool's C kernels have (Q8_0 ... Q6_K, IQ2/3/4 types)     CPU; any device for the
                                                                                          types only they write
    gguf-py        GGML blocks gguf-py's numpy quantizer has (Q8_0, Q4_0 ... Q5_1, MXFP4) any device (values to CPU)
    torch          any safetensors layout's own `encode_tensors`, in row chunks           any device

The first backend in this order that can encode a job wins; every backend writes the same
bytes (each C kernel is tested bit for bit against the reference it stands in for). An encoder
may hand a job on to the next capable backend (`choose(..., after=...)`): the native int kernel
does for a weight holding inf or NaN, whose exact semantics are torch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable, Iterator

from qtool.plan import QUANTIZE, GgmlBlocks, IntRows, Job, Moved, Piece, Precomputed, TensorLayout

if TYPE_CHECKING:
    from qtool.error_measures import ErrorStats
    from qtool.layouts.base import Layout

__all__ = ["WeightEncoder", "choose", "can_encode", "why_not_encodable", "RAW", "TENSOR", "CODES", "StoredBlocks"]

# what an encoder takes: the weight's stored bytes, float values in torch, or a quantized weight's
# own integer codes (`qtool.weight_codes.IntCodes`, from its convention's `codes`)
RAW, TENSOR, CODES = "raw", "tensor", "codes"


@dataclass(frozen=True)
class StoredBlocks:
    """A quantized weight's GGUF blocks as stored (`type`, raw bytes in `data`), handed to an
    encoder whose `transcodes(weight)` said it takes them in place of the decoded float32
    values (RAW): the native GGUF encoder decodes them row by row as it encodes."""

    type: str
    data: Any


class WeightEncoder(Protocol):
    """One weight's encoder on one backend. `encode` takes what `takes` names (RAW: the stored
    bytes of the weight; TENSOR: a float torch tensor on the run's device) and yields the pieces
    to write; after it is exhausted, `errors` holds the weight's error against the original
    (None when not measured)."""

    takes: str
    errors: ErrorStats | None

    def encode(self, values: Any) -> Iterator[Piece]: ...


@dataclass(frozen=True)
class _Backend:
    name: str
    can: Callable[[Any, Job, str | None], bool]  # (layout, job, device or None for any) -> capable
    build: Callable[[Any, Job, str, bool], WeightEncoder]  # (layout, job, device, measure)


def _moved(layout, job: Job, device: str | None) -> bool:
    return isinstance(job.encoding, Moved) and job.weight.quantized


def _build_moved(layout, job: Job, device: str, measure: bool) -> WeightEncoder:
    from qtool.encoders.moved import MovedEncoder

    return MovedEncoder(layout, job, measure)


def _precomputed(layout, job: Job, device: str | None) -> bool:
    return isinstance(job.encoding, Precomputed) and isinstance(layout, TensorLayout)


def _build_precomputed(layout, job: Job, device: str, measure: bool) -> WeightEncoder:
    from qtool.encoders.precomputed import PrecomputedEncoder

    return PrecomputedEncoder(layout, job, measure)


def _native_int(layout, job: Job, device: str | None) -> bool:
    from qtool import native

    encoding = job.encoding
    weight = job.weight
    return (
        isinstance(encoding, IntRows) and device in (None, "cpu") and native.available() and not weight.quantized
        and weight.data.dtype.name == weight.dtype and tuple(weight.data.shape) == tuple(weight.shape)
        and encoding.bits in (2, 3, 4, 8) and weight.shape[1] * encoding.bits % 32 == 0
    )  # fmt: skip


def _build_native_int(layout, job: Job, device: str, measure: bool) -> WeightEncoder:
    from qtool.encoders.native_int import NativeIntEncoder

    return NativeIntEncoder(layout, job, measure)


def _native_gguf(layout, job: Job, device: str | None) -> bool:
    from qtool import native
    from qtool.encoders.ggml_blocks import numpy_encodes

    encoding = job.encoding
    if (
        not isinstance(encoding, GgmlBlocks)
        or not native.available()
        or encoding.type.native_encoder not in native.gguf_encode_types()
    ):
        return False
    return (
        device in (None, "cpu") or not numpy_encodes(encoding.type) or encoding.importance is not None
    )  # gguf-py has no weighted path


def _gguf_py(layout, job: Job, device: str | None) -> bool:
    from qtool.encoders.ggml_blocks import numpy_encodes

    return isinstance(job.encoding, GgmlBlocks) and numpy_encodes(job.encoding.type)


def _build_ggml_blocks(native: bool) -> Callable[[Any, Job, str, bool], WeightEncoder]:
    def build(layout, job: Job, device: str, measure: bool) -> WeightEncoder:
        from qtool.encoders.ggml_blocks import GgmlBlockEncoder

        return GgmlBlockEncoder(job, measure, native=native)

    return build


def _torch(layout, job: Job, device: str | None) -> bool:
    return isinstance(layout, TensorLayout)


def _build_torch(layout, job: Job, device: str, measure: bool) -> WeightEncoder:
    from qtool.encoders.torch_tensors import TorchEncoder

    return TorchEncoder(layout, job, measure)


_BACKENDS = (
    _Backend("moved", _moved, _build_moved),
    _Backend("precomputed", _precomputed, _build_precomputed),
    _Backend("native-int", _native_int, _build_native_int),
    _Backend("native-gguf", _native_gguf, _build_ggml_blocks(native=True)),
    _Backend("gguf-py", _gguf_py, _build_ggml_blocks(native=False)),
    _Backend("torch", _torch, _build_torch),
)


def choose(layout: Layout, job: Job, device: str, measure: bool, *, after: str | None = None) -> WeightEncoder:
    """The encoder of the first capable backend (after the one named `after`, for a hand-on)."""
    backends = _BACKENDS
    if after is not None:
        backends = backends[[b.name for b in backends].index(after) + 1 :]
    for backend in backends:
        if backend.can(layout, job, device):
            return backend.build(layout, job, device, measure)
    from qtool.errors import InternalError

    raise InternalError(
        f"no encoder for {job.weight.name} ({job.outputs[0].dtype}) in the {layout.name} layout: the plan should have refused it"
    )


def can_encode(layout: Layout, job: Job) -> bool:
    """Whether some backend encodes this job on some device (a plan checks before writing)."""
    return job.action != QUANTIZE or any(backend.can(layout, job, None) for backend in _BACKENDS)


def why_not_encodable(job: Job) -> str:
    """Why no backend here encodes a GGML type (for the plan's refusal)."""
    from qtool import native

    if not native.available():
        return "qtool's C kernels are not available (not built, or QTOOL_NATIVE=0)"
    name = job.encoding.type.name if isinstance(job.encoding, GgmlBlocks) else job.outputs[0].dtype
    return f"qtool's C kernels have no {name} encoder in this build"
