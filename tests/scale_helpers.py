"""What the `--workers` and `--executor ray` tests share: running qtool as a user does, comparing
outputs byte for byte and reports less timings, and finding the processes that hold a staged
file open (a shard job in the middle of its work)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.signal_helpers import default_signal_dispositions, signal_while

REPO = Path(__file__).resolve().parent.parent
STAGING_MARK = ".qtool-tmp-"


def qtool(*args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


CONSOLE_SCRIPT = "import sys\nfrom qtool.cli import main\n\nif __name__ == '__main__':\n    sys.exit(main())\n"


def console_script(folder: Path) -> list[str]:
    """The command line of a `qtool` console script like the one pip writes (its file named
    `qtool`, which a spawned worker is told is its main module), importing this checkout."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "qtool").write_text(CONSOLE_SCRIPT)
    return [sys.executable, str(folder / "qtool")]


def start_qtool(*args, env: dict | None = None, program: list[str] | None = None) -> subprocess.Popen:
    """A qtool run a test may signal: the signals at their default action (a test run in the
    background of a script would otherwise pass on SIGINT ignored). `program`: how qtool is
    started (`python -m qtool` unless given)."""
    if program is not None:
        env = {**(os.environ if env is None else env), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [*(program or [sys.executable, "-m", "qtool"]), *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=default_signal_dispositions,
    )


def files_of(output: Path) -> dict[str, bytes]:
    if output.is_file():
        return {output.name: output.read_bytes()}
    return {path.name: path.read_bytes() for path in sorted(output.iterdir())}


def assert_same_output(a: Path, b: Path) -> None:
    first, second = files_of(a), files_of(b)
    assert sorted(first) == sorted(second)
    for name in first:
        assert first[name] == second[name], f"{name} differs"


def report_less_timings(document: dict) -> dict:
    """A run's document without what differs between two runs of one plan: timings, where the
    jobs ran, and the output's own path."""
    document = json.loads(json.dumps(document))
    document.pop("seconds", None)
    document.pop("execution", None)
    document.pop("output", None)
    document.get("models", {}).get("output", {}).pop("path", None)
    return document


def staging_left(folder: Path) -> list[str]:
    return [name for name in os.listdir(folder) if STAGING_MARK in name]


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (a `--workers` driver's pool, its forkserver's children too)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


def processes_writing(
    staging_parent: Path, exclude: set[int] = frozenset(), among: list[int] | None = None
) -> list[int]:
    """PIDs (other than `exclude`; of `among` where given, else of all) with a file in a staging
    folder of `staging_parent` open. `among` keeps the scan to a few processes: a scan of all of
    /proc on a loaded machine outlasted a shard's whole write, and the test saw no writer."""
    found = []
    for entry in map(str, among) if among is not None else os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith(str(staging_parent)) and STAGING_MARK in target:
                    found.append(int(entry))
                    break
        except OSError:
            continue
    return found


def kill_a_writer(
    staging_parent: Path, process: subprocess.Popen, timeout: float = 300, local: bool = False
) -> int | None:
    """SIGKILL a worker (not `process`, the driver) while it holds a staged file open, frozen in
    that state (`signal_while`), so its job is certainly lost, not just finished. Its PID, or
    None when the run ended first. `local`: the workers are the driver's descendants (`--workers`),
    so only those are scanned."""
    deadline = time.monotonic() + timeout

    def writing() -> list[int]:
        return processes_writing(staging_parent, {process.pid}, descendants(process.pid) if local else None)

    while time.monotonic() < deadline and process.poll() is None:
        for pid in writing():
            if signal_while(pid, signal.SIGKILL, lambda: pid in writing()):  # noqa: B023
                return pid
        time.sleep(0.002)
    return None
