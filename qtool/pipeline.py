"""Plan a job, then stream it: one weight at a time, read-ahead and write-behind overlapped.

A plan fixes, before any data is touched, which weights are transformed and how, the name,
dtype and shape of every output tensor, and so every safetensors header and byte offset. That
is what `--dry-run` prints, and what the writer lays out on disk.

Streaming keeps memory bounded by a few times the largest weight, whatever the model's size:
- inputs are read with `pread` into fresh buffers (not mmap), so their pages are not held;
- quantization runs in row chunks where the scheme allows (channel, group and block schemes);
- copied tensors move in `COPY_CHUNK` pieces;
- one read runs ahead of the weight being computed, and at most `WRITES_IN_FLIGHT` pieces wait
  to be written behind it, across weights.

On the CPU, jobs that `qtool.fastpath` accepts run on qtool's fused native kernels and never
touch torch; the rest run on the torch kernels. Both write the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from qtool import fastpath
from qtool.conventions import decoder_for, encoder_for
from qtool.dtypes import WEIGHT_FLOATS, storage_dtype
from qtool.errors import UsageError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.writer import INDEX_NAME, OutTensor, Output, shard_name
from qtool.metrics import ErrorStats
from qtool.scheme import QScheme
from qtool.weight import Weight

__all__ = ["Job", "Plan", "Result", "plan_json", "plan_quantize", "plan_dequantize", "execute", "resolve_device", "parse_size"]

COPY_CHUNK = 32 << 20  # bytes per piece when copying a tensor through
CHUNK_ELEMENTS = 4 << 20  # elements per row chunk when quantizing
WRITES_IN_FLIGHT = 8
SIDE_FILE_LIMIT = 64 << 20  # copy tokenizer and other side files up to this size


@dataclass
class Job:
    """One input weight and what becomes of it."""

    weight: Weight
    action: str  # "quantize" | "dequantize" | "copy" | "cast"
    outputs: list[OutTensor]
    scheme: QScheme | None = None  # the scheme to write, for "quantize"
    out_dtype: str | None = None  # for "dequantize" and "cast"
    shard: int = 0

    @property
    def bytes_in(self) -> int:
        return self.weight.nbytes

    @property
    def bytes_out(self) -> int:
        return sum(t.nbytes for t in self.outputs)


@dataclass
class Plan:
    source: Checkpoint
    jobs: list[Job]
    shard_names: list[str]
    metadata: dict[str, str]
    config: dict[str, Any] | None  # config.json to write, or None
    output_format: str  # "compressed-tensors" | "bitsandbytes" | "safetensors"

    def shard_tensors(self, shard: int) -> list[OutTensor]:
        return [t for job in self.jobs if job.shard == shard for t in job.outputs]

    def to_json(self) -> dict[str, Any]:
        return plan_json(
            self.jobs,
            self.output_format,
            self.shard_names,
            file_of=lambda job: self.shard_names[job.shard],
            tensors_of=lambda job: [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in job.outputs],
        )


def plan_json(jobs, output_format: str, files: list[str], *, file_of, tensors_of) -> dict[str, Any]:
    """The `--dry-run` document, for any writer's jobs (`.weight`, `.action`, `.scheme`,
    `.bytes_in`, `.bytes_out`): what each weight becomes, and the sizes before and after."""
    before = sum(j.bytes_in for j in jobs)
    after = sum(j.bytes_out for j in jobs)
    parameters = sum(j.weight.parameters for j in jobs)
    return {
        "schema_version": 1,
        "format": output_format,
        "files": list(files),
        "summary": {
            "weights": len(jobs),
            "quantized_weights": sum(1 for j in jobs if j.action == "quantize"),
            "bytes_before": before,
            "bytes_after": after,
            "bits_per_weight": round(after * 8 / parameters, 4) if parameters else 0.0,
        },
        "weights": [
            {
                "name": j.weight.name,
                "action": j.action,
                "scheme": j.scheme.label if j.scheme else None,
                "from": j.weight.scheme.label if j.weight.scheme else None,
                "shape": list(j.weight.shape),
                "bytes_before": j.bytes_in,
                "bytes_after": j.bytes_out,
                "bits_per_weight": round(j.bytes_out * 8 / j.weight.parameters, 4) if j.weight.parameters else 0.0,
                "file": file_of(j),
                "tensors": tensors_of(j),
            }
            for j in jobs
        ],
    }


@dataclass
class Result:
    """What a run measured: per quantized weight, its error against the original."""

    errors: dict[str, ErrorStats] = field(default_factory=dict)
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0

    def model_error(self) -> ErrorStats:
        total = ErrorStats()
        for stats in self.errors.values():
            total = total.merge(stats)
        return total


# -- options -----------------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DTYPE_NAMES = {"bf16": "BF16", "f16": "F16", "fp16": "F16", "f32": "F32", "fp32": "F32", "bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def parse_size(text: str) -> int:
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--max-shard-size {text!r} is not a size", hint="write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def parse_dtype(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        return DTYPE_NAMES[text.lower()]
    except KeyError:
        raise UsageError(f"--dtype {text!r} is not a float dtype", hint="use bf16, f16 or f32") from None


def resolve_device(text: str) -> str:
    """cpu | cuda | cuda:N | auto -> a torch device string; a missing GPU is a usage error.
    "cpu" imports nothing: the native kernels may run the whole job without torch."""
    if text == "cpu":
        return "cpu"
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text}: CUDA is not available on this machine", hint="use --device cpu, or auto")
        index = int(text[5:]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: there are only {torch.cuda.device_count()} CUDA devices")
        return text
    raise UsageError(f"--device {text!r} is not a device", hint="use cpu, cuda, cuda:N or auto")


# -- planning ----------------------------------------------------------------------------------


def _shards(jobs: list[Job], source: Checkpoint, single_file: bool, max_shard_size: int | None) -> list[str]:
    """Assign each job a shard; by default follow the input's sharding."""
    if single_file:
        for job in jobs:
            job.shard = 0
        if max_shard_size and sum(j.bytes_out for j in jobs) > max_shard_size:
            raise UsageError("a single-file output cannot be split by --max-shard-size", hint="write to a folder instead")
        return ["model.safetensors"]
    if max_shard_size:
        shard, size = 0, 0
        for job in jobs:
            if size and size + job.bytes_out > max_shard_size:
                shard, size = shard + 1, 0
            job.shard, size = shard, size + job.bytes_out
        count = shard + 1
    else:
        files = {path: i for i, path in enumerate(source.files)}
        for job in jobs:
            job.shard = files.get(job.weight.data.file, 0)
        used = sorted({job.shard for job in jobs})
        renumber = {old: new for new, old in enumerate(used)}
        for job in jobs:
            job.shard = renumber[job.shard]
        count = len(used) or 1
    return [shard_name(i, count) for i in range(count)]


