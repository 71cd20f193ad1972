"""qtool: see inside model checkpoints, and change how their weights are stored.

`import qtool` imports nothing heavy: each public name loads its module on first use (PEP 562).
The CLI relies on this to install its signal handlers within milliseconds of start-up, and
torch is imported only where tensor data is touched.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms before the CLI's signal handlers)

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "open_checkpoint": "qtool.api",
    "inspect": "qtool.api",
    "collect_stats": "qtool.api",
    "quantize": "qtool.api",
    "dequantize": "qtool.api",
    "compare": "qtool.api",
    "check": "qtool.api",
    "QtoolError": "qtool.errors",
    "UsageError": "qtool.errors",
    "CheckpointError": "qtool.errors",
    "NotQuantizedError": "qtool.errors",
    "ViolationError": "qtool.errors",
    "InternalError": "qtool.errors",
    "QScheme": "qtool.scheme",
    "QType": "qtool.scheme",
    "Weight": "qtool.weight",
}

__all__ = [
    "__version__",
    "open_checkpoint",
    "inspect",
    "collect_stats",
    "quantize",
    "dequantize",
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

    from qtool.api import check, collect_stats, compare, dequantize, inspect, open_checkpoint, quantize
    from qtool.errors import CheckpointError, InternalError, NotQuantizedError, QtoolError, UsageError, ViolationError
    from qtool.scheme import QScheme, QType
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
