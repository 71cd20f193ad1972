"""Where shard jobs run: N local processes here, or a Ray cluster (`qtool.spread.ray_executor`).

An executor takes opaque shard jobs (`qtool.spread.shard_job`) and hands back their results; it knows
no file format, no layout and no scheme. It retries a job whose worker was lost (a killed
process, a lost node), up to `retries` times: jobs are pure, so a retry writes the same bytes.
An error a job raises itself (a bad input: a `QtoolError`) is not retried, it is the run's.

Local workers are started with `spawn` (never `fork` of a process that has threads), die with
the driver (PR_SET_PDEATHSIG), and are terminated when the run fails or is interrupted.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Protocol
from collections.abc import Callable

from qtool import libc
from qtool.errors import ShardJobError, UsageError
from qtool.spread.shard_job import ShardJob, ShardResult, run

__all__ = ["Executor", "LocalProcesses", "make_executor", "DEFAULT_RETRIES"]

DEFAULT_RETRIES = 3

OnResult = Callable[[ShardJob, ShardResult], None]


class Executor(Protocol):
    name: str
    workers: int  # how many jobs run at once, for cutting a plan into enough of them
    shared_storage: bool  # jobs write from other machines: the driver checks each range's hash

    def check_inputs(self, paths: list[str], output_parent: str) -> None:
        """Raise UsageError naming the worker (node) that cannot read an input or write beside
        the output, before any work starts."""
        ...

    def run(self, jobs: list[ShardJob], on_result: OnResult) -> None:
        """Run every job; call `on_result` in the caller's thread as each one finishes. Raise
        (after stopping every job still running) when one fails for good."""
        ...


def make_executor(
    name: str,
    *,
    workers: int = 1,
    address: str | None = None,
    retries: int = DEFAULT_RETRIES,
    setup: Callable[[], None] | None = None,
) -> Executor:
    """`local` (N processes here) or `ray` (the cluster at `address`, RAY_ADDRESS, else a
    local one); `setup` runs once in every worker process before its first job."""
    if retries < 0:
        raise UsageError(f"retries {retries} must be at least 0", option="max_retries")
    if name == "local":
        if workers < 1:
            raise UsageError(f"workers {workers} must be at least 1", option="workers")
        return LocalProcesses(workers, retries, setup)
    if name == "ray":
        from qtool.spread.ray_executor import RayCluster

        return RayCluster(address, retries, setup)
    raise UsageError(f"executor {name!r} is not one qtool has", hint="use local or ray", option="executor")


_prctl = libc.function("prctl", (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong))
_PR_SET_PDEATHSIG = 1


def _worker_start(setup: Callable[[], None] | None, parent: int) -> None:
    """In each local worker: die with the driver, even a SIGKILLed one; leave Ctrl-C to the
    driver (it stops the workers itself); then the caller's process settings."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the driver died before the line above
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if setup is not None:
        setup()


class LocalProcesses:
    """`workers` spawned processes on this machine, each running one job at a time."""

    name = "local"
    shared_storage = False  # one page cache, and a lost worker is dead: sizes suffice

    def __init__(self, workers: int, retries: int, setup: Callable[[], None] | None = None) -> None:
        self.workers = workers
        self.retries = retries
        self.setup = setup

    def check_inputs(self, paths: list[str], output_parent: str) -> None:
        """Local workers see what the driver sees: the driver has read the headers already."""

    def run(self, jobs: list[ShardJob], on_result: OnResult) -> None:
        pending = {job.index: job for job in jobs}
        attempts = dict.fromkeys(pending, 0)
        context = multiprocessing.get_context("spawn")
        _start_resource_tracker_quietly()
        while pending:
            before = {process.pid for process in multiprocessing.active_children()}
            pool = ProcessPoolExecutor(
                min(self.workers, len(pending)),
                mp_context=context,
                initializer=_worker_start,
                initargs=(self.setup, os.getpid()),
            )
            try:
                futures = {}
                for job in pending.values():
                    attempts[job.index] += 1
                    futures[pool.submit(run, job)] = job
                lost = []
                while futures:
                    done, _ = wait(futures, return_when=FIRST_COMPLETED)
                    for future in done:
                        job = futures.pop(future)
                        try:
                            result = future.result()
                        except BrokenProcessPool:  # a worker died: every job it held is lost
                            lost.append(job)
                            continue
                        result.attempts = attempts[job.index]
                        on_result(job, result)
                        del pending[job.index]
                for job in lost:
                    if attempts[job.index] > self.retries:
                        raise ShardJobError(
                            f"shard {job.label}: its worker process was lost {attempts[job.index]} times; nothing was committed",
                            hint="a worker killed (out of memory?) or crashed; raise the retries, or run with fewer workers",
                        )
            except BaseException:  # a failure, Ctrl-C or SIGTERM: no worker outlives the run
                pool.shutdown(wait=False, cancel_futures=True)
                _stop_children(before)
                raise
            if lost:  # a broken pool's other workers may still be winding down
                pool.shutdown(wait=False, cancel_futures=True)
                _stop_children(before)
            else:
                pool.shutdown(wait=True)


def _start_resource_tracker_quietly() -> None:
    """multiprocessing's resource tracker, a process that outlives a signalled driver, writes to
    the stderr it was started with. After a signal, a pool's queue finalizer may unlink its
    semaphore and be cut off by the exit before it tells the tracker, which then printed
    "1 leaked semaphore objects" and "No such file" after qtool's one line (under load, in CI,
    although the exit waits for the pool's threads). Started here with its stderr on /dev/null
    (our fd 2 pointed there for the few milliseconds of its start), it still removes what is
    left and says nothing; a tracker already running is left as it is."""
    from multiprocessing import resource_tracker

    try:
        quiet, saved = os.open(os.devnull, os.O_WRONLY), os.dup(2)
    except OSError:
        return
    try:
        os.dup2(quiet, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)


def _stop_children(before: set[int | None]) -> None:
    """Terminate the worker processes this run started (not other children of the caller),
    then reap them."""
    started = [process for process in multiprocessing.active_children() if process.pid not in before]
    for process in started:
        process.terminate()
    for process in started:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
