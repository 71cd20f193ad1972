"""Run the real `qtool` CLI on one case in a forked child of a process that has already imported
qtool and torch, so a case costs a fork instead of an interpreter start and a torch import.

The child redirects stdout and stderr to files, limits its data segment (RLIMIT_DATA: RLIMIT_AS
is useless with torch, which reserves large address ranges), calls `qtool.cli.main()` with the
case's arguments and leaves with `os._exit`. The parent polls its children: one running past
the time limit, or whose resident memory grows past the memory limit, first gets SIGVTALRM (the
child's faulthandler then dumps every thread's stack to stderr, which names where it hung) and
is killed a moment later. (Not SIGUSR1: qtool's CLI handles that one, cleaning up and exiting.)

Memory is measured as growth: a forked child starts with the parent's pages counted in its RSS
(and in `ru_maxrss`), so the limit applies to `peak RSS - RSS at fork`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ACCEPTED", "FINDING_CLASSES", "Limits", "Result", "Runner", "classify", "preload"]

MiB = 1024 * 1024
_OUTPUT_CAP = 4 * 1024 * 1024  # bytes of stdout/stderr read per case


@dataclass(frozen=True)
class Limits:
    seconds: float = 10.0
    memory: int = 1024 * MiB  # peak RSS growth over the fork server


@dataclass
class Result:
    argv: list[str]
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    seconds: float
    peak_rss_growth: int  # bytes
    stdout: str
    stderr: str
    killed_for: str | None = None  # "timeout" | "memory"
    outcome: str = ""  # see classify
    extra: dict = field(default_factory=dict)


# Outcome classes. Accepted: exit 0; exit 2 with one `error:` line and no traceback; and for
# `check` only, exit 1 with its one `error: N findings break the policy` line (the gate found
# NaN/Inf in a file whose data was flipped: exit 1 is what `check` is for). Everything else is
# a finding.
ACCEPTED = ("exit0", "exit2-one-line", "check-gate")
FINDING_CLASSES = (
    "internal-error",  # exit 70
    "exit1",  # exit 1 from a command that has no gate, or a check exit 1 that printed an error
    "exit2-not-one-line",
    "traceback",
    "signal",
    "timeout",
    "memory",
    "other-exit",
    "unexpected",  # a handmade case whose case.json `expect`s another accepted outcome or stderr (campaign._expected)
)


def classify(result: Result) -> str:
    err = result.stderr
    if result.killed_for:
        return result.killed_for
    if result.signal is not None:
        return "signal"
    if "Traceback (most recent call last)" in err or "Traceback (most recent call last)" in result.stdout:
        return "traceback"
    code = result.exit_code
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    if code == 70 or any("internal error" in line for line in error_lines):
        return "internal-error"
    if "MemoryError" in err or "can't allocate memory" in err:
        return "memory"
    if code == 0:
        return "exit0"
    if code == 2:
        other = [
            line for line in err.splitlines() if line.strip() and not line.startswith(("error:", "hint:", "warning:"))
        ]
        return "exit2-one-line" if len(error_lines) == 1 and not other else "exit2-not-one-line"
    if code == 1:
        return "check-gate" if result.argv and result.argv[0] == "check" and len(error_lines) <= 1 else "exit1"
    return "other-exit"


def preload(extra_modules: tuple[str, ...] = (), calibration: bool = False) -> None:
    """Import what a qtool run imports, once, in the fork server: the CLI and every command,
    every convention, numpy, torch, gguf, safetensors, cbor2, and the optional toolchains;
    with `calibration`, transformers as `--calibrate` imports it, its LLaMA included (seconds
    more: only a replay of cases that calibrate asks for it)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import importlib

    names = [
        "numpy",
        "torch",
        "safetensors",
        "safetensors.torch",
        "gguf",
        "cbor2",
        "typer",
        "rich.console",
        "rich.table",
        "qtool",
        "qtool.api",
        "qtool.cli",
        "qtool.cli.root",
        "qtool.cli.inspect",
        "qtool.cli.check",
        "qtool.cli.dequantize",
        "qtool.cli.output",
        "qtool.conventions",
        "qtool.formats.loader",
        "qtool.formats.gguf",
        "qtool.formats.burnpack",
        "qtool.formats.torch_pickle",
        "qtool.formats.writer",
        "qtool.pipeline",
        "qtool.value_stats",
        "qtool.audit",
        "qtool.inspection",
        "qtool.native",
        "torchao",
        *extra_modules,
    ]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    if calibration:  # calibration's cases (side_json/handmade-calibrate-*): not once per case
        from qtool.api import import_transformers_lean

        import_transformers_lean()
        for name in (
            "transformers.modeling_utils",
            "transformers.models.llama.modeling_llama",
            "qtool.calibration.skeleton",
            "qtool.calibration.samples",
        ):
            importlib.import_module(name)


def _rss_bytes(pid: int | str = "self") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # the process is gone: 0
        pass
    return 0


def _vm_data_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


