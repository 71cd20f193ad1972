"""The GGUF layout: a checkpoint as one .gguf file, written by the same executor as every
other layout. The plan fixes every tensor's GGUF name, type, shape and byte size, and the
metadata, before any data is read, and refuses an impossible job (a row length that is not a
multiple of the block, a dtype GGUF cannot hold) before anything is written. The header
(key-values and tensor infos) is serialized by the `gguf` package's own `GGUFWriter`; the
tensor data is laid out at its aligned offsets by qtool's writer, streamed like safetensors.

    weight                         GGUF type
    chosen, scheme q8_0 ... q5_1   its `gguf_type` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
    chosen, scheme mxfp4           MXFP4 (fp4_e2m1 with e8m0 scales per 32)
    not chosen, 1-D float          F32 (norms and biases, as llama.cpp's converter writes them)
    not chosen, F16 / BF16 / F32   unchanged
    not chosen, F64, I8 ... I64    unchanged
    not chosen, other float (fp8)  F32, exactly
    already quantized (requantize) decoded on `device`, then as above; F32 when not chosen

Encoding: the fused C kernels (`qtool.native.encode_gguf`) on the CPU, bit for bit
`gguf.quants.quantize`; that numpy code otherwise (and for MXFP4). Neither imports torch.

Names, architecture and tokenizer (`qtool.layouts.gguf_hf`, `gguf_tokenizer`): from a Hugging
Face checkpoint of the LLaMA family (llama, mistral, qwen2), tensor names map onto GGUF's through
gguf-py's `TensorNameMap`, q_proj and k_proj rows of llama and mistral are permuted back to
llama.cpp's rotary order, and the hyperparameters and the tokenizer are written as llama.cpp's
converter writes them, so llama.cpp runs the file. Any other model is refused, unless an
incomplete GGUF (architecture "unknown", names kept, no tokenizer) is allowed.
"""

from __future__ import annotations

import io
import math
from typing import Any, Iterator

from qtool import native
from qtool.formats.checkpoint import Checkpoint
from qtool.formats.gguf import GgmlType, ggml_type_named
from qtool.layouts.base import CAST, COPY, DEQUANTIZE, QUANTIZE, Job, Piece, Plan, Planned, PlanOptions, refusal_of
from qtool.layouts.gguf_hf import describe_model
from qtool.metrics import ErrorStats
from qtool.scheme import QScheme, SchemeError
from qtool.weight import Weight

__all__ = ["Gguf", "WRITABLE_TYPES", "gguf_type_for", "gguf_layout_bytes", "gguf_header"]

WRITABLE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 with the terminating NUL; llama.cpp refuses longer names
ENCODE_ROWS = 4 << 20  # values per piece when encoding (bounded memory on any weight)
_FLOAT_KEEP = ("F32", "F16", "BF16")
# general.file_type (llama_ftype) per dominant quantized type
_FILE_TYPES = {"Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q8_0": "MOSTLY_Q8_0", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "MXFP4": "MOSTLY_MXFP4_MOE"}
_FLOAT_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}


def gguf_type_for(scheme: QScheme) -> GgmlType:
    """The GGML type that writes `scheme`: its `gguf_type`, or MXFP4 for fp4_e2m1 with e8m0
    scales per 32 (compressed-tensors' MXFP4A16 is the same format)."""
    name = scheme.gguf_type
    if name in WRITABLE_TYPES:
        return ggml_type_named(name)
    if scheme.qtype.name == "fp4_e2m1" and scheme.scale_kind == "e8m0" and scheme.group_size == 32 and not scheme.global_scale:
        return ggml_type_named("MXFP4")
    raise SchemeError(f"GGUF has no block type qtool writes for {scheme.label}", hint="the gguf layout writes q8_0, q4_0, q4_1, q5_0, q5_1 and mxfp4")


def gguf_layout_bytes(shape: tuple[int, ...], gguf_type: str | GgmlType) -> int:
    """Bytes a tensor of `shape` (PyTorch order) takes as `gguf_type`: rows × cols / block ×
    bytes per block. SchemeError when the last dim is not a multiple of the block."""
    gtype = ggml_type_named(gguf_type) if isinstance(gguf_type, str) else gguf_type
    cols = shape[-1] if shape else 1
    if cols % gtype.block_size:
        raise SchemeError(
            f"rows of {cols} values are not a multiple of the {gtype.name} block size {gtype.block_size}",
            hint=f"leave such weights unquantized, or pick a layout without {gtype.block_size}-value blocks",
        )
    return gtype.nbytes(math.prod(shape))


