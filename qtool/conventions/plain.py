"""The last convention: every tensor nobody claimed is a plain weight. Never fails."""

from __future__ import annotations

from qtool.conventions.base import Pool
from qtool.formats.checkpoint import Checkpoint
from qtool.weight import Weight

__all__ = ["Plain"]


class Plain:
    name = "plain"

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        plain = Weight.plain
        return [plain(tensor, []) for tensor in pool.values()]