def _ordered(jobs: list[Job]) -> list[Job]:
    return sorted(jobs, key=lambda j: j.shard)


def plan_quantize(
    source: Checkpoint,
    weights: list[Weight],
    chosen: dict[str, QScheme | None],
    *,
    output_format: str,
    out_dtype: str | None,
    single_file: bool,
    max_shard_size: int | None,
) -> Plan:
    """`chosen` maps each weight to its scheme, or None to copy it (cast to `out_dtype` if float)."""
    jobs: list[Job] = []
    for weight in weights:
        scheme = chosen.get(weight.name)
        if weight.quantized:  # only with --allow-requantize: decode, then requantize or keep as float
            dtype = out_dtype or (weight.dtype if weight.dtype in WEIGHT_FLOATS else "BF16")
            if scheme is None:
                jobs.append(Job(weight, "dequantize", [OutTensor(weight.name, dtype, weight.shape)], out_dtype=dtype))
                continue
        if scheme is not None:
            codec = encoder_for(scheme)
            outputs = [OutTensor(n, d, tuple(s)) for n, d, s in codec.encoded_layout(weight.name, weight.shape, weight.dtype, scheme)]
            jobs.append(Job(weight, "quantize", outputs, scheme=scheme))
        elif out_dtype and weight.dtype in ("F16", "BF16", "F32", "F64") and weight.dtype != out_dtype:
            jobs.append(Job(weight, "cast", [OutTensor(weight.name, out_dtype, weight.shape)], out_dtype=out_dtype))
        else:
            jobs.append(Job(weight, "copy", [OutTensor(weight.name, weight.data.dtype.name, weight.data.shape)]))
    names = _shards(jobs, source, single_file, max_shard_size)
    schemes = {j.weight.name.rpartition(".")[0]: j.scheme for j in jobs if j.scheme is not None}
    quant_config = None
    if schemes:
        codec = encoder_for(next(iter(schemes.values())))
        ignore = sorted({j.weight.name.rpartition(".")[0] for j in jobs if j.scheme is None and len(j.weight.shape) == 2 and j.weight.name.endswith(".weight")})
        quant_config = codec.config_for(schemes, ignore, out_dtype or _dominant_dtype(weights))
    return Plan(
        source=source,
        jobs=_ordered(jobs),
        shard_names=names,
        metadata=_metadata(source, quant_config, single_file),
        config=_config(source, quant_config, single_file),
        output_format=output_format,
    )


