"""qtool: see inside model checkpoints, and change how their weights are stored.

Imports stay light: `import qtool` does not import torch.
"""

from qtool.api import collect_stats, dequantize, inspect, open_checkpoint, quantize
from qtool.api import check, compare
from qtool.errors import CheckpointError, NotQuantizedError, QtoolError, UsageError
from qtool.errors import ViolationError
from qtool.scheme import QScheme, QType
from qtool.weight import Weight

__version__ = "0.1.0"

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
]
