"""Shard jobs on a Ray cluster (`--executor ray`, the optional extra `qtool[ray]`, Ray 2.x).

One Ray task per shard job, `num_cpus` its share of threads; jobs and results travel through
Ray's object store; staged files are written by the tasks straight into the staging folder
beside the output, which every node must see (shared storage). Ray retries a task whose worker
or node was lost (`max_retries`); an error the job raises itself (a `QtoolError`: a bad input)
is not retried; each attempt checks in with a counting actor first, so the report's
`attempts` counts Ray's retries too. On any failure, or when the driver is interrupted, every task still running is
cancelled (force: its worker process is killed) and the driver disconnects, so the cluster
keeps no qtool task; the driver then removes the staging.

Like `qtool.spread.executors`, this knows no file format: it moves opaque shard jobs.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable

from qtool.errors import QtoolError, ShardJobError, UsageError
from qtool.spread.shard_job import ShardJob, ShardResult, run

__all__ = ["RayCluster"]

_setup_done = False


class _Attempts:
    """A Ray actor (no CPU) that counts each shard job's attempts: every attempt of a task checks
    in before it works, so one whose worker is lost afterwards counts too. Ray retries out of the
    driver's sight; this is how the report's `attempts` sees them."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def start(self, index: int) -> None:
        self.counts[index] = self.counts.get(index, 0) + 1

    def count(self, index: int) -> int:
        return self.counts.get(index, 0)


def _check_in(counter, index: int) -> None:
    """Best effort: a counter that cannot answer (its node lost) never fails the job."""
    if counter is None:
        return
    import ray

    try:
        ray.get(counter.start.remote(index))
    except Exception:
        pass


def _run_task(job: ShardJob, setup: Callable[[], None] | None, counter=None) -> ShardResult:
    """In a Ray worker: check in with the attempt counter, the caller's process settings once per
    worker process, then the job."""
    global _setup_done
    _check_in(counter, job.index)
    if setup is not None and not _setup_done:
        setup()
        _setup_done = True
    result = run(job)
    import ray

    result.node = (
        f"{socket.gethostname()} ({ray.get_runtime_context().get_node_id()[:12]})"  # one host may run several nodes
    )
    return result


def _probe(paths: list[str], output_parent: str) -> tuple[str, list[str]]:
    """On one node: this node's name, and why it cannot read an input or write the output."""
    problems = []
    for path in paths:
        try:
            with open(path, "rb") as handle:
                handle.read(8)
        except OSError as exc:
            problems.append(f"cannot read {path}: {exc.strerror or exc}")
    if not os.access(output_parent, os.W_OK | os.X_OK):
        problems.append(f"cannot write in {output_parent}")
    return socket.gethostname(), problems


