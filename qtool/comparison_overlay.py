"""Several candidates compared against one reference (`qtool compare A B C ...`): one document
holding each comparison's own document, so the 2-argument document stays exactly as it is.

    {"schema_version": 1, "a": str,
     "comparisons": [<the `compare A B --json` document of each candidate, in the order given>],
     "violations": ["<candidate>: <violation>"], "ok": bool}
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

__all__ = ["OVERLAY_SCHEMA_VERSION", "overlay_document"]

OVERLAY_SCHEMA_VERSION = 1


def overlay_document(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schema_version": OVERLAY_SCHEMA_VERSION,
        "a": documents[0]["a"],
        "comparisons": list(documents),
        "violations": [f"{d['b']}: {line}" for d in documents for line in d["violations"]],
        "ok": all(d["ok"] for d in documents),
    }
