"""qtool: see inside model checkpoints, and change how their weights are stored.

`import qtool` imports nothing heavy: each public name loads its module on first use (PEP 562).
The CLI relies on this to install its signal handlers within milliseconds of start-up, and
torch is imported only where tensor data is touched.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys


_exiting = False  # an early handler is writing its line: a second signal adds none


def _exit_at_once(signum: int, frame: object) -> None:
    """Until `qtool.cli.main` installs the real handlers nothing is written, so exit at once,
    with the line and code those handlers give (qtool.cli: 130, 143, 128 + the number).

    Python runs a second signal's handler inside this one, between its write and its exit
    (SIGTERM then SIGINT 1 ms later printed two lines and exited 130): the first one to get
    here is the one reported, and a nested call returns to let it finish."""
    global _exiting
    if _exiting:
        return
    _exiting = True
    if signum == signal.SIGINT:
        os.write(2, b"error: interrupted\n")
        os._exit(130)
    name = "" if signum == signal.SIGTERM else f" by {signal.Signals(signum).name}"
    os.write(2, f"error: terminated{name}\n".encode())
    os._exit(128 + signum)


def _started_as_the_command() -> bool:
    """`qtool ...` or `python -m qtool ...`, not a program that imports qtool (pytest, a script),
    nor a worker a `--workers` run spawned: multiprocessing runs the driver's main module (the
    `qtool` console script) in it, with the driver's argv, and each worker then printed
    `error: terminated` beside the driver's one line when the driver stopped it."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if "--multiprocessing-fork" in argv:  # multiprocessing's spawn and forkserver children
        return False
    return os.path.basename(sys.argv[0] if sys.argv else "") == "qtool" or any(
        a == "-m" and b == "qtool" for a, b in zip(argv, argv[1:])
    )


# The earliest line of qtool's own code: from here a Ctrl-C during start-up is one line and exit
# 130, never a traceback (before it, only the interpreter's own start-up remains). A signal the
# parent ignored stays ignored (`nohup`; SIGINT and SIGQUIT under a script's `qtool ... &`), and
# only that one: the others are still handled.
if _started_as_the_command():
    for _name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM"):  # qtool.cli's
        if hasattr(signal, _name) and signal.getsignal(getattr(signal, _name)) is not signal.SIG_IGN:
            signal.signal(getattr(signal, _name), _exit_at_once)
    del _name

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms before the CLI's signal handlers)

# public name -> the module that defines it
_LAZY = {
    "__version__": "qtool.version",
    "open_checkpoint": "qtool.api",
    "inspect": "qtool.api",
    "collect_stats": "qtool.api",
    "quantize": "qtool.api",
    "dequantize": "qtool.api",
    "convert": "qtool.api",
    "compare": "qtool.api",
    "check": "qtool.api",
    "QtoolError": "qtool.errors",
    "UsageError": "qtool.errors",
    "CheckpointError": "qtool.errors",
    "NotQuantizedError": "qtool.errors",
    "ViolationError": "qtool.errors",
    "InternalError": "qtool.errors",
    "QScheme": "qtool.scheme",
    "QType": "qtool.qtypes",
    "Weight": "qtool.weight",
}

__all__ = [
    "__version__",
    "open_checkpoint",
    "inspect",
    "collect_stats",
    "quantize",
    "dequantize",
    "convert",
    "QtoolError",
    "UsageError",
    "CheckpointError",
    "NotQuantizedError",
    "QScheme",
    "QType",
    "Weight",
    "compare",
    "check",
    "ViolationError",
    "InternalError",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these load on first use
    from typing import Any

    from qtool.api import check, collect_stats, compare, convert, dequantize, inspect, open_checkpoint, quantize
    from qtool.errors import CheckpointError, InternalError, NotQuantizedError, QtoolError, UsageError, ViolationError
    from qtool.qtypes import QType
    from qtool.scheme import QScheme
    from qtool.weight import Weight


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # AttributeError, so that `from qtool import api` falls back to importing the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
