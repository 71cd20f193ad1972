"""One weight to GGML blocks, in row pieces of bounded size: qtool.native's fused kernels
(`native=True`: byte for byte `gguf.quants.quantize` for the 32-value types, llama.cpp's
reference quantizers for the K-quants and IQ4_NL), else gguf-py's numpy quantizer. Neither
imports torch: the values come as raw bytes, the weight's stored dtype, or float32 for a weight
that was quantized before (requantizing: the executor decodes it first). Rows holding inf or
NaN: the K-quants and IQ4_NL encode them as llama.cpp does; the 32-value types go to gguf-py,
whose bytes are the reference."""

from __future__ import annotations

import math
from typing import Iterator

from qtool import native
from qtool.error_measures import ErrorStats
from qtool.ggml_types import ggml_type_named
from qtool.plan import GgmlBlocks, Job, Piece

__all__ = ["GgmlBlockEncoder", "NUMPY_TYPES", "ENCODE_VALUES"]

NUMPY_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")  # what gguf-py's numpy quantizer encodes
ENCODE_VALUES = 4 << 20  # values per piece when encoding (bounded memory on any weight)


class GgmlBlockEncoder:
    def __init__(self, job: Job, measure: bool, native: bool) -> None:
        if not isinstance(job.encoding, GgmlBlocks):
            from qtool.errors import InternalError

            raise InternalError(f"{job.weight.name}: the GGML block encoder needs a GgmlBlocks job")
        self.job = job
        self.gtype = ggml_type_named(job.encoding.type)
        self.native = native
        self.takes = "raw"
        self.errors: ErrorStats | None = ErrorStats() if measure else None

    def encode(self, values) -> Iterator[Piece]:
        job = self.job
        shape = tuple(job.weight.shape)
        cols = shape[-1]
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        dtype = "F32" if job.weight.quantized else job.weight.data.dtype.name  # a requantized weight comes decoded
        width = len(values) // max(rows * cols, 1)
        step = max(1, ENCODE_VALUES // max(cols, 1))
        name, written = job.outputs[0].name, 0
        for start in range(0, rows, step):
            count = min(step, rows - start)
            part = memoryview(values)[start * cols * width : (start + count) * cols * width]
            data = self._encode(part, dtype, count, cols)
            yield name, data, written
            written += len(data)

    def _encode(self, part, dtype: str, rows: int, cols: int):
        if self.native:
            encoded = native.encode_gguf(self.gtype.name, part, dtype, rows, cols)
            if encoded.errors is not None:
                if self.errors is not None:
                    self.errors = self.errors.merge(encoded.errors)
                return encoded.data
            if encoded.complete:  # rows with inf/NaN, encoded as llama.cpp does; measured below
                return self._measured(part, dtype, rows, cols, encoded.data)
        import numpy as np
        from gguf import GGMLQuantizationType, quants

        values = self._values(part, dtype, rows, cols)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # inf/NaN: the executor's one warning says so
            encoded = quants.quantize(values, GGMLQuantizationType[self.gtype.name])
        return self._measured(part, dtype, rows, cols, memoryview(encoded).cast("B"), values)

    @staticmethod
    def _values(part, dtype: str, rows: int, cols: int):
        from qtool.float_casts import to_float32

        return to_float32(part, dtype).reshape(rows, cols)

    def _measured(self, part, dtype: str, rows: int, cols: int, data, values=None):
        """`data`, after adding its error to the weight's (decoded by gguf-py, which has every type)."""
        if self.errors is not None:
            import numpy as np
            from gguf import GGMLQuantizationType, quants

            values = self._values(part, dtype, rows, cols) if values is None else values
            blocks = np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)
            with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN rows decode to NaN: no SQNR
                decoded = quants.dequantize(blocks, GGMLQuantizationType[self.gtype.name])
            self.errors.update_numpy(values, decoded)
        return data
