"""The `qtool` command and its one error boundary.

Every way out of the process is decided here, in `main`:

- a `QtoolError` prints `error: ...` and `hint: ...` on stderr and exits with its code (1 a
  violation, 2 bad usage or an unreadable input, 70 an `InternalError`);
- any other exception is a bug: one line, `error: internal error: <Type>: <message> (...)`,
  and exit 70 (EX_SOFTWARE), never 1, which CI reads as a failed gate;
- Ctrl-C prints `error: interrupted` and exits 130, SIGTERM `error: terminated` and 143, both
  after every `finally` and `except BaseException` cleanup has run; SIGHUP (a closed terminal,
  a dropped ssh), SIGQUIT, SIGUSR1, SIGUSR2 and SIGALRM are handled as SIGTERM is, with
  `error: terminated by SIGHUP` and exit 128 + the signal's number (129 for SIGHUP); a signal
  the parent set to be ignored (`nohup`) stays ignored. After a signal the process ends with
  `os._exit` once the outputs are cleaned up: no exit waits for a worker thread;
- QTOOL_DEBUG=1 adds the traceback.

This module imports nothing heavy: `main` installs the signal handlers first, then imports
typer and the command it runs (`qtool.cli.root`), so a signal during start-up is handled too.
The commands' own boundary, for CliRunner as well, is `root._ErrorBoundary`.
"""

from __future__ import annotations

import os
import signal
import sys

from qtool.errors import (
    EXIT_INTERRUPTED,
    EXIT_SOFTWARE,
    Interrupted,
    QtoolError,
    Terminated,
    internal_error_line,
)

TYPE_CHECKING = False  # typing costs ~2 ms, before the signal handlers are in place
if TYPE_CHECKING:
    from typing import Any, NoReturn

__all__ = ["app", "main", "COMMANDS", "DEBUG_ENV", "COMPLETE_ENV"]

PROG = "qtool"
DEBUG_ENV = "QTOOL_DEBUG"
COMPLETE_ENV = "_QTOOL_COMPLETE"  # Typer's shell completion: `source_bash`, `complete_zsh`, ...
# qtool.cli.<name>
COMMANDS = ("inspect", "quantize", "dequantize", "convert", "schemes", "compare", "check", "imatrix", "eval")
_SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


# -- signals ---------------------------------------------------------------------------------------
# The first SIGINT or terminating signal becomes an exception in the main thread (Interrupted, a
# KeyboardInterrupt, or Terminated), so cleanup runs as the stack unwinds. A later one is only
# counted: a second signal must not cut that cleanup short or print a traceback from inside
# it. A third, should the cleanup hang, exits at once.

# Signals whose default action ends the process: each is handled as SIGTERM is (cleanup, one
# line, exit 128 + its number), so none leaves a staging folder behind.
_TERMINATING = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")


def _handled_signals() -> tuple[int, ...]:
    return (signal.SIGINT, *(getattr(signal, name) for name in _TERMINATING if hasattr(signal, name)))


def signal_exit_code(signum: int) -> int:
    """130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP: 128 + the number, as shells report."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum


def _signal_line(signum: int) -> str:
    if signum == signal.SIGINT:
        return "interrupted"
    if signum == signal.SIGTERM:
        return "terminated"
    return f"terminated by {signal.Signals(signum).name}"


class _Signals:
    installed: tuple[int, ...] = ()  # the signals whose handler is ours
    armed = False  # the next signal raises
    raised: int | None = None  # the signal that was turned into an exception
    later = 0  # signals received while not armed
    reported = False  # `error: interrupted` / `error: terminated` has been printed


def _importing(frame: Any) -> bool:
    """Whether the main thread is inside an import. An exception raised there can surface in a C
    extension's initialisation (torch's pybind11 code calls back into Python), which aborts the
    process instead of unwinding it."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _on_signal(signum: int, frame: Any) -> None:
    if _Signals.armed:
        _Signals.armed = False
        _Signals.raised = signum
        if _importing(frame):  # clean up here and leave, rather than unwind through an import
            _ignore_signals_from_now_on()
            _abort_outputs()
            os.write(2, f"error: {_signal_line(signum)}\n".encode())
            os._exit(signal_exit_code(signum))
        raise Interrupted if signum == signal.SIGINT else Terminated
    _Signals.later += 1
    if _Signals.later >= 2:
        code = signal_exit_code(_Signals.raised or signum)
        try:  # os.write: the main thread may be inside a write to sys.stderr right now
            os.write(2, b"error: stopped again; exiting without cleanup\n")
        except OSError:
            pass
        os._exit(code)


