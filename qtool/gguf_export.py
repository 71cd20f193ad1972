"""`qtool quantize --format gguf`: write a checkpoint as one GGUF file, through the `gguf` package.

Plan first, then stream. The plan fixes every tensor's GGUF name, type, shape and byte size, and
the metadata, before any data is read, and refuses an impossible job (a row length that is not
a multiple of the block, a dtype GGUF cannot hold) before anything is written. Then
`gguf.GGUFWriter` in its incremental mode writes the header, the metadata and every tensor info,
and each tensor's data follows one at a time: read, quantize with `gguf.quants.quantize`
(numpy float32, so the bytes are gguf-py's own), write, release. The file is written to a
temporary name beside the target, fsynced, and renamed; any error (KeyboardInterrupt too)
removes it.

    weight                         GGUF type
    chosen, scheme q8_0 ... q5_1   its `gguf_type` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
    chosen, scheme mxfp4           MXFP4 (fp4_e2m1 with e8m0 scales per 32, from any convention)
    not chosen, 1-D float          F32 (norms and biases, as llama.cpp's converter writes them)
    not chosen, F16 / BF16 / F32   unchanged
    not chosen, F64, I8 ... I64    unchanged
    not chosen, other float (fp8)  F32, exactly
    already quantized (requantize) decoded on `device`, then as above; F32 when not chosen

Names and architecture: for a config.json `model_type` of llama, mistral or qwen2, tensor names
map onto GGUF's (`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight`) through
gguf-py's own `TensorNameMap`, and the basic hyperparameters are written, so the file describes
itself. For llama and mistral, q_proj and k_proj rows are permuted from the Hugging Face rotary
layout back to llama.cpp's, exactly as llama.cpp's `convert_hf_to_gguf.py` does (so decoding
them gives the permuted rows). Any other model keeps its names under architecture "unknown".
No tokenizer is written: llama.cpp needs `tokenizer.ggml.*` keys to run the file.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from qtool.formats.writer import fsync_dir, write_error
from qtool.errors import UsageError
from qtool.formats.checkpoint import Checkpoint
from qtool.formats.gguf import GgmlType, ggml_type_named
from qtool.metrics import ErrorStats
from qtool.scheme import QScheme
from qtool.weight import Weight

__all__ = [
    "WRITABLE_TYPES",
    "GgufJob",
    "GgufPlan",
    "gguf_type_for",
    "gguf_layout_bytes",
    "plan_gguf",
    "execute_gguf",
    "write_gguf",
]

WRITABLE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 with the terminating NUL; llama.cpp refuses longer names
MEASURE_CHUNK = 4 << 20  # elements per piece when measuring error (float64 sums)
_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # model_type -> GGUF architecture
_PERMUTED_ARCHS = ("llama",)
_FLOAT_KEEP = ("F32", "F16", "BF16")
# general.file_type (llama_ftype) per dominant quantized type
_FILE_TYPES = {"Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q8_0": "MOSTLY_Q8_0", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "MXFP4": "MOSTLY_MXFP4_MOE"}
_FLOAT_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}


def gguf_type_for(scheme: QScheme) -> GgmlType:
    """The GGML type that writes `scheme`: its `gguf_type`, or MXFP4 for fp4_e2m1 with e8m0
    scales per 32 (compressed-tensors' MXFP4A16 is the same format)."""
    name = dict(scheme.extra).get("gguf_type")
    if name in WRITABLE_TYPES:
        return ggml_type_named(name)
    if (
        scheme.qtype.name == "fp4_e2m1"
        and scheme.scale_dtype.upper() in ("E8M0", "F8_E8M0")
        and scheme.group_size == 32
        and not scheme.global_scale
    ):
        return ggml_type_named("MXFP4")
    raise UsageError(
        f"scheme {scheme.label} has no GGUF type qtool writes",
        hint="--format gguf writes q8_0, q4_0, q4_1, q5_0, q5_1 and mxfp4",
    )


def gguf_layout_bytes(shape: tuple[int, ...], gguf_type: str | GgmlType) -> int:
    """Bytes a tensor of `shape` (PyTorch order) takes as `gguf_type`: rows × cols / block ×
    bytes per block. ValueError when the last dim is not a multiple of the block."""
    gtype = ggml_type_named(gguf_type) if isinstance(gguf_type, str) else gguf_type
    cols = shape[-1] if shape else 1
    if cols % gtype.block_size:
        raise ValueError(f"rows of {cols} values are not a multiple of the {gtype.name} block size {gtype.block_size}")
    return gtype.nbytes(math.prod(shape))


# -- the plan ----------------------------------------------------------------------------------


@dataclass
class GgufJob:
    """One input weight and the GGUF tensor it becomes."""

    weight: Weight
    action: str  # "quantize" | "copy" | "cast" (to F32) | "dequantize" (a quantized input, to F32)
    out_name: str
    gguf_type: GgmlType
    scheme: QScheme | None = None
    permute_heads: int | None = None  # llama q/k: rows permuted within this many heads

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def bytes_in(self) -> int:
        return self.weight.nbytes

    @property
    def bytes_out(self) -> int:
        return gguf_layout_bytes(self.shape, self.gguf_type)


@dataclass
class GgufPlan:
    source: Checkpoint
    jobs: list[GgufJob]
    arch: str
    metadata: list[tuple[str, Any, str]]  # (key, value, GGUFValueType name), in write order
    file_name: str = "model.gguf"
    output_format: str = "gguf"
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The same document as `pipeline.Plan.to_json`, plus the metadata to write."""
        from qtool.pipeline import plan_json

        document = plan_json(
            self.jobs,
            self.output_format,
            [self.file_name],
            file_of=lambda job: self.file_name,
            tensors_of=lambda job: [{"name": job.out_name, "dtype": job.gguf_type.name, "shape": list(job.shape)}],
        )
        document["metadata"] = {key: value for key, value, _ in self.metadata}
        return document


def plan_gguf(source: Checkpoint, weights: list[Weight], chosen: dict[str, QScheme | None], output: str = "model.gguf") -> GgufPlan:
    """Every GGUF tensor and metadata entry to write. Raises `UsageError` for the first weight
    that cannot be written, before anything is."""
    config = source.config
    arch = _ARCHS.get(str(config.get("model_type", "")), "unknown")
    rename = _renamer(arch, config)
    heads = _heads(config) if arch in _PERMUTED_ARCHS else None
    jobs: list[GgufJob] = []
    names: dict[str, str] = {}
    for weight in weights:
        scheme = chosen.get(weight.name)
        out_name = rename(weight.name)
        if out_name in names:
            raise UsageError(f"weights {names[out_name]} and {weight.name} both map to the GGUF tensor {out_name}")
        names[out_name] = weight.name
        if len(out_name.encode("utf-8")) > MAX_NAME_BYTES:
            raise UsageError(
                f"tensor name {out_name} is {len(out_name.encode('utf-8'))} bytes; GGUF readers (ggml) accept at most {MAX_NAME_BYTES}",
                hint="exclude it, or write another format",
            )
        if scheme is not None:
            if not weight.quantized and not weight.data.dtype.is_float:
                raise UsageError(f"{weight.name}: a {weight.data.dtype.name} tensor cannot be quantized", hint=f"exclude it (--ignore {weight.name})")
            gtype = gguf_type_for(scheme)
            cols = weight.shape[-1] if weight.shape else 0
            if not weight.shape or cols % gtype.block_size:
                raise UsageError(
                    f"{weight.name}: rows of {cols} values are not a multiple of the {gtype.name} block size {gtype.block_size}",
                    hint=f"exclude it (--ignore {weight.name}), or pick a layout without {gtype.block_size}-value blocks",
                )
            action = "quantize"
        else:
            gtype, action = _unquantized(weight)
        permute = _rope_heads(weight.name, heads)
        if permute and (not weight.shape or weight.shape[0] % (2 * permute)):
            raise UsageError(f"{weight.name}: {weight.shape[0] if weight.shape else 0} rows do not split into {permute} attention heads")
        jobs.append(GgufJob(weight, action, out_name, gtype, scheme, permute))
    metadata = _metadata(arch, config, jobs)
    return GgufPlan(source, jobs, arch, metadata, os.path.basename(output) or "model.gguf")


def _unquantized(weight: Weight) -> tuple[GgmlType, str]:
    if weight.quantized:
        return ggml_type_named("F32"), "dequantize"
    dtype = weight.data.dtype
    if dtype.name in _FLOAT_KEEP:
        if len(weight.shape) <= 1 and dtype.name != "F32":
            return ggml_type_named("F32"), "cast"
        return ggml_type_named(dtype.name), "copy"
    if dtype.gguf_id is not None:
        return ggml_type_named(dtype.name), "copy"
    if dtype.is_float and dtype.torch_name is not None:
        return ggml_type_named("F32"), "cast"
    raise UsageError(
        f"tensor {weight.name} has dtype {dtype.name}, which GGUF cannot store",
        hint="exclude it, or write another format",
    )


def _renamer(arch: str, config: dict[str, Any]) -> Callable[[str], str]:
    if arch == "unknown":
        return lambda name: name
    import gguf

    blocks = int(config.get("num_hidden_layers") or 0)
    member = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(member, blocks)
    return lambda name: table.get_name(name, try_suffixes=(".weight", ".bias")) or name


def _heads(config: dict[str, Any]) -> tuple[int, int] | None:
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = config.get("num_key_value_heads")
    return heads, kv if isinstance(kv, int) and kv > 0 else heads


def _rope_heads(name: str, heads: tuple[int, int] | None) -> int | None:
    """The head count whose rows llama.cpp's converter permutes: q by n_head, k by n_head_kv."""
    if heads is None:
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return heads[0]
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return heads[1]
    return None


def _metadata(arch: str, config: dict[str, Any], jobs: list[GgufJob]) -> list[tuple[str, Any, str]]:
    """general.architecture is added by GGUFWriter itself; this is everything after it."""
    from gguf import GGML_QUANT_VERSION, Keys, LlamaFileType

    entries: list[tuple[str, Any, str]] = []

    def put(key: str, value: Any, kind: str) -> None:
        entries.append((key.format(arch=arch), value, kind))

    if arch != "unknown":
        heads = config.get("num_attention_heads")
        hidden = config.get("hidden_size")
        head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None)
        for key, name in (
            (Keys.LLM.CONTEXT_LENGTH, "max_position_embeddings"),
            (Keys.LLM.EMBEDDING_LENGTH, "hidden_size"),
            (Keys.LLM.BLOCK_COUNT, "num_hidden_layers"),
            (Keys.LLM.FEED_FORWARD_LENGTH, "intermediate_size"),
            (Keys.Attention.HEAD_COUNT, "num_attention_heads"),
        ):
            if isinstance(config.get(name), int):
                put(key, config[name], "UINT32")
        if isinstance(heads, int):
            kv = config.get("num_key_value_heads")
            put(Keys.Attention.HEAD_COUNT_KV, kv if isinstance(kv, int) else heads, "UINT32")
        if isinstance(config.get("rope_theta"), (int, float)):
            put(Keys.Rope.FREQ_BASE, float(config["rope_theta"]), "FLOAT32")
        if isinstance(config.get("rms_norm_eps"), (int, float)):
            put(Keys.Attention.LAYERNORM_RMS_EPS, float(config["rms_norm_eps"]), "FLOAT32")
        if isinstance(head_dim, int):
            put(Keys.Rope.DIMENSION_COUNT, head_dim, "UINT32")
            if isinstance(hidden, int) and isinstance(heads, int) and head_dim * heads != hidden:
                put(Keys.Attention.KEY_LENGTH, head_dim, "UINT32")
                put(Keys.Attention.VALUE_LENGTH, head_dim, "UINT32")
        if isinstance(config.get("vocab_size"), int):
            put(Keys.LLM.VOCAB_SIZE, config["vocab_size"], "UINT32")
    put(Keys.General.FILE_TYPE, int(LlamaFileType[_file_type(jobs)]), "UINT32")
    put(Keys.General.QUANTIZATION_VERSION, GGML_QUANT_VERSION, "UINT32")
    return entries


