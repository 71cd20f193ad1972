"""What every layout provides (DESIGN "The write side").

A **layout** is how one toolchain stores a scheme on disk. It answers, from shapes alone and
before any data is read:

- `refusal(scheme)`: why it can never store this scheme (None if it can), and
  `check(weight, scheme)`: a `SchemeError` when it cannot store it for this weight;
- `plan(...)`: every tensor it writes for every weight (names, dtypes, shapes, bytes), the
  transform a weight's values take on the way out, the file metadata and side config, so
  `--dry-run` and the headers come from the plan (`qtool.plan`);
- `header(plan, shard)` and `side_files(plan)`: the bytes before the data, and the JSON files
  written beside it.

Which kernel encodes a job is not the layout's choice: encoders register by capability in
`qtool.encoders`, and the executor asks there. A safetensors layout also offers its torch
encode (`encode_tensors`), the reference every other encoder of it matches. Decoding is the
reading convention's job: every layout round-trips through the reader in a test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable

from qtool.errors import SchemeError
from qtool.plan import Chosen, Plan, PlanOptions
from qtool.scheme import QScheme
from qtool.weight import Weight

if TYPE_CHECKING:
    from qtool.formats.checkpoint import Checkpoint

__all__ = ["Layout", "refusal_of"]


class Layout(Protocol):
    name: str
    container: str  # "safetensors" | "gguf": which file writer lays its output out
    description: str

    def refusal(self, scheme: QScheme) -> str | None:
        """Why this layout can never store `scheme`, or None if it can (for some weights)."""
        ...

    def check(self, weight: Weight, scheme: QScheme) -> None:
        """Raise a `SchemeError` saying what is allowed when `scheme` can't be stored for `weight`."""
        ...

    def plan(self, source: Checkpoint, weights: list[Weight], chosen: Chosen, options: PlanOptions) -> Plan: ...

    def metadata_json(self, plan: Plan) -> dict[str, Any]:
        """The file metadata the plan writes, as JSON (for `--dry-run`)."""
        ...

    def header(self, plan: Plan, shard: int) -> tuple[bytes, dict[str, tuple[int, int]], int]:
        """File `shard`'s header bytes, each tensor's absolute byte range, and the file's size."""
        ...

    def side_files(self, plan: Plan) -> dict[str, Any]:
        """JSON files written beside the weights (index, config.json), by name."""
        ...


def refusal_of(attempt: Callable[[], object]) -> str | None:
    """The message of the SchemeError `attempt` raises (why a layout refuses), or None."""
    try:
        attempt()
    except SchemeError as exc:
        return exc.message
    return None