class Gguf:
    """One .gguf file: llama.cpp's block types, names and metadata."""

    name = "gguf"
    container = "gguf"
    description = "one GGUF file (llama.cpp)"

    def refusal(self, scheme: QScheme) -> str | None:
        return refusal_of(lambda: gguf_type_for(scheme))

    def check(self, weight: Weight, scheme: QScheme) -> None:
        if not weight.quantized and not weight.data.dtype.is_float:
            raise SchemeError(f"{weight.name}: a {weight.data.dtype.name} tensor cannot be quantized", hint="leave it out of the selection")
        gtype = gguf_type_for(scheme)
        if not weight.shape:
            raise SchemeError(f"{weight.name}: a scalar cannot be stored in {gtype.name} blocks", hint="leave it out of the selection")
        try:
            gguf_layout_bytes(tuple(weight.shape), gtype)
        except SchemeError as exc:
            raise SchemeError(f"{weight.name}: {exc.message}", hint=exc.hint) from None

    def plan(self, source: Checkpoint, weights: list[Weight], chosen: dict[str, QScheme | None], options: PlanOptions) -> Plan:
        """Every GGUF tensor and metadata entry to write. Raises for the first weight that
        cannot be written, before anything is."""
        model = describe_model(source, weights, options.allow_incomplete_gguf)
        jobs: list[Job] = []
        names: dict[str, str] = {}
        for weight in weights:
            scheme = chosen.get(weight.name)
            out_name = model.tensor_name(weight.name)
            if out_name is None:  # a buffer llama.cpp does not read (rotary inv_freq)
                continue
            if out_name in names:
                raise SchemeError(f"weights {names[out_name]} and {weight.name} both map to the GGUF tensor {out_name}", hint="leave one of them out")
            names[out_name] = weight.name
            if len(out_name.encode("utf-8")) > MAX_NAME_BYTES:
                raise SchemeError(
                    f"tensor name {out_name} is {len(out_name.encode('utf-8'))} bytes; GGUF readers (ggml) accept at most {MAX_NAME_BYTES}",
                    hint="leave it out, or write another layout",
                )
            if scheme is not None:
                self.check(weight, scheme)
                gtype, action = gguf_type_for(scheme), QUANTIZE
            else:
                gtype, action = _unquantized(weight)
            permute = model.rope_heads(weight.name)
            if permute and (not weight.shape or weight.shape[0] % (2 * permute)):
                raise SchemeError(f"{weight.name}: {weight.shape[0] if weight.shape else 0} rows do not split into {permute} attention heads", hint="check num_attention_heads in config.json")
            out = Planned(out_name, gtype.name, tuple(weight.shape), gguf_layout_bytes(tuple(weight.shape), gtype))
            jobs.append(Job(weight, action, [out], scheme=scheme, out_dtype=gtype.name if action != QUANTIZE else None, rope_heads=permute))
        return Plan(source, self, jobs, [options.file_name], (model.arch, model.entries + _metadata(jobs)), None, notes=model.notes)

    def side_files(self, plan: Plan) -> dict[str, Any]:
        return {}

    def metadata_json(self, plan: Plan) -> dict[str, Any]:
        arch, entries = plan.metadata
        return {"general.architecture": arch, **{key: _json_value(value) for key, value, _ in entries}}

    def header(self, plan: Plan, shard: int) -> tuple[bytes, dict[str, tuple[int, int]], int]:
        return gguf_header(*plan.metadata, [t for job in plan.jobs for t in job.outputs])

    def encoder(self, job: Job, device: str, measure: bool) -> "GgufEncoder":
        return GgufEncoder(job, measure, native_ok=device == "cpu")


def _json_value(value: Any) -> Any:
    """A metadata value for `--dry-run`: long arrays (a tokenizer's) summarised, bytes as text."""
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value] if len(value) <= 8 else f"[{len(value)} values]"
    return value


