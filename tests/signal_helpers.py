"""Signalling a real qtool process from a test, so that the outcome depends neither on how
loaded the machine is nor on how the test run was started (issue 43).

A test waits for a state it can see (qtool's handlers in /proc, a staging folder, a share of the
output staged, a server answering), freezes the process in that state (SIGSTOP), sends its
signal and lets it go on (SIGCONT): the signal then lands in that state every time, where a
sleep lands wherever the scheduler puts it. Every process a test signals starts with the
signals at their default action (`default_signal_dispositions`).

No pytest here: the fuzzers (`python -m tests.fuzz.remote`) use it too."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from collections.abc import Callable


SENT_BY_TESTS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")


def default_signal_dispositions() -> None:
    """`preexec_fn` for every process a test signals: each signal tests send at its default
    action. A test run started in the background of a script (`.ci/run &`, or a CI runner that
    does so) inherits SIGINT and SIGQUIT ignored, and qtool keeps an inherited ignore (as under
    `nohup`): the test's SIGINT was then lost and it waited out its timeout (issue 43)."""
    for name in SENT_BY_TESTS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def _signal_mask(pid: int, field: str) -> int | None:
    """A signal set of /proc/PID/status (`SigCgt`, `SigIgn`); None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1], 16) for line in text.splitlines() if line.startswith(field + ":")), None)


def qtool_handlers_in(process: subprocess.Popen, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> bool:
    """Whether qtool catches every one of `signals` now (its handlers show in /proc: SIGTERM's
    goes in with qtool's first line, SIGINT's replaces Python's own). Fails at once when the
    process ignores one of them: it was started without `default_signal_dispositions` under a
    parent that ignores it, and the signal would be lost."""
    if not Path("/proc/self/status").exists():  # no /proc: nothing to see, nothing to wait for
        return True
    wanted = sum(1 << (s - 1) for s in signals)
    caught, ignored = _signal_mask(process.pid, "SigCgt"), _signal_mask(process.pid, "SigIgn")
    if caught is None or ignored is None:
        return False  # gone
    assert not ignored & wanted, (
        f"the process ignores a signal the test sends (SigIgn {ignored:#x}): start it with preexec_fn=default_signal_dispositions"
    )
    return caught & wanted == wanted


def wait_for_qtool_handlers(
    process: subprocess.Popen, timeout: float = 120, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
) -> None:
    """Until qtool catches every one of `signals` (`qtool_handlers_in`). Before that instant the
    interpreter is still starting and its defaults apply; on a loaded machine that takes longer
    than any fixed delay."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and not qtool_handlers_in(process, signals):
        assert time.monotonic() < deadline, f"qtool's signal handlers did not show within {timeout} s"
        time.sleep(0.001)


def _stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (or gone): a group stop reaches each thread on
    its way back to user space, not all at the same instant."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            state = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in "tTZX":
            return False
    return True


def _running(process: subprocess.Popen | int) -> bool:
    if isinstance(process, subprocess.Popen):
        return process.poll() is None
    try:  # another process's child (a --workers worker): alive until it is a zombie
        return Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def signal_while(process: subprocess.Popen | int, signum: int, holds: Callable[[], bool] = lambda: True) -> bool:
    """Send `signum` while `holds()` is true of the running process (a Popen, or the pid of
    another's child), for certain: stop it (SIGSTOP), check that it still runs and `holds()`
    still holds, send the signal, and let it go on (SIGCONT). The signal is delivered before the
    process runs on, so it lands in that state however loaded the machine is. False, with nothing
    sent, when it has exited or the state has passed."""
    pid = process.pid if isinstance(process, subprocess.Popen) else process
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    try:
        while not _stopped(pid):
            time.sleep(0.0005)
        if not _running(process) or not holds():
            return False
        os.kill(pid, signum)
        return True
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def signal_when(
    process: subprocess.Popen, signum: int, ready: Callable[[], bool] = lambda: True, timeout: float = 300
) -> bool:
    """Poll until `ready()` holds, then send `signum` in that state (`signal_while`). False when
    the process ended first, or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if ready() and signal_while(process, signum, ready):
            return True
        time.sleep(0.001)
    return False