def plan_dequantize(source: Checkpoint, weights: list[Weight], *, dtype: str | None, single_file: bool, max_shard_size: int | None) -> Plan:
    """Every quantized weight becomes one float tensor under its logical name; the rest is copied."""
    target = dtype or _recorded_dtype(source, weights)
    jobs = []
    for weight in weights:
        if weight.quantized:
            jobs.append(Job(weight, "dequantize", [OutTensor(weight.name, target, weight.shape)], out_dtype=target))
        else:
            jobs.append(Job(weight, "copy", [OutTensor(weight.name, weight.data.dtype.name, weight.data.shape)]))
    names = _shards(jobs, source, single_file, max_shard_size)
    return Plan(source, _ordered(jobs), names, _metadata(source, None, single_file), _config(source, None, single_file), "safetensors")


def _recorded_dtype(source: Checkpoint, weights: list[Weight]) -> str:
    """The dtype the input records for its float weights (config `torch_dtype`), else bf16."""
    recorded = str(source.config.get("torch_dtype") or source.config.get("dtype") or "")
    if recorded in DTYPE_NAMES:
        return DTYPE_NAMES[recorded]
    logical = {w.dtype for w in weights if w.quantized and w.dtype in WEIGHT_FLOATS}
    return logical.pop() if len(logical) == 1 else "BF16"


def _dominant_dtype(weights: list[Weight]) -> str:
    sizes: dict[str, int] = {}
    for weight in weights:
        if weight.dtype in WEIGHT_FLOATS:
            sizes[weight.dtype] = sizes.get(weight.dtype, 0) + weight.parameters
    return max(sizes, key=sizes.__getitem__) if sizes else "BF16"


def _metadata(source: Checkpoint, quant_config: dict | None, single_file: bool) -> dict[str, str]:
    metadata = {"format": "pt"}
    if quant_config is not None and single_file:  # one file describes itself
        from qtool.conventions.compressed_tensors import METADATA_KEY

        metadata[METADATA_KEY] = json.dumps(quant_config, separators=(",", ":"))
    return metadata


def _config(source: Checkpoint, quant_config: dict | None, single_file: bool) -> dict[str, Any] | None:
    if single_file:
        return None
    config = dict(source.config)
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    return config or None


# -- execution ---------------------------------------------------------------------------------


def _read(source: Checkpoint, stored: StoredTensor):
    """A tensor's bytes in a fresh buffer (`Checkpoint.read_bytes`: pread for files), so no
    mmap pages stay resident after use."""
    import torch

    if stored.nbytes == 0:
        return torch.empty(stored.shape, dtype=stored.dtype.torch_dtype())
    return _tensor_of(source.read_bytes(stored), stored)


def _tensor_of(raw, stored: StoredTensor):
    """The torch view of a stored tensor's raw bytes (raw uint8 for dtypes torch lacks)."""
    import torch

    flat = torch.frombuffer(raw, dtype=torch.uint8)
    if stored.dtype.torch_name is None:
        return flat
    return flat.view(stored.dtype.torch_dtype()).reshape(stored.shape)