def _file_type(jobs: list[GgufJob]) -> str:
    """llama_ftype of the type holding the most parameters (quantized types first)."""
    counts: dict[str, int] = {}
    for job in jobs:
        if job.action == "quantize":
            counts[job.gguf_type.name] = counts.get(job.gguf_type.name, 0) + job.weight.parameters
    if counts:
        return _FILE_TYPES[max(counts, key=counts.__getitem__)]
    for job in jobs:
        if len(job.shape) >= 2 and job.gguf_type.name in _FLOAT_FILE_TYPES:
            counts[job.gguf_type.name] = counts.get(job.gguf_type.name, 0) + job.weight.parameters
    return _FLOAT_FILE_TYPES[max(counts, key=counts.__getitem__)] if counts else "ALL_F32"


# -- writing -----------------------------------------------------------------------------------


def write_gguf(
    source: Checkpoint,
    weights: list[Weight],
    chosen: dict[str, QScheme | None],
    output: str,
    *,
    overwrite: bool,
    device: str,
    on_progress: Callable[[int], None] | None = None,
    measure: bool = True,
):  # -> qtool.pipeline.Result
    """Plan and write `output` (one .gguf file). `chosen` maps weight names to a scheme, or None
    to keep the weight unquantized. Returns each quantized weight's error, keyed by weight name."""
    plan = plan_gguf(source, weights, chosen, output)
    return execute_gguf(plan, output, overwrite=overwrite, device=device, on_progress=on_progress, measure=measure)


