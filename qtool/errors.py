"""The errors qtool expects, each carrying the exit code the CLI turns it into.

Exit codes are a contract with CI scripts (see README "Exit codes and errors"):
0 success, 1 a check or comparison found a violation, 2 bad usage or unreadable input,
70 a bug in qtool (never 1, which CI reads as a failed gate), 130 Ctrl-C, 143 SIGTERM, 129
SIGHUP (128 + the signal's number for the other signals that end a run: SIGQUIT, SIGUSR1/2,
SIGALRM).
"""

from __future__ import annotations

__all__ = [
    "EXIT_OK",
    "EXIT_VIOLATION",
    "EXIT_USAGE",
    "EXIT_SOFTWARE",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_HANGUP",
    "QtoolError",
    "UsageError",
    "CheckpointError",
    "NotQuantizedError",
    "ViolationError",
    "InternalError",
    "ShardJobError",
    "KernelError",
    "UnknownNameError",
    "SchemeError",
    "JsonTypeError",
    "ImatrixError",
    "ClaimConflict",
    "Interrupted",
    "Terminated",
    "internal_error_line",
]

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_USAGE = 2
EXIT_SOFTWARE = 70  # EX_SOFTWARE in sysexits.h: an internal error
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_HANGUP = 129  # 128 + SIGHUP: the terminal closed, the ssh connection dropped


class QtoolError(Exception):
    """An expected failure: the CLI prints `error: <message>` and `hint: <hint>`, no traceback."""

    exit_code: int = EXIT_USAGE

    def __init__(
        self, message: str, *, hint: str | None = None, path: str | None = None, option: str | None = None
    ) -> None:
        self.message = message
        self.hint = hint
        self.path = path
        self.option = option  # the API parameter at fault ("allow_requantize"); the CLI names its flag
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def __reduce__(self):
        """Pickled whole (hint, path, option, a subclass's fields): a shard job's error crosses
        from a worker process or a Ray node to the driver, which reports it as its own."""
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(kind: type, args: tuple, state: dict) -> QtoolError:
    error = kind.__new__(kind)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class UsageError(QtoolError):
    """Bad options or arguments."""


class CheckpointError(QtoolError):
    """A checkpoint that cannot be read, or is invalid; always names the file."""


class NotQuantizedError(QtoolError):
    """Raised by `Weight.require_scheme()` on a plain weight: being plain is not a bug in the file."""


class ViolationError(QtoolError):
    """A check or comparison found that the policy does not hold (exit 1, like `diff` and
    linters). `reasons` holds one line per violation."""

    exit_code = EXIT_VIOLATION

    def __init__(
        self, message: str, *, reasons: list[str] | None = None, hint: str | None = None, path: str | None = None
    ) -> None:
        self.reasons = list(reasons or [])
        super().__init__(message, hint=hint, path=path)


BUG_REPORT = "this is a bug in qtool; please report it with QTOOL_DEBUG=1 output"


def internal_error_line(detail: str) -> str:
    """The one line the CLI prints for a bug: an `InternalError`, or any exception that is not a
    QtoolError (then `detail` is `<ExceptionType>: <message>`)."""
    return f"internal error: {detail} ({BUG_REPORT})"


class InternalError(QtoolError):
    """A bug qtool detected in itself (an invariant that does not hold). Exit 70, never 1: CI
    must not read a crash as a failed gate. Prints as one line, `error: internal error: <message>
    (this is a bug in qtool; ...)`, like an unexpected exception."""

    exit_code = EXIT_SOFTWARE

    def __str__(self) -> str:
        return internal_error_line(super().__str__())


class ShardJobError(QtoolError):
    """A shard job that failed for good (its worker or node lost more times than retries
    allow, or its staged file did not hold what it wrote): names the shard; nothing is
    committed."""


class UnknownNameError(UsageError, KeyError):
    """A name that is in none of qtool's tables (a dtype, a GGML type); the message lists the
    known ones. Also a KeyError, for code that looks names up."""


class SchemeError(UsageError):
    """A scheme that cannot exist, or that a layout cannot store for a weight; says what is allowed."""


class JsonTypeError(CheckpointError):
    """A JSON value of the wrong type or range: one line naming the file, the field, what it
    holds (`shown`, already cut to a safe length) and what was expected."""

    def __init__(self, where: str, shown: str, expected: str, *, path: str | None, hint: str | None = None) -> None:
        self.where, self.shown, self.expected = where, shown, expected
        said = f"{where} is" if where else "holds"  # "" is the whole document
        super().__init__(f"{said} {shown}, expected {expected}", path=path, hint=hint or "fix or remove the file")


class ImatrixError(CheckpointError):
    """An importance-matrix file (llama.cpp's imatrix) that cannot be read, is invalid, or does
    not fit the model it is used on: one line naming the file, exit 2."""


class ClaimConflict(InternalError):
    """Two conventions claimed one tensor: a bug in qtool, never in the checkpoint."""


class KernelError(InternalError, ValueError):
    """A kernel called with arguments no layout or convention should pass (a block with more
    dims than the tensor, a scale grid of the wrong size): a bug in the caller, exit 70. Also a
    ValueError, as Python code calling the kernels directly expects."""


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by the CLI's SIGINT handler: `except KeyboardInterrupt` treats
    it as the Ctrl-C it is. Not KeyboardInterrupt itself: CPython flags an exact
    KeyboardInterrupt that leaves code run by `exec()` of a string (dataclasses and namedtuple
    build their methods that way) as unhandled even when it is caught later, and the interpreter
    then kills itself with SIGINT at exit instead of exiting 130."""


class Terminated(BaseException):
    """Raised in the main thread by the CLI's SIGTERM handler, so that every `finally` and
    `except BaseException` cleanup runs as it does for Ctrl-C. A BaseException, like
    KeyboardInterrupt, so that `except Exception` code doesn't swallow it."""
