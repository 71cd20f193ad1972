"""The one executor: stream a layout's plan into its output, one weight at a time, with
read-ahead and write-behind overlapped. Every layout runs here, safetensors and GGUF alike.

A plan (`qtool.layouts`) fixes, before any data is touched, every output tensor's name, dtype,
shape and byte range, so each file's header is written first and each tensor's bytes go
straight to their place. Memory stays bounded by a few times the largest weight:
- inputs are read with `pread` into fresh buffers (not mmap), so their pages are not held;
- encoders work in row chunks where the layout allows;
- copied and cast tensors move in `COPY_CHUNK` pieces;
- one read runs ahead of the weight being computed, and at most `WRITES_IN_FLIGHT` pieces wait
  to be written behind it, across weights.

The executor changes no process state: threads come in `ExecOptions` and are restored after.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Callable, Iterator

from qtool import encoders, native, native_decoders
from qtool.buffers import tensor_bytes, tensor_from_bytes
from qtool.dtypes import float_dtype_named, storage_dtype
from qtool.error_measures import ErrorStats, count_non_finite, count_non_finite_bytes
from qtool.errors import SchemeError, UsageError
from qtool.formats.checkpoint import Checkpoint
from qtool.formats.writer import Output
from qtool.plan import CAST, COPY, DEQUANTIZE, QUANTIZE, GgmlBlocks, Job, Piece, Plan

__all__ = [
    "ExecOptions",
    "Measurements",
    "execute",
    "stream",
    "Runner",
    "kernel_threads",
    "resolve_device",
    "parse_size",
    "parse_dtype",
]

COPY_CHUNK = 32 << 20  # bytes per piece when copying a tensor through
WRITES_IN_FLIGHT = 8


@dataclass(frozen=True)
class ExecOptions:
    """How a plan runs. Nothing here outlives the run: threads are set for it and restored."""

    device: str = "cpu"  # a resolved device: "cpu", "cuda", "cuda:N"
    threads: int | None = None  # CPU threads for the kernels (native and torch); None: every CPU
    measure: bool = True  # report each weight's error against the original (the overflow check runs either way)
    on_progress: Callable[[int], None] | None = None  # called with input bytes done, per weight
    # measure, per float weight written (decoded, cast or copied), its values against the input's
    # float32 values (`Measurements.written`): qtool convert's per-weight exactness; needs `measure`
    exactness: bool = False


@dataclass
class Measurements:
    """What a run measured: per quantized weight, its error against the original; the error of
    the float weights written unquantized (exact copies, or a cast's rounding); time and bytes."""

    errors: dict[str, ErrorStats] = field(default_factory=dict)
    # quantized weight -> "NaN" | "inf" its input held; dequantized weight -> what its decoded values hold
    non_finite: dict[str, str] = field(default_factory=dict)
    unquantized: ErrorStats = field(default_factory=ErrorStats)
    # with ExecOptions.exactness: per weight written as float, its written values against its float32
    # values (a quantized input's decoding, a float input's own), taken before any row permutation
    written: dict[str, ErrorStats] = field(default_factory=dict)
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0  # the weight files' sizes, headers included

    def model_error(self) -> ErrorStats:
        total = ErrorStats()
        for stats in self.errors.values():
            total = total.merge(stats)
        return total


# -- options -----------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(
            f"shard size {text!r} is not a size", hint="write e.g. 5GB, 500MB or 2GiB", option="max_shard_size"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def parse_dtype(text: str | None) -> str | None:
    if text is None:
        return None
    named = float_dtype_named(text)
    if named is None:
        raise UsageError(f"dtype {text!r} is not a float dtype", hint="use bf16, f16 or f32", option="dtype")
    return named


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
            raise UsageError(
                f"device {text}: CUDA is not available on this machine", hint="use cpu, or auto", option="device"
            )
        index = int(text[5:]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"device {text}: there are only {torch.cuda.device_count()} CUDA devices", option="device")
        return text
    raise UsageError(f"device {text!r} is not a device", hint="use cpu, cuda, cuda:N or auto", option="device")


@contextlib.contextmanager
def kernel_threads(count: int | None) -> Iterator[None]:
    """Run with `count` kernel threads, then restore what was set before (native's pool size,
    and torch's when torch is imported): the one place a run sets threads, for the executor,
    a shard job, calibration and `qtool imatrix` alike. None or 0 leaves them as they are."""
    import sys

    from qtool import native

    if not count:
        yield
        return
    previous = native.threads()
    native.set_threads(count)
    torch = sys.modules.get("torch")
    torch_previous = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        native.set_threads(previous)
        if torch is not None and torch_previous is not None:
            torch.set_num_threads(torch_previous)


# -- reading -----------------------------------------------------------------------------------


class _Runner:
    """Turns each job into pieces to write. `load` runs ahead on the reader thread."""

    def __init__(self, plan: Plan, options: ExecOptions) -> None:
        self.plan = plan
        self.source: Checkpoint = plan.source
        self.options = options
        self.measured = Measurements()
        self._encoders: dict[int, Any] = {}
        # each kept weight's error in the order it was merged, where a shard job must hand
        # them to the driver to merge in the same order (float sums: the order is the result)
        self.kept: list[ErrorStats] | None = None

    def _keep(self, stats: ErrorStats, name: str) -> None:
        self.measured.unquantized = self.measured.unquantized.merge(stats)
        if self.kept is not None:
            self.kept.append(stats)
        if self.options.exactness:
            self.measured.written[name] = self.measured.written.get(name, ErrorStats()).merge(stats)

    def encoder(self, job: Job):
        key = id(job)
        if key not in self._encoders:
            # a quantized weight's error sums are always taken: they carry the overflow check
            # (`_check_finite`), which a run without measuring must pass too; only the report skips them
            self._encoders[key] = encoders.choose(
                self.plan.layout, job, self.options.device, job.action == QUANTIZE or self.options.measure
            )
        return self._encoders[key]

    def load(self, job: Job):
        if job.action in (COPY, CAST) and job.transform is None:
            return None  # streamed in pieces as it is written
        self.measured.bytes_read += job.weight.nbytes
        if (
            job.action == QUANTIZE and self.encoder(job).takes == encoders.CODES
        ):  # moved as they are; the encoder permutes rows
            from qtool.conventions import convention_named

            values = convention_named(job.weight.convention).codes(self.source, job.weight, self.options.device)
            for member in job.weight.members.values():
                self.source.release(member)
            return values
        if job.action == DEQUANTIZE and self.options.exactness and self.options.measure:
            values = self._decoded_exactly(job)
        elif job.action == DEQUANTIZE or job.weight.quantized:
            values = self._decode(job)
        else:
            values = self.source.read_bytes(job.weight.data)
            if job.action == QUANTIZE and self.encoder(job).takes == encoders.TENSOR:
                stored = job.weight.data
                values = tensor_from_bytes(values, stored.dtype, tuple(stored.shape))
                values = values.to(self.options.device) if self.options.device != "cpu" else values
        if job.transform is not None and job.action == QUANTIZE:  # COPY and CAST measure first, then transform
            values = job.transform.apply(values, job.weight.shape[0])
        return values

    def _decode(self, job: Job):
        """A quantized input's values: the written dtype's bytes for DEQUANTIZE; for requantizing,
        float32 bytes for an encoder that takes raw values, else a float tensor on the device.
        On the CPU, qtool.native's decoders where they have the type (bit for bit torch's)."""
        from qtool.conventions import decoder_for

        weight = job.weight
        if job.action == QUANTIZE and job.transform is None and self.options.device == "cpu":
            transcodes = getattr(self.encoder(job), "transcodes", None)
            if transcodes is not None and transcodes(weight):  # decoded row by row as it is encoded
                return encoders.StoredBlocks(weight.data.encoding, self.source.read_bytes(weight.data))
        if job.action == DEQUANTIZE:
            wanted = _dequantized_dtype(job)
        elif self.encoder(job).takes == encoders.RAW:
            wanted = "F32"
        else:
            wanted = None  # a tensor
        if (
            wanted is not None
            and self.options.device == "cpu"
            and (job.action in (QUANTIZE, DEQUANTIZE) or job.transform is None)
        ):
            native_decode = native_decoders.decoder(weight, wanted)
            if native_decode is not None:
                return native_decode(self.source)
        decoded = decoder_for(weight).decode(self.source, weight, self.options.device)
        for member in weight.members.values():
            self.source.release(member)
        if wanted is not None:
            return tensor_bytes(decoded.to(storage_dtype(wanted).torch_dtype()))
        return decoded

    def _decoded_exactly(self, job: Job):
        """A DEQUANTIZE job's values in its dtype by way of their float32 decoding, the
        rounding measured against it (`Measurements.written`): float32 is what llama.cpp's and
        every toolchain's dequantization gives, so that is what a conversion is exact against.
        Rounded to nearest even, as a direct decoding to that dtype rounds."""
        wanted = _dequantized_dtype(job)
        decoded = self._decode(replace(job, out_dtype="F32"))
        if wanted == "F32":
            self.measured.written[job.weight.name] = kept_error(decoded, decoded, "F32", "F32")
            return decoded
        narrowed = self._converted(replace(job, out_dtype=wanted), decoded, source="F32")
        self.measured.written[job.weight.name] = kept_error(decoded, narrowed, "F32", wanted)
        return narrowed

    def pieces(self, job: Job, loaded) -> Iterator[Piece]:
        name = job.outputs[0].name
        if job.action == QUANTIZE:
            encoder = self.encoder(job)
            yield from encoder.encode(loaded)
            if encoder.errors is not None:
                self._check_finite(job, encoder.errors)
                if self.options.measure:
                    self.measured.errors[job.weight.name] = encoder.errors
            del self._encoders[id(job)]
        elif job.transform is not None:  # a whole weight, changed as the plan says (GGUF's rotary order)
            if job.action == DEQUANTIZE:
                self._check_decoded(job, loaded)
            data = loaded if job.action == DEQUANTIZE else self._converted(job, loaded)
            if self.options.measure and job.action != DEQUANTIZE:
                dtype = job.weight.data.dtype.name
                self._keep(kept_error(loaded, data, dtype, job.out_dtype or dtype), job.weight.name)
            yield name, job.transform.apply(data, job.weight.shape[0]), 0
        elif job.action == DEQUANTIZE:
            self._check_decoded(job, loaded)
            yield name, loaded, 0
        else:
            yield from self._stream(job)

    def _check_finite(self, job: Job, errors: ErrorStats) -> None:
        """One rule for every encoder, read from the weight's error sums (float64, so a finite
        float32 input never overflows sum x^2): a finite weight must come back finite, else the
        run is refused (a scale that overflows its type: Q8_0's f16 block scale past 65504 * 127);
        a weight holding inf or NaN is encoded as its toolchain does, and reported."""
        if not math.isfinite(errors.signal):
            self.measured.non_finite[job.weight.name] = "NaN" if math.isnan(errors.signal) else "inf"
        elif not math.isfinite(errors.noise):
            raise SchemeError(
                f"{job.weight.name}: its values are finite but too large for {_scheme_name(job)}: a scale overflows its type, and the output would hold inf or NaN",
                hint="leave this weight unquantized, or rescale it",
                option="ignore",
            )

    def _check_decoded(self, job: Job, data) -> None:
        """The same rule on the read side: a quantized weight whose blocks decode to inf or NaN
        (a GGUF IQ or K-quant block whose f16 scale holds one) is written as it decodes, as
        llama.cpp would read it, and reported by name (`non_finite`). Checked whether or not
        the run measures: it costs one pass over the decoded values, a fraction of decoding."""
        counted = count_non_finite_bytes(data, _dequantized_dtype(job))
        if counted is None:
            dtype = storage_dtype(_dequantized_dtype(job))
            counted = count_non_finite(tensor_from_bytes(data, dtype, (memoryview(data).nbytes // (dtype.bits // 8),)))
        nan, inf = counted
        if nan or inf:
            self.measured.non_finite[job.weight.name] = "NaN" if nan else "inf"

    def _stream(self, job: Job) -> Iterator[Piece]:
        """COPY and CAST, in pieces of at most COPY_CHUNK bytes."""
        stored = job.weight.data
        width = max(1, stored.dtype.bits // 8)
        step = max(1, COPY_CHUNK // width) * width
        written = 0
        for start in range(0, stored.nbytes, step):
            data = self.source.read_bytes(stored, start, min(step, stored.nbytes - start))
            self.measured.bytes_read += len(data)
            piece = data if job.action == COPY else self._converted(job, data)
            if self.options.measure:
                self._keep(
                    kept_error(data, piece, stored.dtype.name, job.out_dtype or stored.dtype.name), job.weight.name
                )
            yield job.outputs[0].name, piece, written
            written += memoryview(piece).nbytes

    def _converted(self, job: Job, data, source: str | None = None):
        """`data` (the weight's stored bytes, or `source` bytes) as the job's output dtype: numpy
        for the common floats, torch for the rest (and for inf/NaN, whose bytes torch defines)."""
        from qtool.float_casts import NUMPY_FLOATS, cast

        source = source or job.weight.data.dtype.name
        target = job.out_dtype or source
        if job.action == COPY or source == target:
            return data
        if source in NUMPY_FLOATS and target in NUMPY_FLOATS:
            converted = cast(data, source, target)
            if converted is not None:
                return converted
        import torch

        values = torch.frombuffer(data, dtype=torch.uint8).view(storage_dtype(source).torch_dtype())
        return tensor_bytes(values.to(storage_dtype(target).torch_dtype()))


# what a shard job (`qtool.spread.shard_job`) runs a slice of a plan with, as `execute` runs all of it
Runner = _Runner


def kept_error(original, written, source: str, target: str) -> ErrorStats:
    """The error of a float weight written unquantized (exact for a copy, a cast's rounding
    otherwise), as `ErrorStats` measures everything; nothing for dtypes numpy does not read."""
    from qtool.float_casts import NUMPY_FLOATS, to_float32

    if source not in NUMPY_FLOATS or target not in NUMPY_FLOATS:
        return ErrorStats()
    if original is written and native.available():  # exact: only sum x^2, without numpy
        count = memoryview(original).nbytes // (storage_dtype(source).bits // 8)
        xx = native.sum_squares(original, source, count)
        return ErrorStats(signal=xx, recon=xx, dot=xx, count=count)
    x = to_float32(original, source)
    return ErrorStats().update_numpy(x, x if original is written else to_float32(written, target))


def stream(
    runner: _Runner,
    jobs: list[Job],
    write: Callable[[Job, Piece], None],
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Run `jobs` in order through `runner`, one read ahead on a reader thread and at most
    WRITES_IN_FLIGHT pieces handed to `write` behind, on a writer thread."""
    with (
        ThreadPoolExecutor(1, thread_name_prefix="qtool-read") as reader,
        ThreadPoolExecutor(1, thread_name_prefix="qtool-write") as writer,
    ):
        in_flight: deque[Future] = deque()
        ahead = reader.submit(runner.load, jobs[0]) if jobs else None
        for index, job in enumerate(jobs):
            loaded = ahead.result() if ahead else None
            ahead = reader.submit(runner.load, jobs[index + 1]) if index + 1 < len(jobs) else None
            for piece in runner.pieces(job, loaded):
                in_flight.append(writer.submit(write, job, piece))
                while len(in_flight) > WRITES_IN_FLIGHT:
                    in_flight.popleft().result()
            del loaded  # the next job's compute overlaps this one's last writes
            if on_progress:
                on_progress(job.bytes_in)
        while in_flight:
            in_flight.popleft().result()


def execute(
    plan: Plan,
    output: Output,
    options: ExecOptions = ExecOptions(),
    *,
    before_commit: Callable[[Measurements], None] | None = None,
) -> Measurements:
    """Stream the plan into `output` and commit it; on any error, nothing is committed and the
    temporary output is removed. The inputs are checked unchanged before the commit, and
    `before_commit` (a report, say) runs once everything else is written."""
    runner = _Runner(plan, options)
    started = time.perf_counter()
    layout = plan.layout
    with kernel_threads(options.threads):
        try:
            # inside the try: a file that cannot be created (no space, no permission) must
            # remove the temporary output too
            writers = {i: output.file(name, *layout.header(plan, i)) for i, name in enumerate(plan.files)}

            def write(job: Job, piece: Piece) -> None:
                name, data, at = piece
                writers[job.shard].write(name, data, at)

            stream(runner, plan.jobs, write, options.on_progress)
            write_side_files(plan, layout, output)
            runner.measured.bytes_written = sum(file.size for file in writers.values())
            runner.measured.seconds = time.perf_counter() - started
            if before_commit is not None:
                before_commit(runner.measured)
            plan.source.verify_unchanged()
            output.commit()
        except BaseException:
            output.abort()
            raise
    return runner.measured


def _dequantized_dtype(job: Job) -> str:
    """The dtype a DEQUANTIZE job writes: the plan's, else BF16."""
    return job.out_dtype or "BF16"


def _scheme_name(job: Job) -> str:
    if isinstance(job.encoding, GgmlBlocks):
        return job.encoding.type.name
    return job.scheme.label if job.scheme is not None else "its scheme"


def write_side_files(plan: Plan, layout, output: Output) -> None:
    """The layout's own side files (config.json, ...) and the source's carried-over ones, into
    the output; the same for one process and for a driver of shard jobs."""
    for filename, content in layout.side_files(plan).items():
        output.side_file(filename, content)
    for filename, data in plan.side_bytes:
        output.carry_side_file(filename, data)
    for source, filename in side_file_copies(plan.source, output.single_file):
        output.carry_side_file(filename, read_side_file(plan.source, source))


def side_file_copies(source: Checkpoint, single_file: bool) -> list[tuple[str, str]]:
    """(path, name) of the side files a folder output carries over; see qtool.side_files."""
    from qtool.side_files import carried_over

    return [] if single_file else carried_over(source)


def read_side_file(source: Checkpoint, path: str) -> bytes:
    """A side file's bytes, read through one checked descriptor; see qtool.side_files."""
    from qtool.side_files import read_carried

    return read_carried(source, path)
