"""Tensors a calibration stage encoded before the run (`qtool.plan.Precomputed`), written as
they are; the weight's error is measured as any other's, the tensors decoded through the
layout's reading convention against the original values."""

from __future__ import annotations

from collections.abc import Iterator

from qtool.buffers import tensor_bytes
from qtool.error_measures import ErrorStats
from qtool.plan import Job, Piece, Precomputed, TensorLayout

__all__ = ["PrecomputedEncoder"]


class PrecomputedEncoder:
    takes = "tensor"

    def __init__(self, layout: TensorLayout, job: Job, measure: bool) -> None:
        self.layout, self.job = layout, job
        self.errors: ErrorStats | None = ErrorStats() if measure else None

    def encode(self, weight) -> Iterator[Piece]:
        job = self.job
        encoding = job.encoding
        if not isinstance(encoding, Precomputed) or job.scheme is None:
            from qtool.errors import InternalError

            raise InternalError(f"{job.weight.name}: a precomputed job without its tensors or scheme")
        tensors = encoding.tensors
        planned = {t.name: t for t in job.outputs}
        if set(tensors) != set(planned):
            from qtool.errors import InternalError

            raise InternalError(
                f"{job.weight.name}: precomputed tensors {sorted(tensors)} are not the planned {sorted(planned)}"
            )
        if self.errors is not None:
            decoded = self.layout.reconstruct(
                job.weight.name, tensors, job.scheme, tuple(job.weight.shape), job.weight.dtype
            )
            self.errors.update(weight, decoded.to(weight.device))
        for name, tensor in tensors.items():
            data = tensor_bytes(tensor.contiguous())
            if data.nbytes != planned[name].nbytes:
                from qtool.errors import InternalError

                raise InternalError(f"{name}: {data.nbytes} precomputed bytes, {planned[name].nbytes} planned")
            yield name, data, 0