def _read_capped(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            data = handle.read(_OUTPUT_CAP + 1)
    except OSError:
        return ""
    text = data[:_OUTPUT_CAP].decode("utf-8", "replace")
    return text + ("\n[... output cut]" if len(data) > _OUTPUT_CAP else "")


def _child(argv: list[str], cwd: Path, out: Path, err: Path, env: dict[str, str], memory: int) -> None:
    """In the forked child: never returns."""
    code = 98
    try:
        os.setpgid(0, 0)
        for fd, path in ((1, out), (2, err)):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(handle, fd)
            os.close(handle)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_DATA, (_vm_data_bytes() + memory + 256 * MiB,) * 2)
        faulthandler.enable(file=sys.stderr, all_threads=True)
        faulthandler.register(signal.SIGVTALRM, file=sys.stderr, all_threads=True)
        os.chdir(cwd)
        if "QTOOL_FUZZ_STDIN" in env:  # what a user would type: "y" to transformers' custom-code prompt
            (cwd / ".fuzz-stdin").write_text(env["QTOOL_FUZZ_STDIN"])
            typed = os.open(cwd / ".fuzz-stdin", os.O_RDONLY)
            os.dup2(typed, 0)
            os.close(typed)
        os.environ.update(env)
        sys.argv = ["qtool", *argv]
        if "QTOOL_FUZZ_SWAP" in env:
            _swap_during_copy(json.loads(env["QTOOL_FUZZ_SWAP"]))
        from qtool.cli import main

        try:
            main()
            code = 0
        except SystemExit as exc:
            c = exc.code
            code = 0 if c is None else c if isinstance(c, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 98
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)


def _swap_during_copy(swap: dict[str, str]) -> None:
    """A side-file race, made deterministic: once the output's file `after` is written, `path`
    (relative to the case folder) is replaced by `to`: "fifo", or a symlink to that target."""
    from qtool.formats import writer

    write_new = writer._write_new

    def write_then_swap(path: str, data: bytes) -> None:
        write_new(path, data)
        if os.path.basename(path) == swap["after"]:
            victim = os.path.abspath(swap["path"])
            os.unlink(victim)
            if swap["to"] == "fifo":
                os.mkfifo(victim)
            else:
                os.symlink(swap["to"], victim)

    writer._write_new = write_then_swap


@dataclass
class _Running:
    pid: int
    argv: list[str]
    out: Path
    err: Path
    started: float
    base_rss: int
    peak: int = 0
    killed_for: str | None = None
    kill_at: float | None = None
    token: object = None


class Runner:
    """Forks at most `jobs` children at a time; `submit` queues, `results` yields as they end."""

    def __init__(self, limits: Limits = Limits(), jobs: int = 1, poll: float = 0.005):
        self.limits = limits
        self.jobs = max(1, jobs)
        self.poll = poll
        self.running: dict[int, _Running] = {}

    def start(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None, token: object = None) -> None:
        if len(self.running) >= self.jobs:
            raise RuntimeError("runner full: collect results first")
        out, err = cwd / ".fuzz-stdout", cwd / ".fuzz-stderr"
        sys.stdout.flush()
        sys.stderr.flush()
        base = _rss_bytes()
        pid = os.fork()
        if pid == 0:
            _child(argv, cwd, out, err, env or {}, self.limits.memory)
        self.running[pid] = _Running(pid, argv, out, err, time.monotonic(), base, token=token)

    def full(self) -> bool:
        return len(self.running) >= self.jobs

    def wait_one(self) -> tuple[object, Result]:
        """Block until one child ends; its token and result."""
        while True:
            for run in list(self.running.values()):
                pid, status, usage = os.wait4(run.pid, os.WNOHANG)
                now = time.monotonic()
                if pid:
                    del self.running[run.pid]
                    return run.token, self._result(run, status, usage, now)
                self._watch(run, now)
            time.sleep(self.poll)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> Result:
        self.start(argv, cwd, env)
        return self.wait_one()[1]

    def _watch(self, run: _Running, now: float) -> None:
        if run.kill_at is not None:
            if now >= run.kill_at:
                _kill(run.pid, signal.SIGKILL)
            return
        growth = _rss_bytes(run.pid) - run.base_rss
        run.peak = max(run.peak, growth)
        reason = None
        if now - run.started > self.limits.seconds:
            reason = "timeout"
        elif growth > self.limits.memory:
            reason = "memory"
        if reason:
            run.killed_for = reason
            _kill(run.pid, signal.SIGVTALRM)  # faulthandler: where it is
            run.kill_at = now + 0.5

    def _result(self, run: _Running, status: int, usage, now: float) -> Result:
        peak = max(run.peak, usage.ru_maxrss * 1024 - run.base_rss)
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        _kill(-run.pid, signal.SIGKILL)  # anything the child left in its process group
        result = Result(
            argv=run.argv,
            exit_code=code,
            signal=signum,
            seconds=now - run.started,
            peak_rss_growth=max(0, peak),
            stdout=_read_capped(run.out),
            stderr=_read_capped(run.err),
            killed_for=run.killed_for,
        )
        if result.killed_for is None and result.peak_rss_growth > self.limits.memory:
            result.killed_for = "memory"
        result.outcome = classify(result)
        return result

    def close(self) -> None:
        for run in list(self.running.values()):
            _kill(run.pid, signal.SIGKILL)
            os.waitpid(run.pid, 0)
        self.running.clear()


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