def execute_gguf(
    plan: GgufPlan,
    output: str,
    *,
    overwrite: bool,
    device: str = "cpu",
    on_progress: Callable[[int], None] | None = None,
    measure: bool = True,
):  # -> qtool.pipeline.Result
    """Stream `plan` into `output` atomically: a temporary file beside it, fsync, rename."""
    import gguf

    from qtool.pipeline import Result

    target = os.path.abspath(output)
    if os.path.realpath(target) in {os.path.realpath(f) for f in plan.source.files}:
        raise UsageError(f"output {output} is the input", hint="write to a new path; qtool never modifies its input")
    if os.path.lexists(target) and not overwrite:
        raise UsageError(f"output {output} already exists", hint="pass --overwrite to replace it, or choose another -o")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent} does not exist", hint="create it first")
    try:
        handle, temp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.qtool-tmp-", suffix=".gguf", dir=parent)
        os.close(handle)
    except OSError as exc:
        raise write_error(target, exc) from None

    result = Result()
    started = time.perf_counter()
    writer = None
    try:
        writer = gguf.GGUFWriter(temp, plan.arch)
        for key, value, kind in plan.metadata:
            writer.add_key_value(key, value, gguf.GGUFValueType[kind])
        for job in plan.jobs:
            # tensor_dtype float32 keeps the shape logical; raw_dtype says what the bytes are
            writer.add_tensor_info(job.out_name, job.shape, _float32_dtype(), job.bytes_out, raw_dtype=gguf.GGMLQuantizationType(job.gguf_type.id))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for job in plan.jobs:
            data = _encode(plan.source, job, device, result if measure else None)
            writer.write_tensor_data(data)
            result.bytes_read += job.bytes_in
            for member in job.weight.members.values():
                plan.source.release(member)
            if on_progress:
                on_progress(job.bytes_in)
        for fout in writer.fout or []:
            fout.flush()
            os.fsync(fout.fileno())
        writer.close()
        result.bytes_written = os.path.getsize(temp)
        os.replace(temp, target)
        fsync_dir(parent)
    except BaseException as exc:
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass
        try:
            os.unlink(temp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise write_error(target, exc) from None
        raise
    result.seconds = time.perf_counter() - started
    return result


def _float32_dtype():
    import numpy as np

    return np.dtype(np.float32)


def _encode(source: Checkpoint, job: GgufJob, device: str, result) -> Any:
    """The numpy array whose bytes are `job`'s GGUF tensor; measures the error of a quantized one."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    weight = job.weight
    if weight.quantized:
        from qtool.conventions import decoder_for

        tensor = decoder_for(weight).decode(source, weight, device).to("cpu", torch.float32)
    else:
        tensor = source.load(weight.data)
    if job.permute_heads:
        tensor = _permute(tensor, job)
    if job.action == "copy":
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; the bytes are what matter
            tensor = tensor.view(torch.int16)
        return tensor.contiguous().numpy()
    values = tensor.to(torch.float32).contiguous()
    if job.action in ("cast", "dequantize"):
        return values.numpy()
    qtype = GGMLQuantizationType(job.gguf_type.id)
    encoded = quants.quantize(values.numpy(), qtype)
    if result is not None:
        stats = ErrorStats()
        flat_values = values.reshape(-1, values.shape[-1])
        rows = max(1, MEASURE_CHUNK // values.shape[-1])
        flat_bytes = encoded.reshape(flat_values.shape[0], -1)
        for start in range(0, flat_values.shape[0], rows):
            decoded = quants.dequantize(flat_bytes[start : start + rows], qtype)
            stats.update(flat_values[start : start + rows], torch.from_numpy(np.ascontiguousarray(decoded)))
        result.errors[weight.name] = stats
    return encoded


def _permute(tensor, job: GgufJob):
    """Hugging Face's rotary layout back to llama.cpp's (`LlamaModel.permute` in
    convert_hf_to_gguf.py): within each head, rows [0, 2, 4, ..., 1, 3, 5, ...] interleave."""
    heads = job.permute_heads or 1
    shape = tuple(tensor.shape)
    return tensor.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
