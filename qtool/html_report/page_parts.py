"""What one page of the HTML report shows, as parts: `views` and `eval_view` fill a `Page` from
a document, `page` turns it into the file. Kept apart from both so that each view can build one
without importing the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qtool.html_report.table_payload import Column

__all__ = ["Page"]


@dataclass
class Page:
    kind: str  # quantize, compare, check, eval
    title: str
    verdict: tuple[str, bool] | None  # ("PASS", True), ("FAIL: 3 violations", False); None without a gate
    models: list[tuple[str, dict[str, Any]]]  # (role, qtool.model_summary document)
    facts: list[tuple[str, str]]  # (label, HTML)
    problems_title: str = ""
    problems: list[tuple[str, str | None]] = field(default_factory=list)  # (line, weight name to link, or None)
    depth: str = ""  # SVG of the weights along the depth; empty: no such section
    depth_caption: str = ""
    series_names: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    histogram: str | None = None
    histogram_caption: str = ""
    bits: str = ""
    columns: list[Column] = field(default_factory=list)  # the weights table; none: no table
    rows: list[dict[str, Any]] = field(default_factory=list)
    table_caption: str = ""
    summary_title: str = "Models"
    sections: list[str] = field(default_factory=list)  # more sections (HTML), after the distributions