def _install_signal_handlers() -> None:
    for signum in _handled_signals():
        try:
            if signal.getsignal(signum) is signal.SIG_IGN:  # `nohup`, or `cmd &` in a script: keep ignoring
                continue
            signal.signal(signum, _on_signal)
        except ValueError:  # not the main thread: leave the signals to whoever owns it
            return
        _Signals.installed += (signum,)
    _Signals.armed = True


def _disarm() -> None:
    _Signals.armed = False


def _ignore_signals_from_now_on() -> None:
    """Just before the exit: the interpreter's shutdown restores the default action of every
    signal with a Python handler, and a signal in that instant would kill the finished process
    (exit -2 instead of its code). An ignored signal it leaves alone."""
    for signum in _Signals.installed:
        signal.signal(signum, signal.SIG_IGN)


def _abort_outputs() -> None:
    """Remove the temporary files of every output still open, a write-behind thread's too."""
    writer = sys.modules.get("qtool.formats.writer")  # not imported: nothing was being written
    abort_all = getattr(writer, "abort_all", None)
    if callable(abort_all):
        try:
            abort_all()
        except Exception as failure:
            from qtool.cli.output import print_warning

            print_warning(f"cleaning up the outputs failed: {type(failure).__name__}: {failure}")


def stopped(exc: BaseException | None = None) -> int:
    """The exit code for a run stopped by a signal, or by a KeyboardInterrupt or Terminated
    raised some other way. Aborts the writer's open outputs and prints one line: once per
    signal, although both boundaries may see it."""
    signum = _Signals.raised
    if signum is None:
        signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
    code = signal_exit_code(signum)
    if _Signals.raised is not None:
        if _Signals.reported:
            return code
        _Signals.reported = True
    _abort_outputs()
    from qtool.cli.output import print_error

    print_error(_signal_line(signum))
    return code


# -- errors ----------------------------------------------------------------------------------------


# API parameters whose flag is not the parameter's name spelled with dashes
_FLAGS = {"tensor_schemes": "--tensor-scheme", "maps": "--map", "path": "the PATH argument"}


def _with_flag(hint: str | None, option: str | None) -> str | None:
    """The API names no CLI flags (its messages serve scripts too); the CLI adds the flag that
    sets the parameter at fault."""
    if not option:
        return hint
    flag = _FLAGS.get(option, "--" + option.replace("_", "-"))
    return f"{hint} ({flag})" if hint else f"see {flag}"


def report(exc: BaseException) -> int:
    """Print an exception that ends a run, as one `error:` line (and a hint for a QtoolError);
    return the exit code. After a signal, any error is its consequence, not a bug: a library
    that swallowed the KeyboardInterrupt half-way through an import fails on the next one
    (numpy: "cannot load module more than once per process")."""
    if _Signals.raised is not None:
        return stopped()
    from qtool.cli.output import print_error

    if isinstance(exc, QtoolError):
        print_error(str(exc), _with_flag(exc.hint, exc.option))
        return exc.exit_code
    message = str(exc)
    detail = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    print_error(internal_error_line(detail))
    return EXIT_SOFTWARE


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        code = exc.code
        return 0 if code is None else code if isinstance(code, int) else 1
    if isinstance(exc, (KeyboardInterrupt, Terminated)):
        return stopped(exc)
    if debug():
        import traceback

        traceback.print_exception(exc)
    return report(exc)


# -- the entry point -------------------------------------------------------------------------------


