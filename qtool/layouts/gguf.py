"""The GGUF layout: a checkpoint as one .gguf file, written by the same executor as every
other layout. The plan fixes every tensor's GGUF name, type, shape and byte size, the rows
permuted on the way out, and the metadata, before any data is read, and refuses an impossible
job (a row length that is not a multiple of the block, a dtype GGUF cannot hold, a type no
encoder here writes) before anything is written.

    weight                                GGUF type
    chosen, a llama.cpp type (q8_0 ...)   that type (its scheme's rule)
    chosen, mxfp4                         MXFP4 (fp4_e2m1 with e8m0 scales per 32)
    kept as a float type (a mix's F16)    that type, cast or decoded
    a GGUF input's tensor, kept           unchanged, bytes copied (quantized ones too)
    not chosen, 1-D float                 F32 (norms and biases, as llama.cpp's converter writes them)
    not chosen, F16 / BF16 / F32          unchanged
    not chosen, F64, I8 ... I64           unchanged
    not chosen, other float (fp8)         F32, exactly
    already quantized (requantize)        decoded on `device`, then as above; F32 when not chosen

Which tensor gets which type under a llama.cpp mix is the selection's (`qtool.selection`);
names, hyperparameters and the tokenizer of a Hugging Face model are `qtool.llamacpp`'s; the
header bytes are `qtool.formats.gguf_writer`'s; the encoders are `qtool.encoders`'.

GGUF in, GGUF out (read by `formats.gguf.read_gguf_key_values`): every key-value of the input
is written again in its order with its exact value type (arrays with their element type), the
tensors in their order; `general.file_type`, `general.quantization_version` and
`general.quantized_by` are set, and the split keys dropped, as llama-quantize does.
`general.alignment` is kept and obeyed.

With an importance matrix (`PlanOptions.imatrix`) each quantized tensor's `GgmlBlocks` carries
its entry's importance, matched as llama-quantize matches them (`qtool.llamacpp.importance`),
and the output records the file in `quantize.imatrix.*`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from qtool import encoders
from qtool.errors import SchemeError
from qtool.formats.checkpoint import Checkpoint
from qtool.ggml_types import GgmlType, ggml_type_named, type_for
from qtool.layouts.base import refusal_of
from qtool.plan import CAST, COPY, DEQUANTIZE, QUANTIZE, Chosen, GgmlBlocks, Job, OutputTensor, Plan, PlanOptions
from qtool.scheme import QScheme
from qtool.weight import Weight

__all__ = ["Gguf", "gguf_type_for", "gguf_layout_bytes"]

MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 with the terminating NUL; llama.cpp refuses longer names
_FLOAT_KEEP = ("F32", "F16", "BF16")
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def gguf_type_for(scheme: QScheme) -> GgmlType:
    """The GGML type that writes `scheme`, or a SchemeError naming what the layout writes."""
    if scheme.observer != "minmax":
        raise SchemeError(
            f"GGUF block types have their own block math (llama.cpp's); the {scheme.observer} observer does not apply",
            hint="drop the observer for GGUF output, or write compressed-tensors",
        )
    gtype = type_for(scheme)
    if gtype is None:
        raise SchemeError(
            f"GGUF has no block type qtool writes for {scheme.label}",
            hint="the gguf layout writes q8_0, q4_0, q4_1, q5_0, q5_1, q2_k ... q6_k, iq4_nl, mxfp4 and llama.cpp's mixes (Q4_K_M ...)",
        )
    return gtype


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
    return gtype.nbytes(_numel(shape))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class Gguf:
    """One .gguf file: llama.cpp's block types, names and metadata."""

    name = "gguf"
    container = "gguf"
    description = "one GGUF file (llama.cpp)"

    def refusal(self, scheme: QScheme) -> str | None:
        return refusal_of(lambda: gguf_type_for(scheme))

    def check(self, weight: Weight, scheme: QScheme) -> None:
        if not weight.quantized and not weight.data.dtype.is_float:
            raise SchemeError(
                f"{weight.name}: a {weight.data.dtype.name} tensor cannot be quantized",
                hint="leave it out of the selection",
            )
        gtype = gguf_type_for(scheme)
        if not weight.shape:
            raise SchemeError(
                f"{weight.name}: a scalar cannot be stored in {gtype.name} blocks", hint="leave it out of the selection"
            )
        try:
            gguf_layout_bytes(tuple(weight.shape), gtype)
        except SchemeError as exc:
            raise SchemeError(f"{weight.name}: {exc.message}", hint=exc.hint) from None

    def plan(self, source: Checkpoint, weights: list[Weight], chosen: Chosen, options: PlanOptions) -> Plan:
        """Every GGUF tensor and metadata entry to write. Raises for the first weight that
        cannot be written, before anything is."""
        from qtool.llamacpp.importance import attach_importance, imatrix_metadata
        from qtool.llamacpp.model import model_entries
        from qtool.llamacpp.names import tensor_names

        gguf_input = source.format == "gguf"
        if gguf_input:  # the input's tensor order, which the output keeps
            order = {name: index for index, name in enumerate(source.tensors)}
            weights = sorted(weights, key=lambda w: order.get(w.data.name, len(order)))
        input_entries = _input_metadata(source) if gguf_input else None
        names = tensor_names(source, options.allow_incomplete_gguf)
        out_names: dict[str, str] = {}
        taken: dict[str, str] = {}
        for weight in weights:
            out_name = names.tensor_name(weight.name)
            if out_name is None:  # a buffer llama.cpp does not read (rotary inv_freq)
                continue
            if out_name in taken:
                raise SchemeError(
                    f"weights {taken[out_name]} and {weight.name} both map to the GGUF tensor {out_name}",
                    hint="leave one of them out",
                )
            taken[out_name] = weight.name
            out_names[weight.name] = out_name
            if len(out_name.encode("utf-8")) > MAX_NAME_BYTES:
                raise SchemeError(
                    f"tensor name {out_name} is {len(out_name.encode('utf-8'))} bytes; GGUF readers (ggml) accept at most {MAX_NAME_BYTES}",
                    hint="leave it out, or write another layout",
                )
        weights = [weight for weight in weights if weight.name in out_names]
        model = model_entries(source, weights, names, options.allow_incomplete_gguf)
        jobs: list[Job] = []
        for weight in weights:
            out_name = out_names[weight.name]
            scheme = chosen.get(weight.name)
            if scheme is not None:
                if chosen.mix is None:
                    self.check(weight, scheme)
                gtype = gguf_type_for(scheme)
                if not gguf_input:
                    job = _quantize_job(weight, out_name, gtype, scheme)
                elif gtype.name == _stored_type(weight):  # a GGUF input's tensor keeps its type and bytes
                    job = _kept_job(weight, out_name, gtype.name, gguf_input)
                else:
                    job = _quantize_job(weight, out_name, gtype, gtype.scheme)
            else:
                job = _kept_job(weight, out_name, chosen.keep_as.get(weight.name) or _stored_type(weight), gguf_input)
            rotary = names.rotary(weight.name)
            if rotary is not None:
                if not weight.shape or not rotary.fits(weight.shape[0]):
                    raise SchemeError(
                        f"{weight.name}: {weight.shape[0] if weight.shape else 0} rows do not split into {rotary.heads} attention heads",
                        hint="check num_attention_heads in config.json",
                    )
                job = replace(job, transform=rotary)
            jobs.append(job)
        # with --calibrate the importance is computed after planning, and applied beside the plan (qtool.calibration.imatrix)
        imatrix_notes = []
        if not options.imatrix_pending:
            jobs, imatrix_notes = attach_importance(jobs, options.imatrix, chosen.mix)
        for job in jobs:
            if not encoders.can_encode(self, job):
                raise SchemeError(
                    f"{job.weight.name}: cannot encode {job.outputs[0].dtype}: {encoders.why_not_encodable(job)}",
                    hint="build the C extension (`pip install -e .` or `python setup.py build_ext --inplace`), or pick q8_0/q4_0/q4_1/q5_0/q5_1",
                )
        entries = input_entries if gguf_input else model
        recorded = imatrix_metadata(options.imatrix, options.imatrix_name) if options.imatrix is not None else []
        metadata = (None if gguf_input else names.arch, _stamped(entries, jobs, chosen.mix, recorded))
        said = names.notes + list(chosen.notes if chosen.said is None else chosen.said) + imatrix_notes
        return Plan(
            source,
            self,
            jobs,
            [options.file_name],
            metadata,
            None,
            names.notes + list(chosen.notes) + imatrix_notes,
            said,
        )

    def side_files(self, plan: Plan) -> dict[str, Any]:
        return {}

    def metadata_json(self, plan: Plan) -> dict[str, Any]:
        arch, entries = plan.metadata
        shown = {key: _shown(value, kind) for key, value, kind in entries}
        return shown if arch is None else {"general.architecture": arch, **shown}

    def header(self, plan: Plan, shard: int) -> tuple[bytes, dict[str, tuple[int, int]], int]:
        from qtool.formats.gguf_writer import gguf_header

        arch, entries = plan.metadata
        tensors = [(t.name, t.shape, t.dtype, t.nbytes) for job in plan.jobs for t in job.outputs]
        return gguf_header(entries, tensors, architecture=arch)


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
    if not counts:
        for job in jobs:
            if len(job.weight.shape) >= 2 and job.outputs[0].dtype in _FLOAT_KEEP:
                counts[job.outputs[0].dtype] = counts.get(job.outputs[0].dtype, 0) + job.weight.parameters
    if not counts:
        return "ALL_F32"
    file_type = ggml_type_named(max(counts, key=counts.__getitem__)).file_type
    if file_type is None:
        from qtool.errors import InternalError

        raise InternalError(f"GGML type {max(counts, key=counts.__getitem__)} names no llama_ftype")
    return file_type