def gguf_header(arch: str, metadata: list[tuple[str, Any, str]], tensors: list[Planned]) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The bytes before the data (magic, key-values, tensor infos, padding), serialized by
    gguf-py's `GGUFWriter`; each tensor's absolute byte range; and the file's size, padded at
    the end as GGUFWriter pads it."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(None, arch)
    for key, value, kind in metadata:
        writer.add_key_value(key, value, gguf.GGUFValueType[kind])
    for tensor in tensors:
        # tensor_dtype float32 keeps the shape logical; raw_dtype says what the bytes are
        writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes, raw_dtype=gguf.GGMLQuantizationType[tensor.dtype])
    buffer = io.BytesIO()
    writer.fout = [buffer]  # GGUFWriter serializes into any binary file object
    writer.state = gguf.gguf_writer.WriterState.EMPTY
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    header = buffer.getvalue()
    align = writer.data_alignment
    start = -(-len(header) // align) * align
    header += bytes(start - len(header))
    ranges, offset = {}, start
    for tensor in tensors:
        ranges[tensor.name] = (offset, offset + tensor.nbytes)
        offset += -(-tensor.nbytes // align) * align
    return header, ranges, offset


class GgufEncoder:
    """One weight to GGUF blocks, in row pieces of bounded size: qtool.native's fused kernel
    where it has the type (bit for bit `gguf.quants.quantize`), else gguf-py's numpy code.
    Rows are permuted into llama.cpp's rotary order first where the plan says so."""

    def __init__(self, job: Job, measure: bool, native_ok: bool) -> None:
        self.job = job
        self.gtype = ggml_type_named(job.outputs[0].dtype)
        self.native = native_ok and native.available() and self.gtype.name in native.gguf_encode_types()
        self.wants = "tensor" if job.weight.quantized else "bytes"
        self.errors: ErrorStats | None = ErrorStats() if measure else None

    def encode(self, values) -> Iterator[Piece]:
        job = self.job
        shape = tuple(job.weight.shape)
        cols = shape[-1]
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        if self.wants == "tensor":  # a decoded (requantized) weight
            import torch

            values, dtype = memoryview(values.to("cpu", torch.float32).contiguous().reshape(-1).numpy()).cast("B"), "F32"
        else:
            dtype = job.weight.data.dtype.name
        if job.rope_heads:
            values = permute_rows(values, shape[0], job.rope_heads)
        width = len(values) // max(rows * cols, 1)
        step = max(1, ENCODE_ROWS // max(cols, 1))
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
        from gguf import GGMLQuantizationType, quants

        from qtool.numeric import to_float32

        values = to_float32(part, dtype).reshape(rows, cols)
        qtype = GGMLQuantizationType[self.gtype.name]
        encoded = quants.quantize(values, qtype)
        if self.errors is not None:
            self.errors.update_numpy(values, quants.dequantize(encoded, qtype))
        return memoryview(encoded).cast("B")


def permute_rows(raw, rows: int, heads: int) -> memoryview:
    """Hugging Face's rotary layout back to llama.cpp's (`LlamaModel.permute` in
    convert_hf_to_gguf.py): within each head, rows [0, 2, 4, ..., 1, 3, 5, ...] interleave.
    Works on the raw bytes, so any dtype permutes without a conversion."""
    import numpy as np

    table = np.frombuffer(raw, dtype=np.uint8).reshape(rows, -1)
    permuted = table.reshape(heads, 2, rows // heads // 2, table.shape[1]).swapaxes(1, 2).reshape(table.shape)
    return memoryview(np.ascontiguousarray(permuted)).cast("B")


def _unquantized(weight: Weight) -> tuple[GgmlType, str]:
    if weight.quantized:
        return ggml_type_named("F32"), DEQUANTIZE
    dtype = weight.data.dtype
    if dtype.name in _FLOAT_KEEP:
        if len(weight.shape) <= 1 and dtype.name != "F32":
            return ggml_type_named("F32"), CAST
        return ggml_type_named(dtype.name), COPY
    if dtype.gguf_id is not None:
        return ggml_type_named(dtype.name), COPY
    if dtype.is_float and dtype.torch_name is not None:
        return ggml_type_named("F32"), CAST
    raise SchemeError(
        f"tensor {weight.name} has dtype {dtype.name}, which GGUF cannot store",
        hint="GGUF holds F32, F16, BF16, F64 and I8..I64 tensors besides its block types; write another layout",
    )


def _metadata(jobs: list[Job]) -> list[tuple[str, Any, str]]:
    """The keys after the model's own (`gguf_hf`): the file type and quantization version."""
    from gguf import GGML_QUANT_VERSION, Keys, LlamaFileType

    return [
        (Keys.General.FILE_TYPE, int(LlamaFileType[_file_type(jobs)]), "UINT32"),
        (Keys.General.QUANTIZATION_VERSION, GGML_QUANT_VERSION, "UINT32"),
    ]


def _file_type(jobs: list[Job]) -> str:
    """llama_ftype of the type holding the most parameters (quantized types first)."""
    counts: dict[str, int] = {}
    for job in jobs:
        if job.action == QUANTIZE:
            counts[job.outputs[0].dtype] = counts.get(job.outputs[0].dtype, 0) + job.weight.parameters
    if counts:
        return _FILE_TYPES[max(counts, key=counts.__getitem__)]
    for job in jobs:
        if len(job.weight.shape) >= 2 and job.outputs[0].dtype in _FLOAT_FILE_TYPES:
            counts[job.outputs[0].dtype] = counts.get(job.outputs[0].dtype, 0) + job.weight.parameters
    return _FLOAT_FILE_TYPES[max(counts, key=counts.__getitem__)] if counts else "ALL_F32"
