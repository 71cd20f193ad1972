"""The GGUF layout: a checkpoint as one .gguf file, written by the same executor as every
other layout. The plan fixes every tensor's GGUF name, type, shape and byte size, and the
metadata, before any data is read, and refuses an impossible job (a row length that is not a
multiple of the block, a dtype GGUF cannot hold) before anything is written. The header
(key-values and tensor infos) is serialized by the `gguf` package's own `GGUFWriter`; the
tensor data is laid out at its aligned offsets by qtool's writer, streamed like safetensors.

    weight                         GGUF type
    chosen, scheme q8_0 ... q6_k   its `gguf_type` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K)
    under a mix (Q4_K_M, Q8_0...)  what llama.cpp's rules choose for it (`gguf_mix`)
    a GGUF input's tensor, kept    unchanged, bytes copied (quantized ones too)
    chosen, scheme mxfp4           MXFP4 (fp4_e2m1 with e8m0 scales per 32)
    not chosen, 1-D float          F32 (norms and biases, as llama.cpp's converter writes them)
    not chosen, F16 / BF16 / F32   unchanged
    not chosen, F64, I8 ... I64    unchanged
    not chosen, other float (fp8)  F32, exactly
    already quantized (requantize) decoded on `device`, then as above; F32 when not chosen

Encoding: the fused C kernels (`qtool.native.encode_gguf`) on the CPU, byte for byte
llama.cpp's reference quantizers (and `gguf.quants.quantize`, except that an all-zero Q4_0/Q5_0
block stores ggml's d = -0); gguf-py's numpy code otherwise (and for MXFP4). Neither imports
torch. The K-quants and IQ4_NL have only the C kernels: without them the plan refuses, before
anything is written.

GGUF in, GGUF out (`_gguf_input_metadata`, read by `formats.gguf.read_gguf_key_values`): every key-value of the input is written again in
its order with its exact value type (arrays with their element type), the tensors in their
order; `general.file_type`, `general.quantization_version` and `general.quantized_by` are set,
and the split keys dropped, as llama-quantize does. `general.alignment` is kept and obeyed.

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

WRITABLE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
NUMPY_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")  # what gguf-py's numpy quantizer encodes
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 with the terminating NUL; llama.cpp refuses longer names
ENCODE_ROWS = 4 << 20  # values per piece when encoding (bounded memory on any weight)
_FLOAT_KEEP = ("F32", "F16", "BF16")
# general.file_type (llama_ftype) per dominant quantized type
_FILE_TYPES = {"Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q8_0": "MOSTLY_Q8_0", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "MXFP4": "MOSTLY_MXFP4_MOE",
               # as llama.cpp's loader names a file by its commonest type
               "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K", "IQ4_NL": "MOSTLY_IQ4_NL"}  # fmt: skip
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_FLOAT_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}


def gguf_type_for(scheme: QScheme) -> GgmlType:
    """The GGML type that writes `scheme`: its `gguf_type`, or MXFP4 for fp4_e2m1 with e8m0
    scales per 32 (compressed-tensors' MXFP4A16 is the same format)."""
    name = scheme.gguf_type
    if name in WRITABLE_TYPES:
        return ggml_type_named(name)
    if scheme.qtype.name == "fp4_e2m1" and scheme.scale_kind == "e8m0" and scheme.group_size == 32 and not scheme.global_scale:
        return ggml_type_named("MXFP4")
    raise SchemeError(f"GGUF has no block type qtool writes for {scheme.label}", hint="the gguf layout writes q8_0, q4_0, q4_1, q5_0, q5_1, q2_k ... q6_k, mxfp4 and llama.cpp's mixes (Q4_K_M ...)")


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
        gguf_input = source.format == "gguf"
        if gguf_input:  # the input's tensor order, which the output keeps
            order = {name: index for index, name in enumerate(source.tensors)}
            weights = sorted(weights, key=lambda w: order.get(w.data.name, len(order)))
        input_entries = _gguf_input_metadata(source, weights) if gguf_input else None
        model = describe_model(source, weights, options.allow_incomplete_gguf)
        out_names: dict[str, str] = {}
        names: dict[str, str] = {}
        for weight in weights:
            out_name = model.tensor_name(weight.name)
            if out_name is None:  # a buffer llama.cpp does not read (rotary inv_freq)
                continue
            if out_name in names:
                raise SchemeError(f"weights {names[out_name]} and {weight.name} both map to the GGUF tensor {out_name}", hint="leave one of them out")
            names[out_name] = weight.name
            out_names[weight.name] = out_name
            if len(out_name.encode("utf-8")) > MAX_NAME_BYTES:
                raise SchemeError(
                    f"tensor name {out_name} is {len(out_name.encode('utf-8'))} bytes; GGUF readers (ggml) accept at most {MAX_NAME_BYTES}",
                    hint="leave it out, or write another layout",
                )
        weights = [weight for weight in weights if weight.name in out_names]
        mix = _mix_of(chosen)
        mixed = _mix_types(mix, weights, chosen, out_names, input_entries, model.arch, source.config) if mix is not None else {}
        jobs: list[Job] = []
        for weight in weights:
            scheme = chosen.get(weight.name)
            out_name = out_names[weight.name]
            permute = model.rope_heads(weight.name)
            if permute and (not weight.shape or weight.shape[0] % (2 * permute)):
                raise SchemeError(f"{weight.name}: {weight.shape[0] if weight.shape else 0} rows do not split into {permute} attention heads", hint="check num_attention_heads in config.json")
            if mix is not None:
                job = _job_for_type(weight, out_name, mixed[weight.name].type, gguf_input)
            elif scheme is not None:
                self.check(weight, scheme)
                gtype = gguf_type_for(scheme)
                job = _job_for_type(weight, out_name, gtype.name, gguf_input) if gguf_input else _quantize_job(weight, out_name, gtype.name, scheme)
            else:
                job = _job_for_type(weight, out_name, _stored_type(weight), gguf_input)
            job.rope_heads = permute
            jobs.append(job)
        _require_encoders(jobs)
        if gguf_input:
            metadata = (None, _stamped(input_entries, jobs, mix))
        else:
            metadata = (model.arch, _stamped(model.entries, jobs, mix))
        notes = model.notes + [f"{out_names[name]}: {choice.note}" for name, choice in mixed.items() if choice.note]
        return Plan(source, self, jobs, [options.file_name], metadata, None, notes)

    def side_files(self, plan: Plan) -> dict[str, Any]:
        return {}

    def metadata_json(self, plan: Plan) -> dict[str, Any]:
        arch, entries = plan.metadata
        shown = {key: _shown(value, kind) for key, value, kind in entries}
        return shown if arch is None else {"general.architecture": arch, **shown}

    def header(self, plan: Plan, shard: int) -> tuple[bytes, dict[str, tuple[int, int]], int]:
        return gguf_header(*plan.metadata, [t for job in plan.jobs for t in job.outputs])

    def encoder(self, job: Job, device: str, measure: bool) -> "GgufEncoder":
        return GgufEncoder(job, measure, native_ok=device == "cpu")


def gguf_header(arch: str, metadata: list[tuple[str, Any, str]], tensors: list[Planned]) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The bytes before the data (magic, key-values, tensor infos, padding), serialized by
    gguf-py's `GGUFWriter`; each tensor's absolute byte range; and the file's size, padded at
    the end as GGUFWriter pads it."""
    import gguf
    import numpy as np

    writer = _Writer(None, arch or "unknown")
    if arch is None:  # the entries are the whole key-value section, general.architecture included
        writer.kv_data = [{}]
    for key, value, kind in metadata:
        outer, _, inner = kind.partition(":")
        writer.add_key_value(key, value, gguf.GGUFValueType[outer], gguf.GGUFValueType[inner] if inner else None)
        if key == "general.alignment":
            writer.data_alignment = int(value)
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


def _writer_class():
    import gguf

    class Writer(gguf.GGUFWriter):
        """GGUFWriter, writing an empty array too (with its element type), as GGUF allows and
        llama.cpp reads; gguf-py itself refuses to write one."""

        def _pack_val(self, val, vtype, add_vtype, sub_type=None):  # type: ignore[override]
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def _Writer(path, arch: str):
    global _WRITER
    if _WRITER is None:
        _WRITER = _writer_class()
    return _WRITER(path, arch)


_WRITER = None


class GgufEncoder:
    """One weight to GGUF blocks, in row pieces of bounded size: qtool.native's fused kernel
    where it has the type (bit for bit `gguf.quants.quantize`), else gguf-py's numpy code.
    Rows are permuted into llama.cpp's rotary order first where the plan says so."""

    def __init__(self, job: Job, measure: bool, native_ok: bool) -> None:
        self.job = job
        self.gtype = ggml_type_named(job.outputs[0].dtype)
        only_native = self.gtype.name not in NUMPY_TYPES  # the K-quants: no other encoder
        self.native = (native_ok or only_native) and native.available() and self.gtype.name in native.gguf_encode_types()
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
            if encoded.complete:  # rows with inf/NaN, encoded as llama.cpp does; measured below
                return self._measured(part, dtype, rows, cols, encoded.data)
        from gguf import GGMLQuantizationType, quants

        values = self._values(part, dtype, rows, cols)
        encoded = quants.quantize(values, GGMLQuantizationType[self.gtype.name])
        return self._measured(part, dtype, rows, cols, memoryview(encoded).cast("B"), values)

    @staticmethod
    def _values(part, dtype: str, rows: int, cols: int):
        from qtool.numeric import to_float32

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


# -- GGUF in, GGUF out, and llama.cpp's mixes -----------------------------------------------------


def _stored_type(weight: Weight) -> str:
    """The GGML type a weight is stored in now (Q4_K, F16, ...), or its storage dtype."""
    return weight.data.encoding or weight.data.dtype.name


def _quantize_job(weight: Weight, out_name: str, gguf_type: str, scheme: QScheme) -> Job:
    out = Planned(out_name, gguf_type, tuple(weight.shape), gguf_layout_bytes(tuple(weight.shape), gguf_type))
    return Job(weight, QUANTIZE, [out], scheme=scheme)


def _job_for_type(weight: Weight, out_name: str, gguf_type: str, gguf_input: bool) -> Job:
    """What makes `weight` a tensor of `gguf_type`: a copy when it is stored so already (a GGUF
    input's tensors keep their type and bytes, as llama-quantize keeps them), a cast or a decode
    into a float type, else quantizing. A kept tensor of another container follows
    `_unquantized` (1-D floats in F32, ...)."""
    shape = tuple(weight.shape)
    if gguf_type == _stored_type(weight):
        if not gguf_input:
            gtype, action = _unquantized(weight)
            return Job(weight, action, [Planned(out_name, gtype.name, shape, gguf_layout_bytes(shape, gtype))], out_dtype=gtype.name)
        return Job(weight, COPY, [Planned(out_name, gguf_type, shape, weight.data.nbytes)], out_dtype=gguf_type)
    if gguf_type in _FLOAT_KEEP:
        action = DEQUANTIZE if weight.quantized else CAST
        return Job(weight, action, [Planned(out_name, gguf_type, shape, gguf_layout_bytes(shape, gguf_type))], out_dtype=gguf_type)
    from qtool.scheme import parse_scheme

    return _quantize_job(weight, out_name, gguf_type, parse_scheme(gguf_type.lower()))


def _mix_of(chosen: dict[str, QScheme | None]):
    from qtool.layouts.gguf_mix import MIXES

    names = {s.gguf_mix for s in chosen.values() if s is not None and s.gguf_mix}
    if len(names) > 1:
        raise SchemeError(f"one run writes one llama.cpp mix, not {', '.join(sorted(names))}", hint="pick one --scheme; --tensor-scheme names single types")
    return MIXES[names.pop()] if names else None


def _mix_types(mix, weights: list[Weight], chosen, out_names: dict[str, str], entries, arch: str, config: dict[str, Any]):
    """{weight name: Choice} under llama.cpp's rules for `mix`, on the GGUF names."""
    from qtool.layouts.gguf_mix import MixTensor, ModelFacts, choose_types

    if entries is not None:
        facts = ModelFacts.from_metadata({key: value for key, value, _ in entries})
    else:
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads")
        facts = ModelFacts(
            arch,
            _count(config.get("num_hidden_layers")), _count(heads), _count(kv) if isinstance(kv, int) else _count(heads),
            _count(config.get("num_local_experts")),
        )  # fmt: skip
    tensors = []
    for weight in weights:
        scheme = chosen.get(weight.name)
        candidate = scheme is not None and (weight.quantized or weight.data.dtype.name in _FLOAT_KEEP)
        override = gguf_type_for(scheme).name if candidate and not scheme.gguf_mix else None
        tensors.append(MixTensor(out_names[weight.name], tuple(weight.shape), _stored_type(weight), candidate, override))
    by_out = choose_types(mix, tensors, facts)
    return {weight.name: by_out[out_names[weight.name]] for weight in weights}


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def encodable(gguf_type: str) -> bool:
    """Whether an encoder here writes `gguf_type`: gguf-py's numpy code or qtool's C kernels."""
    return gguf_type in NUMPY_TYPES or (native.available() and gguf_type in native.gguf_encode_types())


def _require_encoders(jobs: list[Job]) -> None:
    """Refuse, at plan time, a type that no encoder here writes (the K-quants need the C kernels)."""
    for job in jobs:
        if job.action != QUANTIZE:
            continue
        name = job.outputs[0].dtype
        if encodable(name):
            continue
        why = "qtool's C kernels are not available (not built, or QTOOL_NATIVE=0)" if not native.available() else f"qtool's C kernels have no {name} encoder in this build"
        raise SchemeError(
            f"{job.weight.name}: cannot encode {name}: {why}",
            hint="build the C extension (pip install -e . or python setup.py build_ext --inplace), or pick q8_0/q4_0/q4_1/q5_0/q5_1",
        )


def _stamped(entries: list[tuple[str, Any, str]], jobs: list[Job], mix) -> list[tuple[str, Any, str]]:
    """The entries with general.file_type (the mix's, or the commonest type's),
    general.quantization_version and general.quantized_by set in place (added at the end when
    absent), and llama.cpp's split keys dropped."""
    from gguf import GGML_QUANT_VERSION, LlamaFileType

    from qtool import __version__

    stamps = {
        "general.file_type": (int(LlamaFileType[mix.ftype if mix is not None else _file_type(jobs)]), "UINT32"),
        "general.quantization_version": (GGML_QUANT_VERSION, "UINT32"),
        "general.quantized_by": (f"qtool {__version__}", "STRING"),
    }
    out = []
    for key, value, kind in entries:
        if key in _SPLIT_KEYS:
            continue
        if key in stamps:
            value, kind = stamps.pop(key)
        out.append((key, value, kind))
    return out + [(key, value, kind) for key, (value, kind) in stamps.items()]


def _gguf_input_metadata(source: Checkpoint, weights: list[Weight]) -> list[tuple[str, Any, str]]:
    """Every key-value of a GGUF input, in order, as (key, value, type) with strings as their
    bytes and arrays as lists whose type reads "ARRAY:<element type>" (`read_gguf_key_values`)."""
    import os

    from qtool.formats.gguf import read_gguf_key_values

    path = source.path if os.path.isfile(source.path) else (weights[0].data.file if weights else source.path)
    entries = read_gguf_key_values(path)
    for key, value, kind in entries:
        if key == "general.alignment" and (kind != "UINT32" or value < 1 or value & (value - 1)):
            raise SchemeError(f"general.alignment is {value} ({kind}); GGUF needs a power of two as UINT32", hint="fix or remove the key", path=path)
    return entries


def _shown(value: Any, kind: str) -> Any:
    """A metadata value for --dry-run's JSON: text for bytes, long arrays summarised."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, list):
        if len(value) > 16:
            item = kind.partition(":")[2]
            return f"[{len(value)} × {item}]" if item else f"[{len(value)} values]"
        return [_shown(v, kind) for v in value]
    return value
