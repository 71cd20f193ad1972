"""A safetensors layout's own torch `encode_tensors`, run whole or in row chunks on any device,
measured against the values as the layout's reading convention decodes them. The reference
every other encoder of these layouts matches."""

from __future__ import annotations

from collections.abc import Iterator

from qtool.buffers import tensor_bytes
from qtool.error_measures import ErrorStats
from qtool.plan import Job, Piece, TensorLayout

__all__ = ["TorchEncoder"]


_FLOATS = ("F32", "F16", "BF16", "F64")


class TorchEncoder:
    takes = "tensor"

    def __init__(self, layout: TensorLayout, job: Job, measure: bool) -> None:
        self.layout, self.job, self.measure = layout, job, measure
        self.errors: ErrorStats | None = ErrorStats() if measure else None

    def encode(self, weight) -> Iterator[Piece]:
        job, layout = self.job, self.layout
        scheme = job.scheme
        if scheme is None:
            from qtool.errors import InternalError

            raise InternalError(f"{job.weight.name}: a quantize job without a scheme")
        name = job.weight.name
        chunk = layout.row_chunk(job.weight, scheme)
        planned_by_name = {t.name: t for t in job.outputs}
        written = dict.fromkeys(planned_by_name, 0)
        rows = weight.shape[0] if weight.dim() else 1
        # the dtype the codes decode to: the weight's own float dtype, float32 for a weight stored as
        # blocks (a GGUF tensor's dtype is its storage's, U8; its decoding is float32)
        dtype = job.weight.dtype if job.weight.dtype in _FLOATS else "F32"
        for start in range(0, rows, chunk or max(rows, 1)):
            part = weight[start : start + chunk] if chunk else weight
            encoded = layout.encode_tensors(name, part, scheme)
            if self.errors is not None:
                self.errors.update(part, layout.reconstruct(name, encoded, scheme, tuple(part.shape), dtype))
            for out_name, tensor in layout.whole_weight(encoded, tuple(weight.shape)).items():
                if written[out_name] == planned_by_name[out_name].nbytes:
                    continue  # a per-weight tensor (compressed-tensors' weight_shape), written with the first chunk
                data = tensor_bytes(tensor)
                yield out_name, data, written[out_name]
                written[out_name] += data.nbytes
