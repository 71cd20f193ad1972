"""A shard job: one slice of a plan run where it lands, the unit every executor hands out.

    ShardJob     (plan slice, input checkpoint, staged file path, the slice's byte ranges)
    ShardResult  what the job wrote (per tensor: bytes and sha256) and its report rows
    run          ShardJob -> ShardResult: the executor's work, in whatever process runs it
    verify       the driver's check of a staged file against a result, before the commit

The driver (`qtool.spread.distribute`) plans once, creates every output file with its header and full
size, and cuts the plan into shard jobs; a job writes only its own tensors' byte ranges of a
file that already exists. Jobs are pure: the same job writes the same bytes at the same
offsets, so a retried job (a worker or node lost) is harmless, and the driver checks every
range's hash before it commits anything.

A job knows no executor and no file format: its ranges come from the layout's header, its
pieces from `qtool.pipeline`'s runner, as on one machine.
"""

from __future__ import annotations

import copy
import hashlib
import os
import resource
import socket
import time
from dataclasses import dataclass, field

from qtool.error_measures import ErrorStats
from qtool.errors import CheckpointError
from qtool.formats.checkpoint import Checkpoint
from qtool.plan import Job, Piece
from qtool.pipeline import ExecOptions, Runner, kernel_threads, stream

__all__ = ["ShardJob", "ShardResult", "split", "shard_count", "run", "verify"]

_HASH_CHUNK = 16 << 20  # bytes per read when a range is hashed from the file


@dataclass
class ShardJob:
    """One slice of a plan: `jobs` (in plan order) write their tensors into `path` (a staged
    file the driver created) at `ranges` (absolute byte offsets)."""

    index: int
    label: str  # how messages name it: the output file, and the part of it
    path: str
    jobs: list[Job]
    layout: object  # the plan's Layout, which chooses the encoders
    source: Checkpoint  # the input, with only the stored tensors this slice reads
    ranges: dict[str, tuple[int, int]]
    options: ExecOptions
    hashed: bool = True  # sha256 each range as it is written, for the driver to check against the file

    @property
    def bytes_in(self) -> int:
        return sum(job.bytes_in for job in self.jobs)


@dataclass
class ShardResult:
    """What a shard job wrote and measured. `errors` and `kept` are in the order the job
    measured them, for the driver to merge as one process would have."""

    index: int
    tensors: dict[str, tuple[int, str]]  # output tensor -> (bytes written, sha256 hex; "" when not hashed)
    errors: list[tuple[str, ErrorStats]] = field(default_factory=list)
    kept: list[ErrorStats] = field(default_factory=list)
    non_finite: dict[str, str] = field(default_factory=dict)  # quantized weight -> "NaN" | "inf" it held
    bytes_read: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    worker: str = ""  # pid on node
    node: str = ""
    peak_rss_bytes: int = 0  # the worker process's high-water mark so far (Linux ru_maxrss)
    attempts: int = 1  # set by the executor


def _slice_source(source: Checkpoint, jobs: list[Job]) -> Checkpoint:
    """A copy of the input that carries only the stored tensors `jobs` read, no descriptors,
    and the file identities the plan was made from (a worker reading a changed file fails)."""
    needed = {member.name for job in jobs for member in job.weight.members.values()}
    sliced = copy.copy(source)
    sliced.tensors = {name: tensor for name, tensor in source.tensors.items() if name in needed}
    files = {tensor.file for tensor in sliced.tensors.values()}
    sliced.files = [file for file in source.files if file in files]
    sliced._fds = {}
    sliced._identity = {file: identity for file, identity in source._identity.items() if file in files}
    return sliced


def split(
    plan, paths: list[str], ranges: list[dict[str, tuple[int, int]]], options: ExecOptions, parts: int
) -> list[ShardJob]:
    """The plan as shard jobs, in plan order: one per output file, and a file's jobs cut into
    contiguous slices of about equal input bytes where there are fewer files than `parts` (a
    GGUF output is one file). `paths[i]` and `ranges[i]` are file i's staged path and tensor ranges."""
    runs = _runs(plan)
    slices_per_run = _slices_per_run(runs, parts)
    shard_jobs: list[ShardJob] = []
    for jobs in runs:
        shard = jobs[0].shard
        pieces = _balanced(jobs, slices_per_run)
        for number, slice_jobs in enumerate(pieces):
            label = (
                plan.files[shard] if len(pieces) == 1 else f"{plan.files[shard]} (part {number + 1} of {len(pieces)})"
            )
            names = {tensor.name for job in slice_jobs for tensor in job.outputs}
            shard_jobs.append(
                ShardJob(
                    index=len(shard_jobs),
                    label=label,
                    path=paths[shard],
                    jobs=slice_jobs,
                    layout=plan.layout,
                    source=_slice_source(plan.source, slice_jobs),
                    ranges={name: span for name, span in ranges[shard].items() if name in names},
                    options=options,
                )
            )
    return shard_jobs


def shard_count(plan, parts: int) -> int:
    """How many shard jobs `split(..., parts)` makes of `plan`, without making them; linear."""
    runs = _runs(plan)
    slices_per_run = _slices_per_run(runs, parts)
    return sum(len(_balanced(jobs, slices_per_run)) for jobs in runs)


def _runs(plan) -> list[list[Job]]:
    """The plan's jobs by output file, in plan order (the driver merges the reports in it)."""
    runs: list[list[Job]] = []
    for job in plan.jobs:
        if not runs or runs[-1][-1].shard != job.shard:
            runs.append([])
        runs[-1].append(job)
    return runs


