"""The errors qtool expects, each carrying the exit code the CLI turns it into.

Exit codes are a contract with CI scripts (see README "Exit codes"):
0 success, 1 a check or comparison found a violation, 2 bad usage or unreadable input.
"""

from __future__ import annotations

__all__ = [
    "EXIT_OK",
    "EXIT_VIOLATION",
    "EXIT_USAGE",
    "QtoolError",
    "UsageError",
    "CheckpointError",
    "NotQuantizedError",
    "ViolationError",
    "InternalError",
    "EXIT_SOFTWARE",
]

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_USAGE = 2
EXIT_SOFTWARE = 70  # EX_SOFTWARE: a bug in qtool, never a failed gate


class QtoolError(Exception):
    """An expected failure: the CLI prints `error: <message>` and `hint: <hint>`, no traceback."""

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str, *, hint: str | None = None, path: str | None = None, option: str | None = None) -> None:
        self.message = message
        self.hint = hint
        self.path = path
        self.option = option  # the API parameter at fault ("allow_requantize"); the CLI names its flag
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


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

    def __init__(self, message: str, *, reasons: list[str] | None = None, hint: str | None = None, path: str | None = None) -> None:
        self.reasons = list(reasons or [])
        super().__init__(message, hint=hint, path=path)


class InternalError(QtoolError):
    """qtool caught itself in a bug (two conventions claimed one tensor, an encoder wrote what
    its reader cannot read back): exit 70, never 1, which CI reads as a failed gate."""

    exit_code = EXIT_SOFTWARE