def _as_bytes(tensor) -> memoryview:
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _row_chunk(scheme: QScheme, shape: tuple[int, ...]) -> int | None:
    """Rows per chunk when a scheme's outputs split by rows, else None (per-tensor or global
    scales need the whole weight at once)."""
    if len(shape) != 2 or scheme.granularity == "tensor" or scheme.global_scale or scheme.convention != "compressed-tensors":
        return None
    rows, cols = shape
    block_rows = scheme.block_for(shape)[0]
    step = math.lcm(block_rows, 32)  # zero points pack 32/b rows per word, blocks span block_rows
    chunk = max(step, (CHUNK_ELEMENTS // max(cols, 1)) // step * step)
    return chunk if chunk < rows else None


Piece = tuple[str, Any, int]  # (output tensor name, bytes-like, byte offset within the tensor)


class _Runner:
    def __init__(self, plan: Plan, device: str, measure: bool) -> None:
        self.plan = plan
        self.device = device
        self.measure = measure
        self.result = Result()
        self._encoders: dict[str, fastpath.IntEncoder | None] = {}

    def native_encoder(self, job: Job) -> fastpath.IntEncoder | None:
        """The fused CPU kernel for this quantize job, if one fits (else torch encodes it)."""
        if job.action != "quantize" or self.device != "cpu":
            return None
        if job.weight.name not in self._encoders:
            assert job.scheme is not None
            self._encoders[job.weight.name] = fastpath.int_encoder(job.weight, job.scheme, [t.name for t in job.outputs])
        return self._encoders[job.weight.name]

    # each job becomes a stream of pieces to write
    def pieces(self, job: Job, loaded) -> Iterator[Piece]:
        if job.action == "copy":
            yield from self._copy(job)
        elif job.action == "cast":
            yield from self._cast(job)
        elif job.action == "dequantize":
            yield job.outputs[0].name, loaded if isinstance(loaded, memoryview) else _as_bytes(loaded), 0
        else:
            yield from self._quantize(job, loaded)

    def load(self, job: Job):
        """Runs ahead on the reader thread."""

        if job.action in ("copy", "cast"):
            return None  # streamed in pieces as it is written
        if job.action == "dequantize" and self.device == "cpu":
            native_decode = fastpath.decoder(job.weight, job.out_dtype or "BF16")
            if native_decode is not None:
                self.result.bytes_read += job.weight.nbytes
                return native_decode(self.plan.source)
        if job.action == "dequantize" or job.weight.quantized:
            decoded = decoder_for(job.weight).decode(self.plan.source, job.weight, self.device)
            for member in job.weight.members.values():
                self.plan.source.release(member)
            self.result.bytes_read += job.weight.nbytes
            if job.action == "dequantize":
                return decoded.to(storage_dtype(job.out_dtype).torch_dtype())
            return decoded
        self.result.bytes_read += job.weight.nbytes
        if self.native_encoder(job) is not None:
            return self.plan.source.read_bytes(job.weight.data)  # raw bytes: no torch
        tensor = _read(self.plan.source, job.weight.data)
        return tensor.to(self.device) if self.device != "cpu" else tensor

    def _copy(self, job: Job) -> Iterator[Piece]:
        stored = job.weight.data
        for start in range(0, stored.nbytes, COPY_CHUNK):
            size = min(COPY_CHUNK, stored.nbytes - start)
            data = self.plan.source.read_bytes(stored, start, size)
            self.result.bytes_read += size
            yield job.outputs[0].name, data, start

    def _cast(self, job: Job) -> Iterator[Piece]:
        import torch

        stored, target = job.weight.data, storage_dtype(job.out_dtype).torch_dtype()
        source = stored.dtype.torch_dtype()
        width = stored.dtype.bits // 8
        step = max(1, COPY_CHUNK // width)
        written = 0
        for start in range(0, stored.numel, step):
            count = min(step, stored.numel - start)
            data = self.plan.source.read_bytes(stored, start * width, count * width)
            self.result.bytes_read += len(data)
            values = torch.frombuffer(data, dtype=torch.uint8).view(source).to(target)
            piece = _as_bytes(values)
            yield job.outputs[0].name, piece, written
            written += piece.nbytes

    def _quantize(self, job: Job, weight) -> Iterator[Piece]:
        scheme = job.scheme
        assert scheme is not None
        native = self.native_encoder(job)
        if native is not None:
            rows = job.weight.shape[0]
            encoded, errors = native.encode(weight, rows)
            if errors is not None:
                if self.measure:
                    self.result.errors[job.weight.name] = errors
                for name, data in encoded.items():
                    yield name, data, 0
                yield native.shape, native.shape_bytes(rows), 0
                return
            weight = _tensor_of(weight, job.weight.data)  # inf or NaN in the weight: torch's exact semantics
        codec = encoder_for(scheme)
        name = job.weight.name
        chunk = _row_chunk(scheme, tuple(weight.shape))
        stats = ErrorStats()
        if chunk is None:
            encoded = codec.encode(name, weight, scheme)
            if self.measure:
                stats.update(weight, codec.reconstruct(name, encoded, scheme, tuple(weight.shape), job.weight.dtype))
            for out in job.outputs:
                yield out.name, _as_bytes(encoded[out.name]), 0
        else:
            full = {t.name: t for t in job.outputs}
            written = {t.name: 0 for t in job.outputs}
            for start in range(0, weight.shape[0], chunk):
                part = weight[start : start + chunk]
                encoded = codec.encode(name, part, scheme)
                if self.measure:
                    stats.update(part, codec.reconstruct(name, encoded, scheme, tuple(part.shape), job.weight.dtype))
                for out_name, tensor in encoded.items():
                    if tuple(tensor.shape) == full[out_name].shape and tensor.shape[0] != part.shape[0] and start:
                        continue  # a per-weight constant such as weight_shape: written with the first chunk
                    data = _as_bytes(_whole_shape(tensor, full[out_name], weight.shape) if start == 0 else tensor)
                    yield out_name, data, written[out_name]
                    written[out_name] += data.nbytes
        if self.measure:
            self.result.errors[name] = stats


def _whole_shape(tensor, planned: OutTensor, shape):
    """compressed-tensors' `weight_shape` records the weight's shape, not the chunk's."""
    import torch

    if planned.name.endswith("weight_shape"):
        return torch.tensor(list(shape), dtype=tensor.dtype)
    return tensor


def _keep_freed_memory() -> None:
    """Ask glibc to serve and keep large blocks from its heap. By default every chunk-sized
    temporary is a fresh mmap, returned on free and page-faulted in again on the next chunk:
    on a 2-core machine that was ~40% of a quantize run, as system time. Peak RSS is unchanged:
    the same few chunk-sized blocks are reused."""
    import ctypes

    from qtool import libc

    mallopt = libc.function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:  # not glibc (musl, ...): keep its defaults
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 256 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def execute(
    plan: Plan,
    output: Output,
    *,
    device: str = "cpu",
    measure: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> Result:
    """Stream the plan into `output` and commit it; on any error the output is removed."""
    _keep_freed_memory()
    runner = _Runner(plan, device, measure)
    started = time.perf_counter()
    try:
        # inside the try: a shard that cannot be created (no space for it, no permission) must
        # remove the temporary output too
        writers = {i: output.shard(name, plan.shard_tensors(i), plan.metadata) for i, name in enumerate(plan.shard_names)}
        with ThreadPoolExecutor(1, thread_name_prefix="qtool-read") as reader, ThreadPoolExecutor(1, thread_name_prefix="qtool-write") as writer:
            in_flight: deque[Future] = deque()

            def write(shard: int, piece: Piece) -> None:
                name, data, at = piece
                writers[shard].write(name, data, at)
                runner.result.bytes_written += memoryview(data).nbytes

            jobs = plan.jobs
            ahead = reader.submit(runner.load, jobs[0]) if jobs else None
            for index, job in enumerate(jobs):
                loaded = ahead.result() if ahead else None
                ahead = reader.submit(runner.load, jobs[index + 1]) if index + 1 < len(jobs) else None
                for piece in runner.pieces(job, loaded):
                    in_flight.append(writer.submit(write, job.shard, piece))
                    while len(in_flight) > WRITES_IN_FLIGHT:
                        in_flight.popleft().result()
                del loaded  # the next job's compute overlaps this one's last writes
                if on_progress:
                    on_progress(job.bytes_in)
            while in_flight:
                in_flight.popleft().result()
        _side_files(plan, output)
        output.commit()
    except BaseException:
        output.abort()
        raise
    runner.result.seconds = time.perf_counter() - started
    return runner.result


def _side_files(plan: Plan, output: Output) -> None:
    if output.single_file:
        return
    if len(plan.shard_names) > 1:
        weight_map = {t.name: plan.shard_names[j.shard] for j in plan.jobs for t in j.outputs}
        total = sum(j.bytes_out for j in plan.jobs)
        output.side_file(INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    if plan.config is not None:
        output.side_file("config.json", plan.config)
    source_dir = plan.source.path if os.path.isdir(plan.source.path) else os.path.dirname(plan.source.files[0])
    for name in sorted(os.listdir(source_dir)):
        path = os.path.join(source_dir, name)
        if (
            name in ("config.json", INDEX_NAME, "quantize_config.json", "quanto_qmap.json", "quantization_map.json")
            or name.endswith((".safetensors", ".index.json", ".bin", ".pt", ".pth", ".gguf", ".bpk"))
            or name.startswith(".")
            or not os.path.isfile(path)
            or os.path.getsize(path) > SIDE_FILE_LIMIT
        ):
            continue
        output.copy_side_file(path, name)
