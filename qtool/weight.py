"""A logical weight: one model parameter, made of one or more stored tensors with roles."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qtool.errors import NotQuantizedError
from qtool.formats.checkpoint import StoredTensor

if TYPE_CHECKING:  # qtool.scheme is needed only where a weight is quantized
    from qtool.scheme import QScheme

__all__ = ["Weight", "Provenance", "PLAIN", "DATA"]

DATA = "data"  # the role of the tensor holding the values; every weight has one


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a weight that was read came from: the convention that folded its tensors (the
    toolchain that wrote it), how its codes sit in storage words, and the toolchain's own
    parameters (compressed-tensors `format`, GPTQ `desc_act`, GGUF `gguf_type`, ...), shown as
    the weight's details. The read side and the reports use it; the scheme, which is math
    only, and the write side never do."""

    convention: str
    packing: str | None = None  # e.g. "int32 along in, LSB first"
    details: tuple[tuple[str, str], ...] = ()

    def detail(self, key: str, default: str | None = None) -> str | None:
        return next((value for name, value in self.details if name == key), default)


PLAIN = Provenance("plain")


@dataclass(slots=True)  # slots: a header may list 1.6M weights
class Weight:
    """`members` maps a role ("data", "scale", "zero_point", "g_idx", ...) to a stored tensor.

    A plain weight has one member, `data`, and `scheme is None`. That is an ordinary value,
    not an error: code that needs a scheme asks `require_scheme()`.
    """

    name: str
    shape: tuple[int, ...]  # logical shape, PyTorch row-major order
    dtype: str  # logical dtype where the file records it, else the data tensor's storage dtype
    members: dict[str, StoredTensor]
    scheme: QScheme | None = None
    provenance: Provenance = PLAIN
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if DATA not in self.members:
            raise ValueError(f"weight {self.name!r} has no {DATA!r} member")

    @classmethod
    def plain(cls, tensor: StoredTensor, notes: list[str]) -> Weight:
        """A plain weight of one stored tensor, the same as `Weight(tensor.name, tensor.shape,
        tensor.dtype.name, {DATA: tensor}, notes=notes)`, built without the dataclass __init__:
        a header of 1.6M tensors makes 1.6M of them."""
        weight = object.__new__(cls)
        weight.name, weight.shape, weight.dtype = tensor.name, tensor.shape, tensor.dtype.name
        weight.members, weight.scheme, weight.provenance, weight.notes = {DATA: tensor}, None, PLAIN, notes
        return weight

    @property
    def convention(self) -> str:
        """The convention that read this weight ("plain" for a plain one)."""
        return self.provenance.convention

    @property
    def data(self) -> StoredTensor:
        return self.members[DATA]

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    @property
    def parameters(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.members.values())

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per logical parameter, scales and zero points included."""
        return self.nbytes * 8 / self.parameters if self.parameters else 0.0

    def require_scheme(self) -> QScheme:
        if self.scheme is None:
            raise NotQuantizedError(
                f"weight {self.name!r} is not quantized: it is a plain {self.dtype} tensor",
                hint="read it as it is, or quantize it first with `qtool quantize`",
            )
        return self.scheme
