"""The driver of a run spread over workers (`--workers N`, `--executor ray`): the plan is made
once, here; every output file is created with its header and full size in the staging folder;
the plan is cut into shard jobs (`qtool.spread.shard_job`) that an executor (`qtool.spread.executors`) runs
where it likes; each result is checked against its staged file as it arrives (every range's
size; on a cluster's shared storage also each range's sha256, read back, against the one its job
computed as it wrote: a lost attempt's late write, or storage that lost a write, fails the run); the reports are merged in plan order, so the document is the one a
single process writes; and the output is committed atomically, as `qtool.pipeline.execute`
commits it. On any failure, nothing is committed and the staging (every staged file) is removed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable

from qtool.errors import ShardJobError
from qtool.spread.executors import Executor
from qtool.formats.writer import Output
from qtool.pipeline import ExecOptions, Measurements, write_side_files
from qtool.plan import Plan
from qtool.spread.shard_job import ShardJob, ShardResult, split, verify

__all__ = ["ShardRecord", "WorkerPool", "execute_sharded", "threads_per_worker", "worker_pool"]


@dataclass(frozen=True)
class ShardRecord:
    """One shard job as it ran, for the report: where, how long, how many bytes, how many tries."""

    label: str
    node: str
    worker: str
    seconds: float
    bytes_in: int
    bytes_out: int
    attempts: int
    peak_rss_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "shard": self.label,
            "node": self.node,
            "worker": self.worker,
            "seconds": round(self.seconds, 3),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "attempts": self.attempts,
            "peak_rss_bytes": self.peak_rss_bytes,
        }


# a spawned worker's own footprint before its first job: Python, numpy and qtool (a job that
# imports torch costs more; the estimate is a ceiling on the pool, not a promise)
WORKER_BASE_BYTES = 192 << 20


@dataclass(frozen=True)
class WorkerPool:
    """How many local worker processes a spread run starts, and why that many: at most the
    `requested` count, the shard `jobs` a split makes (a worker without a job is a process for
    nothing), and what the `available` memory holds at `per_worker` bytes each."""

    workers: int
    requested: int
    jobs: int
    per_worker: int
    available: int | None

    @property
    def capped(self) -> bool:
        return self.workers < self.requested

    @property
    def by_memory(self) -> bool:
        """Memory, not the job count, set the pool."""
        return self.capped and self.workers < min(self.requested, self.jobs)


def job_working_set(job) -> int:
    """A ceiling on the bytes one plan job holds at its peak in a worker: its input as read, the
    weight's float32 values twice (decoded, and the decoded output its error is measured on),
    and its encoded output."""
    elements = 1
    for size in job.weight.shape:
        elements *= size
    return job.bytes_in + 8 * elements + job.bytes_out


def available_memory() -> int | None:
    """The memory new processes can take without swapping (Linux's MemAvailable), else the free
    pages, else None (unknown)."""
    try:
        with open("/proc/meminfo", "rb") as handle:
            for line in handle.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


_UNKNOWN = object()


def worker_pool(plan: Plan, requested: int, available: Any = _UNKNOWN) -> WorkerPool:
    """The local pool for `requested` workers: capped at the shard jobs `split` makes of the plan
    for that many, and at `available` memory (default: `available_memory()`; None: no memory
    cap) over one worker's estimate (`WORKER_BASE_BYTES` + two jobs' working sets at the
    largest: a worker reads one job ahead while it encodes another). Never below one."""
    from qtool.spread.shard_job import shard_count

    if available is _UNKNOWN:
        available = available_memory()
    jobs = shard_count(plan, requested)
    per_worker = WORKER_BASE_BYTES + 2 * max((job_working_set(job) for job in plan.jobs), default=0)
    workers = min(requested, max(1, jobs))
    if available is not None:
        workers = min(workers, max(1, available // per_worker))
    return WorkerPool(workers, requested, jobs, per_worker, available)


def threads_per_worker(threads: int | None, workers: int) -> int:
    """`--threads` divided among the workers, never multiplied (default: every CPU here)."""
    return max(1, (threads or os.cpu_count() or 1) // workers)


def execute_sharded(
    plan: Plan,
    output: Output,
    options: ExecOptions,
    executor: Executor,
    *,
    before_commit: Callable[[Measurements, list[ShardRecord]], None] | None = None,
) -> tuple[Measurements, list[ShardRecord]]:
    """Run `plan` as shard jobs on `executor` and commit `output`; see the module docstring.
    `options.threads` is each job's share; `options.on_progress` gets input bytes per job."""
    started = time.perf_counter()
    layout = plan.layout
    records: dict[int, ShardRecord] = {}
    results: dict[int, ShardResult] = {}
    try:
        executor.check_inputs(list(plan.source.files), os.path.dirname(output.target))
        writers = [output.file(name, *layout.header(plan, i)) for i, name in enumerate(plan.files)]
        for writer in writers:
            writer.close()  # the jobs write through their own descriptors; commit fsyncs by path
        job_options = replace(options, on_progress=None)
        jobs = split(plan, [w.path for w in writers], [w.ranges for w in writers], job_options, executor.workers)
        for job in jobs:
            job.hashed = executor.shared_storage

        def on_result(job: ShardJob, result: ShardResult) -> None:
            problem = verify(job, result)
            if problem is not None:
                raise ShardJobError(
                    f"shard {job.label}: the staged file does not check out: {problem}; nothing was committed",
                    path=job.path,
                )
            results[job.index] = result
            records[job.index] = ShardRecord(
                job.label,
                result.node,
                result.worker,
                result.seconds,
                result.bytes_in,
                result.bytes_out,
                result.attempts,
                result.peak_rss_bytes,
            )
            if options.on_progress:
                options.on_progress(job.bytes_in)

        executor.run(jobs, on_result)
        measured = _merged(plan, jobs, results)
        write_side_files(plan, layout, output)
        measured.bytes_written = sum(writer.size for writer in writers)
        measured.seconds = time.perf_counter() - started
        shards = [records[index] for index in sorted(records)]
        if before_commit is not None:
            before_commit(measured, shards)
        plan.source.verify_unchanged()
        _fsync_files([writer.path for writer in writers])
        output.commit()
    except BaseException:
        output.abort()
        raise
    return measured, shards


def _merged(plan: Plan, jobs: list[ShardJob], results: dict[int, ShardResult]) -> Measurements:
    """The jobs' measurements merged in plan order: the same sums, in the same order, as one
    process running the whole plan makes, so the report is the same to the last bit."""
    measured = Measurements()
    errors = {}
    non_finite: dict[str, str] = {}
    for job in jobs:
        result = results[job.index]
        errors.update(result.errors)
        non_finite.update(result.non_finite)
        for stats in result.kept:
            measured.unquantized = measured.unquantized.merge(stats)
        measured.bytes_read += result.bytes_read
    measured.errors = {job.weight.name: errors[job.weight.name] for job in plan.jobs if job.weight.name in errors}
    measured.non_finite = {
        job.weight.name: non_finite[job.weight.name] for job in plan.jobs if job.weight.name in non_finite
    }
    return measured


def _fsync_files(paths: list[str]) -> None:
    """The staged files reach the disk before the rename publishes them (each job fsynced what
    it wrote; the header is the driver's)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