def _stored_type(weight: Weight) -> str:
    """The GGML type a weight is stored in now (Q4_K, F16, ...), or its storage dtype."""
    return weight.data.encoding or weight.data.dtype.name


def _quantize_job(weight: Weight, out_name: str, gtype: GgmlType, scheme: QScheme) -> Job:
    shape = tuple(weight.shape)
    out = OutputTensor(out_name, gtype.name, shape, gguf_layout_bytes(shape, gtype))
    return Job(weight, QUANTIZE, [out], scheme=scheme, encoding=GgmlBlocks(gtype))


def _kept_job(weight: Weight, out_name: str, type_name: str, gguf_input: bool) -> Job:
    """What keeps `weight` as `type_name`, its stored type or a float type: a copy when it is
    stored so already (a GGUF input's tensors keep their type and bytes, as llama-quantize
    keeps them), else a cast or a decode into the float type. A kept tensor of another
    container follows `_unquantized` (1-D floats in F32, ...)."""
    shape = tuple(weight.shape)
    if type_name == _stored_type(weight):
        if not gguf_input:
            gtype, action = _unquantized(weight)
            return Job(
                weight,
                action,
                [OutputTensor(out_name, gtype.name, shape, gguf_layout_bytes(shape, gtype))],
                out_dtype=gtype.name,
            )
        return Job(weight, COPY, [OutputTensor(out_name, type_name, shape, weight.data.nbytes)], out_dtype=type_name)
    if type_name not in _FLOAT_KEEP:
        from qtool.errors import InternalError

        raise InternalError(f"{weight.name}: kept as {type_name}, which is neither its stored type nor a float type")
    action = DEQUANTIZE if weight.quantized else CAST
    gtype = ggml_type_named(type_name)
    return Job(
        weight,
        action,
        [OutputTensor(out_name, gtype.name, shape, gguf_layout_bytes(shape, gtype))],
        out_dtype=gtype.name,
    )