def _reachable(address: str | None, timeout: float = 10.0) -> None:
    """A `host:port` cluster address that does not answer is a one-line error in seconds;
    ray.init would retry for minutes, deaf to signals."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise UsageError(f"Ray address {address!r} is not host:port", option="ray_address")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as exc:
        raise UsageError(
            f"cannot connect to the Ray cluster at {address}: {exc.strerror or exc}",
            hint="start it with `ray start --head`, or name another (the ray address, or RAY_ADDRESS)",
            option="ray_address",
        ) from None


class _RayStartupNotes:
    """Ray's loggers during `ray.init`: its start-up notes (the token mode of a local Ray started
    for this run) are not qtool's lines; anything that fails still raises. `ray.init` clears the
    handlers of the "ray" logger itself, so the one below it, where its start-up code logs, holds
    the quiet handler."""

    NAMES = ("ray", "ray._private")

    def __enter__(self) -> None:
        import logging

        self.loggers = [logging.getLogger(name) for name in self.NAMES]
        self.saved = [(logger.propagate, list(logger.handlers)) for logger in self.loggers]
        for logger in self.loggers:
            logger.propagate = False
            logger.handlers = [logging.NullHandler()]

    def __exit__(self, *exc: object) -> None:
        for logger, (propagate, handlers) in zip(self.loggers, self.saved):
            logger.propagate, logger.handlers = propagate, handlers


def _shutdown_quietly(ray) -> None:
    try:
        ray.shutdown()
    except BaseException:
        pass


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError(
            "the ray executor needs Ray, which is not installed", hint="pip install 'qtool[ray]'", option="executor"
        ) from None
    return ray


class RayCluster:
    """The Ray cluster at `address` (else RAY_ADDRESS, else a Ray started for this run)."""

    name = "ray"
    shared_storage = True

    def __init__(self, address: str | None, retries: int, setup: Callable[[], None] | None = None) -> None:
        self.ray = _import_ray()
        self.address = address
        self.retries = retries
        self.setup = setup
        self.workers = 1
        self.largest_node = 0
        self._connected = False

    def _connect(self) -> None:
        if self._connected:
            return
        ray = self.ray
        # ray.init puts its own SIGTERM handlers in place while it runs (`sys.exit(15)` before a
        # local Ray starts, kill its processes and `sys.exit(1)` after): a SIGTERM in that time
        # ended qtool with code 15 and no line, or 1, which CI reads as a gate's violation. The
        # caller's handler (the CLI's cleanup, exit 143) is put back, and a SystemExit out of
        # ray.init, which only those handlers raise, is handed to it as the SIGTERM it was.
        _reachable(self.address or os.environ.get("RAY_ADDRESS"))
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        try:
            with _RayStartupNotes():
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = self.address or os.environ.get("RAY_ADDRESS") or "a local Ray"
            raise UsageError(
                f"cannot connect to the Ray cluster at {where}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                hint="start it with `ray start --head`, or name another (the ray address, or RAY_ADDRESS)",
                option="ray_address",
            ) from None
        except BaseException as stopped:  # a signal, or Ray's SIGTERM handler: stop the Ray it started
            _shutdown_quietly(ray)
            if main and previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if isinstance(stopped, SystemExit) and callable(previous):
                previous(signal.SIGTERM, None)  # the CLI's handler raises its Terminated
            raise
        finally:
            if main and previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self._connected = True
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.largest_node = max(
            (int(node.get("Resources", {}).get("CPU", 0)) for node in ray.nodes() if node.get("Alive")), default=0
        )

    def _disconnect(self) -> None:
        if self._connected:
            self._connected = False
            self.ray.shutdown()

    def check_inputs(self, paths: list[str], output_parent: str) -> None:
        """One probe per live node, each pinned to its node: every input readable, the output's
        folder writable; else a UsageError naming the node."""
        self._connect()
        ray = self.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        try:
            probe = ray.remote(_probe)
            refs = {}
            for node in ray.nodes():
                if node.get("Alive"):
                    strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
                    refs[
                        probe.options(num_cpus=0, scheduling_strategy=strategy, max_retries=0).remote(
                            paths, output_parent
                        )
                    ] = node.get("NodeManagerAddress", node["NodeID"])
            for ref, address in refs.items():
                host, problems = ray.get(ref)
                if problems:
                    raise UsageError(
                        f"Ray node {host} ({address}) {problems[0]}",
                        hint="inputs and outputs must be on storage every node mounts at the same path",
                        option="executor",
                    )
        except BaseException:
            self._disconnect()
            raise

    def run(self, jobs: list[ShardJob], on_result: Callable[[ShardJob, ShardResult], None]) -> None:
        self._connect()
        ray = self.ray
        refs: dict = {}
        try:
            task = ray.remote(_run_task)
            wanted = max(job.options.threads or 1 for job in jobs) if jobs else 1
            if wanted > self.largest_node:  # Ray would wait for such a node for ever
                raise UsageError(
                    f"each shard job asks for {wanted} CPUs, and no node of the Ray cluster has more than {self.largest_node}",
                    hint="lower the threads (under Ray, the CPUs of one task)",
                    option="threads",
                )
            counter = self._counter()
            for job in jobs:
                threads = job.options.threads or 1
                refs[
                    task.options(
                        num_cpus=threads,
                        max_retries=self.retries,
                        retry_exceptions=False,
                        name=f"qtool shard {job.index}",
                    ).remote(job, self.setup, counter)
                ] = job
            while refs:
                done, _ = ray.wait(list(refs), num_returns=1)
                for ref in done:
                    job = refs.pop(ref)
                    result = self._result(ref, job)
                    result.attempts = self._attempts(counter, job.index)
                    on_result(job, result)
        except BaseException:
            for ref in refs:
                try:
                    ray.cancel(ref, force=True)
                except Exception:
                    pass
            raise
        finally:
            self._disconnect()

    def _counter(self):
        """The attempt counter (`_Attempts`), or None where the cluster will not start it."""
        try:
            return self.ray.remote(num_cpus=0, max_restarts=0)(_Attempts).remote()
        except Exception:
            return None

    def _attempts(self, counter, index: int) -> int:
        """How many times Ray ran the job, as its attempts checked in; 0 when not counted."""
        if counter is None:
            return 0
        try:
            return int(self.ray.get(counter.count.remote(index)))
        except Exception:
            return 0

    def _result(self, ref, job: ShardJob) -> ShardResult:
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, QtoolError):
                raise cause from None
            raise
        except (
            ray.exceptions.WorkerCrashedError,
            ray.exceptions.NodeDiedError,
            ray.exceptions.ObjectLostError,
            ray.exceptions.TaskCancelledError,
        ) as exc:
            raise ShardJobError(
                f"shard {job.label}: its Ray task was lost ({type(exc).__name__}) after {self.retries} retries; nothing was committed",
                hint="a worker or node died; raise the retries, or check the cluster",
                option="max_retries",
            ) from None
