"""One weight to GGML blocks, in row pieces of bounded size: qtool.native's fused kernels
(`native=True`: byte for byte `gguf.quants.quantize` for the 32-value types, llama.cpp's
reference quantizers for the K-quants and IQ4_NL), else gguf-py's numpy quantizer. Neither
imports torch: the values come as raw bytes, the weight's stored dtype, or float32 for a weight
that was quantized before (requantizing: the executor decodes it first). Rows holding inf or
NaN: the K-quants and IQ4_NL encode them as llama.cpp does; the 32-value types go to gguf-py,
whose bytes are the reference.

With an importance matrix (`GgmlBlocks.importance`, llama.cpp's `--imatrix`) the native kernels
run llama.cpp's weighted quantizers (quantize_<type>(..., quant_weights)): one weight per
column, the same for every row of a 2-D weight, expert e's row for the rows of expert e of a
3-D one, as llama-quantize hands each expert slice its own. gguf-py has no weighted path, so a
weight with importance is encoded natively or not at all."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING
from collections.abc import Iterator

from qtool import native
from qtool.encoders import StoredBlocks
from qtool.error_measures import ErrorStats
from qtool.ggml_types import GGUF_PY, LLAMA_CPP, GgmlType, ggml_type_named
from qtool.plan import GgmlBlocks, Job, Piece

if TYPE_CHECKING:
    import numpy

__all__ = ["GgmlBlockEncoder", "ENCODE_VALUES", "numpy_encodes"]

ENCODE_VALUES = 4 << 20  # values per piece when encoding (bounded memory on any weight)


def numpy_encodes(gtype: GgmlType) -> bool:
    """Whether gguf-py's numpy quantizer writes `gtype` (its bytes are the reference)."""
    return gtype.quantizer == GGUF_PY


