"""compressed-tensors pack-quantized int2/4/8, per channel or per group, symmetric or with zero
points, in qtool.native's fused kernel: codes, scales and the error sums in one pass over each
row, bit for bit the torch path (tests/test_native.py)."""

from __future__ import annotations

from typing import Any
from collections.abc import Iterator

from qtool import native
from qtool.error_measures import ErrorStats
from qtool.plan import IntRows, Job, Piece

__all__ = ["NativeIntEncoder"]


class NativeIntEncoder:
    """Takes the weight's raw bytes. A weight holding inf or NaN is handed on to the next
    capable backend (torch), whose exact semantics for them are the reference."""

    takes = "raw"

    def __init__(self, layout, job: Job, measure: bool) -> None:
        if not isinstance(job.encoding, IntRows):
            from qtool.errors import InternalError

            raise InternalError(f"{job.weight.name}: the native int encoder needs an IntRows job")
        self.layout, self.job, self.encoding, self.measure = layout, job, job.encoding, measure
        self.errors: ErrorStats | None = None

    def encode(self, raw) -> Iterator[Piece]:
        job, encoding = self.job, self.encoding
        rows, cols = job.weight.shape
        encoded = native.encode_int(
            raw,
            job.weight.dtype,
            rows,
            cols,
            encoding.group,
            encoding.bits,
            symmetric=encoding.symmetric,
            observer=encoding.observer,
        )
        if encoded.errors is None:  # inf or NaN
            yield from self._handed_on(raw)
            return
        if self.measure:
            self.errors = encoded.errors
        packed, scale, *zero_point, shape = (t.name for t in job.outputs)
        yield packed, encoded.packed, 0
        yield scale, encoded.scale, 0
        if zero_point:
            yield zero_point[0], encoded.zero_point, 0
        yield shape, rows.to_bytes(8, "little", signed=True) + cols.to_bytes(8, "little", signed=True), 0

    def _handed_on(self, raw) -> Any:
        from qtool.buffers import tensor_from_bytes
        from qtool.encoders import choose

        stored = self.job.weight.data
        fallback = choose(self.layout, self.job, "cpu", self.measure, after="native-int")
        yield from fallback.encode(tensor_from_bytes(raw, stored.dtype, tuple(stored.shape)))
        self.errors = fallback.errors