def _accept_click_completion_spelling() -> None:
    """Typer asks for `source_bash` / `complete_bash`; click 8 documents `bash_source`."""
    shell, _, instruction = os.environ.get(COMPLETE_ENV, "").partition("_")
    if shell in _SHELLS and instruction in ("source", "complete"):
        os.environ[COMPLETE_ENV] = f"{instruction}_{shell}"


def _run(args: list[str]) -> int:
    from qtool.gcpause import paused_gc

    with paused_gc(freeze=True):  # the imports make many objects, none garbage, no cycle to find
        from qtool.cli.root import build_app  # typer and the command: after the handlers are in place

        _accept_click_completion_spelling()
        only = args[0] if args and args[0] in COMMANDS else None  # a completion request has no args: all
        app = build_app(only)
    try:
        app(args=args, prog_name=PROG)
    except SystemExit as exc:
        return _exit_code(exc)
    return 0


def main() -> NoReturn:
    """`qtool` (the console script) and `python -m qtool`."""
    _install_signal_handlers()
    try:
        try:
            code = _run(sys.argv[1:])
        finally:
            _disarm()  # from here on a signal is counted, never raised
    except BaseException as exc:
        code = _exit_code(exc)
    if _Signals.raised is not None:
        # Typer turns a KeyboardInterrupt during parsing into a silent exit 130, and a command
        # may have swallowed the exception: a signalled run never reports success.
        code = stopped()
        _ignore_signals_from_now_on()
        _leave_now(code)
    _ignore_signals_from_now_on()
    # The interpreter's shutdown collects the whole heap once more, for nothing: 0.1-0.35 s
    # after a one-second GGUF requantize on a busy machine (issue 18 #14). Frozen objects are
    # never collected; the exit handlers still run (os._exit would skip them, and in a forked
    # child run the parent's).
    import gc

    gc.freeze()
    sys.exit(code)


def _leave_now(code: int) -> NoReturn:
    """After a signal, once the outputs are cleaned up: exit without the interpreter's shutdown,
    which joins every non-daemon thread (a pool's worker blocked on a stalled read or a slow
    disk would hold the exit for as long as it takes)."""
    _abort_outputs()  # again: a worker may have staged a file since
    _release_named_semaphores()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say
            pass
    os._exit(code)


def _release_named_semaphores() -> None:
    """A `--workers` pool's queues hold named POSIX semaphores, which multiprocessing unlinks in
    finalizers that `os._exit` skips. Its resource tracker, a process of its own that shares our
    stderr, would then unlink them itself and print "There appear to be N leaked semaphore
    objects" after our last line. Run those finalizers first, as the interpreter's own exit
    handler (`multiprocessing.util._exit_function`) does: none of them waits on a worker."""
    _settle_pool_threads()
    util = sys.modules.get("multiprocessing.util")  # not imported: no pool, no semaphore
    run_finalizers = getattr(util, "_run_finalizers", None)
    if callable(run_finalizers):
        try:
            run_finalizers(0)
        except Exception:
            pass


POOL_SETTLE_S = 1.0  # the longest a signal's exit waits for a pool's manager threads


def _settle_pool_threads() -> None:
    """A process pool's manager thread, once its workers are stopped, closes the pool's queues,
    and their finalizers, run in that thread, unlink each semaphore and then tell the resource
    tracker. An `os._exit` between the two leaves the tracker a name it warns about ("1 leaked
    semaphore", "No such file": twice in four CI runs, under load). Wait for those threads, a
    bounded while, so that none is inside a finalizer when the process ends."""
    import time

    process = sys.modules.get("concurrent.futures.process")  # not imported: no pool
    threads = list(getattr(process, "_threads_wakeups", None) or ())
    deadline = time.monotonic() + POOL_SETTLE_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def __getattr__(name: str) -> Any:
    """`qtool.cli.app`, the app with every command (tests drive it with CliRunner), built on
    first use; `build_app` and `_ErrorBoundary` live in `qtool.cli.root`."""
    if name == "app":
        from qtool.cli.root import build_app

        globals()["app"] = build_app()
        return globals()["app"]
    if name in ("build_app", "_ErrorBoundary"):
        from qtool.cli import root

        return getattr(root, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
