"""Whole-process wall time and peak RSS of a child command, with the standard library only.

`measure()` starts the command, reaps it with `os.wait4`, and returns the child's own
`ru_maxrss` (not the sum over all children that `getrusage(RUSAGE_CHILDREN)` would give).

What the figure means, on Linux:
- `ru_maxrss` is the high-water mark of the child's resident set: anonymous memory *and* the
  file-backed pages it had mapped and touched (an mmap-ed safetensors file counts, page by page,
  while it stays mapped and resident). Grandchildren are not included.
- A child started from a big parent can inherit the parent's high-water mark through fork/exec,
  so keep the measuring parent small: the callers here import neither torch nor numpy.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from collections.abc import Callable


@dataclass(frozen=True)
class Measurement:
    wall_s: float
    cpu_s: float  # the child's user + system CPU time; unlike wall time, not inflated by contention
    peak_rss_bytes: int
    returncode: int  # negative: killed by that signal
    timed_out: bool
    stdout_path: Path
    stderr_path: Path

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def stderr_tail(self, lines: int = 25) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return "(no stderr)"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(no stderr)"


def measure(
    cmd: list[str],
    *,
    log_stem: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> Measurement:
    """Run `cmd` to completion; stdout and stderr go to `log_stem`.stdout/.stderr (files, not
    pipes, so a chatty child can neither block nor be timed reading its pipe).

    Wall time runs from just before the child is spawned to just after it is reaped.
    On timeout the child's whole process group is killed and `timed_out` is set.
    """
    out_path = log_stem.with_name(log_stem.name + ".stdout")
    err_path = log_stem.with_name(log_stem.name + ".stderr")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group, so a timeout kills it all
        )
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout_s, kill) if timeout_s else None
        if timer:
            timer.start()
        try:
            while True:
                try:
                    _, status, usage = os.wait4(proc.pid, 0)
                    break
                except InterruptedError:  # pragma: no cover - PEP 475 retries already
                    continue
        finally:
            if timer:
                timer.cancel()
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait
    return Measurement(
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss_bytes=usage.ru_maxrss * 1024,  # Linux reports KiB
        returncode=proc.returncode,
        timed_out=fired.is_set(),
        stdout_path=out_path,
        stderr_path=err_path,
    )


def print_environment(distributions: tuple[str, ...]) -> None:
    """The two header lines every benchmark prints: Python and package versions, the machine."""
    versions = []
    for dist in distributions:
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist} (not installed)")
    print(f"python {platform.python_version()}  {'  '.join(versions)}")
    print(f"{platform.machine()} {os.cpu_count()} cpus  {platform.platform()}")


def in_work_dir(workdir: Path | None, prefix: str, keep: bool, body: Callable[[Path], int]) -> int:
    """body(root) in a fresh temporary folder (under `workdir` if given), removed afterwards
    unless `keep`."""
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))
    try:
        return body(root)
    finally:
        if keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