def _stamped(
    entries: list[tuple[str, Any, str]], jobs: list[Job], mix: str | None, recorded: list[tuple[str, Any, str]] = ()
) -> list[tuple[str, Any, str]]:
    """The entries with general.file_type (the mix's, or the commonest type's),
    general.quantization_version and general.quantized_by set in place (added at the end when
    absent), and llama.cpp's split keys dropped; then `recorded` (an imatrix's quantize.imatrix.*
    keys) at the end, replacing any of the same name, as llama-quantize's kv overrides do."""
    from qtool.ggml_types import GGML_QUANT_VERSION, LLAMA_FTYPES
    from qtool.llamacpp.mixes import MIXES
    from qtool.version import __version__

    stamps = {
        "general.file_type": (LLAMA_FTYPES[MIXES[mix].ftype if mix is not None else _file_type(jobs)], "UINT32"),
        "general.quantization_version": (GGML_QUANT_VERSION, "UINT32"),
        "general.quantized_by": (f"qtool {__version__}", "STRING"),
    }
    out = []
    replaced = {key for key, _, _ in recorded}
    for key, value, kind in entries:
        if key in _SPLIT_KEYS or key in replaced:
            continue
        if key in stamps:
            value, kind = stamps.pop(key)
        out.append((key, value, kind))
    return out + [(key, value, kind) for key, (value, kind) in stamps.items()] + list(recorded)


def _input_metadata(source: Checkpoint) -> list[tuple[str, Any, str]]:
    """Every key-value of a GGUF input, in order, as (key, value, type) with strings as their
    bytes and arrays as lists whose type reads "ARRAY:<element type>" (`read_gguf_key_values`)."""
    from qtool.formats.gguf import read_gguf_key_values

    path = source.files[0]
    entries = read_gguf_key_values(path)
    for key, value, kind in entries:
        if key == "general.alignment" and (kind != "UINT32" or value < 1 or value & (value - 1)):
            raise SchemeError(
                f"general.alignment is {value} ({kind}); GGUF needs a power of two as UINT32",
                hint="fix or remove the key",
                path=path,
            )
    return entries


def _shown(value: Any, kind: str) -> Any:
    """A metadata value for --dry-run's JSON: text for bytes, long arrays summarised."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, Sequence) and not isinstance(value, str):  # a list, or a GGUF input's StringArray
        if len(value) > 16:
            item = kind.partition(":")[2]
            return f"[{len(value)} × {item}]" if item else f"[{len(value)} values]"
        return [_shown(v, kind) for v in value]
    return value