class GgmlBlockEncoder:
    def __init__(self, job: Job, measure: bool, native: bool) -> None:
        if not isinstance(job.encoding, GgmlBlocks):
            from qtool.errors import InternalError

            raise InternalError(f"{job.weight.name}: the GGML block encoder needs a GgmlBlocks job")
        self.job = job
        self.gtype = job.encoding.type
        self.source: GgmlType | None = None  # the stored type of a weight taken as its blocks (`transcodes`)
        self.native = native
        self.takes = "raw"
        self.errors: ErrorStats | None = ErrorStats() if measure else None
        self.importance = _importance_rows(job)
        from qtool.errors import UsageError

        if self.importance is not None and not native:
            raise UsageError(
                f"{job.weight.name}: quantizing with an importance matrix needs qtool's native kernels (not built, or QTOOL_NATIVE=0)"
            )
        if self.importance is None and self.gtype.quantizer_needs_imatrix:
            raise UsageError(
                f"{job.weight.name}: {self.gtype.name} needs an importance matrix (llama.cpp quantizes it only with one)",
                hint="give an importance matrix",
                option="imatrix",
            )

    def transcodes(self, weight) -> bool:
        """Whether this encoder takes `weight` (quantized) as its stored GGUF blocks
        (`encoders.StoredBlocks`) rather than decoded to float32: the native kernels decode each
        row as they encode it, the same bytes without the weight's float32 copy."""
        if not (
            self.native and weight.quantized and weight.convention == "gguf" and self.gtype.native_encoder is not None
        ):
            return False
        from qtool.errors import UnknownNameError

        try:
            source = ggml_type_named(weight.data.encoding or "")
        except UnknownNameError:
            return False
        if source.native_decoder is None or not native.can_transcode(source.native_decoder, self.gtype.native_encoder):
            return False
        shape = tuple(weight.shape)
        if not (
            len(shape) >= 1
            and shape[-1] % source.block_size == 0
            and weight.data.nbytes == source.nbytes(math.prod(shape))
        ):
            return False
        self.source = source
        return True

    def encode(self, values) -> Iterator[Piece]:
        job = self.job
        shape = tuple(job.weight.shape)
        cols = shape[-1]
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        dtype = "F32" if job.weight.quantized else job.weight.data.dtype.name  # a requantized weight comes decoded
        source = None
        if isinstance(values, StoredBlocks):  # ... or as its blocks, decoded row by row (`transcodes`)
            source, values = self.source or ggml_type_named(values.type), values.data
        row_bytes = memoryview(values).nbytes // max(rows, 1)
        step = max(1, ENCODE_VALUES // max(cols, 1))
        name, written = job.outputs[0].name, 0
        for start in range(0, rows, step):
            count = min(step, rows - start)
            part = memoryview(values)[start * row_bytes : (start + count) * row_bytes]
            data = self._encode_rows(part, dtype, source, start, count, cols, row_bytes)
            yield name, data, written
            written += len(data)

    def _encode_rows(self, part, dtype: str, source: GgmlType | None, start: int, rows: int, cols: int, row_bytes: int):
        """Rows [start, start + rows) of the weight, in runs that share their importance weights
        (one run without an importance matrix or for a 2-D weight; one per expert of a 3-D one)."""
        if self.importance is None:
            return self._encode(part, dtype, source, rows, cols, None)
        weights, per_expert = self.importance
        if per_expert is None:
            return self._encode(part, dtype, source, rows, cols, weights[0].tobytes())
        out, row = bytearray(), start
        while row < start + rows:
            end = min(start + rows, (row // per_expert + 1) * per_expert)
            piece = part[(row - start) * row_bytes : (end - start) * row_bytes]
            out += self._encode(piece, dtype, source, end - row, cols, weights[row // per_expert].tobytes())
            row = end
        return memoryview(out)

    def _encode(self, part, dtype: str, source: GgmlType | None, rows: int, cols: int, importance: bytes | None):
        """`rows` rows of `cols` values in `part`: `dtype` values (F32, F16, BF16), or the blocks
        of the GGUF type `source` (a requantized weight's, as stored)."""
        if self.native:
            if source is None:
                encoded = native.encode_gguf(self.gtype.native_encoder, part, dtype, rows, cols, importance)
            else:
                encoded = native.transcode_gguf(
                    self.gtype.native_encoder, source.native_decoder, part, rows, cols, importance
                )
            if encoded.errors is not None:
                if self.errors is not None:
                    self.errors = self.errors.merge(encoded.errors)
                return encoded.data
            if source is not None:  # inf/NaN in these rows: from their float32 values, as before
                part, dtype = (
                    native.decode_gguf(
                        source.native_decoder, part, rows * cols // source.block_size, source.block_size, "F32"
                    ),
                    "F32",
                )
            if self._wrote_nonfinite_rows(importance):  # rows with inf/NaN, encoded as llama.cpp does; measured below
                return self._measured(part, dtype, rows, cols, encoded.data)
        import numpy as np
        from gguf import GGMLQuantizationType, quants

        values = self._values(part, dtype, rows, cols)
        with np.errstate(
            invalid="ignore", over="ignore", divide="ignore"
        ):  # inf/NaN: the executor's one warning says so
            encoded = quants.quantize(values, GGMLQuantizationType[self.gtype.name])
        return self._measured(part, dtype, rows, cols, memoryview(encoded).cast("B"), values)

    def _wrote_nonfinite_rows(self, importance: bytes | None) -> bool:
        """Whether the native kernel encodes rows holding inf or NaN (as llama.cpp does): for the
        types whose bytes are llama.cpp's, and with importance weights for any type they change
        (gguf-py has no weighted path). Otherwise gguf-py encodes such rows: its bytes are the
        reference."""
        return self.gtype.quantizer == LLAMA_CPP or (importance is not None and self.gtype.takes_imatrix)

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


def _importance_rows(job: Job) -> tuple[numpy.ndarray, int | None] | None:
    """(float32 [groups, columns] array, rows per group or None for one group) from the job's
    importance: None without one. A 2-D array is one row of weights per expert of a 3-D weight,
    which holds `shape[-2]` rows per expert."""
    importance = job.encoding.importance
    if importance is None:
        return None
    import numpy as np

    from qtool.errors import InternalError

    weights = np.ascontiguousarray(importance, dtype="<f4")
    shape = tuple(job.weight.shape)
    if weights.ndim == 1 and weights.shape[0] == shape[-1]:
        return weights.reshape(1, -1), None
    if weights.ndim == 2 and len(shape) == 3 and weights.shape == (shape[0], shape[-1]):
        return weights, shape[-2]
    raise InternalError(f"{job.weight.name}: importance of shape {weights.shape} for a weight of shape {shape}")