def _slices_per_run(runs: list[list[Job]], parts: int) -> int:
    return max(1, -(-parts // max(1, len(runs))))


def _balanced(jobs: list[Job], count: int) -> list[list[Job]]:
    """`jobs` cut into at most `count` contiguous runs of about equal input bytes; linear."""
    total = sum(job.bytes_in for job in jobs)
    if count <= 1 or len(jobs) <= 1 or total == 0:
        return [jobs]
    target = total / count
    runs: list[list[Job]] = [[]]
    done = 0
    for job in jobs:
        if runs[-1] and done >= target * len(runs) and len(runs) < count:
            runs.append([])
        runs[-1].append(job)
        done += job.bytes_in
    return runs


class _Hashes:
    """sha256 of each output tensor, fed its pieces as they are written. A piece that does not
    continue where the last one ended marks the tensor to be hashed from the file instead."""

    def __init__(self, ranges: dict[str, tuple[int, int]]) -> None:
        self.hashers = {name: hashlib.sha256() for name in ranges}
        self.next = dict.fromkeys(ranges, 0)
        self.written = dict.fromkeys(ranges, 0)
        self.reread: set[str] = set()

    def add(self, name: str, data, at: int) -> None:
        size = memoryview(data).nbytes
        self.written[name] += size
        if name in self.reread:
            return
        if at != self.next[name]:
            self.reread.add(name)
            return
        self.hashers[name].update(data)
        self.next[name] = at + size


def _hash_range(fd: int, begin: int, end: int, path: str) -> str:
    hasher = hashlib.sha256()
    offset = begin
    while offset < end:
        data = os.pread(fd, min(_HASH_CHUNK, end - offset), offset)
        if not data:
            raise CheckpointError(f"staged file ends at byte {offset}, before {end}", path=path)
        hasher.update(data)
        offset += len(data)
    return hasher.hexdigest()


def run(shard_job: ShardJob) -> ShardResult:
    """Write a shard job's tensors into its staged file and return what it wrote and measured.
    Re-running it writes the same bytes at the same places."""
    started = time.perf_counter()
    runner = Runner(_PlanView(shard_job), shard_job.options)
    runner.kept = []
    hashes = _Hashes(shard_job.ranges)
    try:
        fd = os.open(shard_job.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"cannot open the staged file: {exc.strerror or exc}", path=shard_job.path) from None
    try:

        def write(job: Job, piece: Piece) -> None:
            name, data, at = piece
            begin, end = shard_job.ranges[name]
            size = memoryview(data).nbytes
            if at < 0 or begin + at + size > end:
                raise RuntimeError(f"{name}: write of {size} bytes at {at} overruns its {end - begin} bytes")
            view, offset = memoryview(data).cast("B"), begin + at
            while view.nbytes:
                done = os.pwrite(fd, view, offset)
                view, offset = view[done:], offset + done
            if shard_job.hashed:
                hashes.add(name, data, at)
            else:
                hashes.written[name] += size

        with kernel_threads(shard_job.options.threads):
            stream(runner, shard_job.jobs, write)
        os.fsync(fd)  # on shared storage, the driver reads what this node wrote
        digests = {}
        for name, (begin, end) in shard_job.ranges.items():
            if not shard_job.hashed:
                digests[name] = (hashes.written[name], "")
            elif name in hashes.reread or hashes.written[name] != end - begin:
                digests[name] = (hashes.written[name], _hash_file_range(shard_job.path, begin, end))
            else:
                digests[name] = (hashes.written[name], hashes.hashers[name].hexdigest())
    except OSError as exc:
        raise CheckpointError(f"cannot write: {exc.strerror or exc}", path=shard_job.path) from None
    finally:
        os.close(fd)
        shard_job.source.close()
    measured = runner.measured
    return ShardResult(
        index=shard_job.index,
        tensors=digests,
        errors=list(measured.errors.items()),
        kept=runner.kept,
        non_finite=dict(measured.non_finite),
        bytes_read=measured.bytes_read,
        bytes_in=shard_job.bytes_in,
        bytes_out=sum(end - begin for begin, end in shard_job.ranges.values()),
        seconds=time.perf_counter() - started,
        worker=str(os.getpid()),
        node=socket.gethostname(),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def _hash_file_range(path: str, begin: int, end: int) -> str:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return _hash_range(fd, begin, end, path)
    finally:
        os.close(fd)


class _PlanView:
    """What `qtool.pipeline`'s runner reads of a plan, for one shard job."""

    def __init__(self, shard_job: ShardJob) -> None:
        self.source = shard_job.source
        self.layout = shard_job.layout
        self.jobs = shard_job.jobs


def verify(shard_job: ShardJob, result: ShardResult) -> str | None:
    """Why the staged file does not hold what `result` says the job wrote (every range's size,
    and where the job hashed them, each range's sha256 read back from the file); None when it
    does."""
    try:
        size = os.stat(shard_job.path).st_size
    except OSError as exc:
        return f"cannot check it: {exc.strerror or exc}"
    if shard_job.ranges and size < max(end for _, end in shard_job.ranges.values()):
        return f"it is {size} bytes, shorter than its tensors' ranges"
    for name, (begin, end) in shard_job.ranges.items():
        got = result.tensors.get(name)
        if got is None:
            return f"tensor {name!r} was not written"
        written, digest = got
        if written != end - begin:
            return f"tensor {name!r} got {written} of its {end - begin} bytes"
        if not shard_job.hashed:
            continue
        try:
            actual = _hash_file_range(shard_job.path, begin, end)
        except OSError as exc:
            return f"cannot read it back: {exc.strerror or exc}"
        except CheckpointError as exc:
            return exc.message
        if actual != digest:
            return f"tensor {name!r} does not hold the bytes the job wrote (sha256 differs)"
    return None
