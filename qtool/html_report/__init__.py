"""The HTML report of `compare`, `quantize`, `check` and `eval` (`--html FILE`): one
self-contained page (no network) that shows where a quantized model loses: error along the
depth of the model per projection kind, the distribution of per-weight SQNR, bits per weight by
scheme, and every weight in a sortable, filterable table; on a text (`eval`, `compare --text`),
the perplexity, the per-token KL divergence and the hidden-state error after each layer.

It is rendered from the same document `--json` prints (`Comparison.to_json()`,
`RunReport.to_json()`, `Audit.to_json()`, the evaluation document), never from a second
measurement, so its figures are the JSON's. Pure Python, no torch.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from qtool.html_report.page import render_page
from qtool.html_report.views import check_page, compare_page, eval_page, quantize_page

__all__ = ["render_quantize", "render_compare", "render_check", "render_eval"]


def _version() -> str:
    from qtool.version import __version__

    return __version__


def render_quantize(document: dict[str, Any]) -> str:
    """A quantize (or `--report`) document's page."""
    return render_page(quantize_page(document), version=_version())


def render_compare(documents: Sequence[dict[str, Any]]) -> str:
    """One `compare --json` document's page, or several against the same A, overlaid."""
    if not documents:
        raise ValueError("render_compare needs at least one comparison document")
    return render_page(compare_page(documents), version=_version())


def render_check(document: dict[str, Any]) -> str:
    """A `check --json` document's page, each finding linked to its weight's row."""
    return render_page(check_page(document), version=_version())


def render_eval(document: dict[str, Any]) -> str:
    """A `qtool eval --json` document's page: the perplexity, and against a base the KL
    divergence per token and the hidden-state error along the depth."""
    return render_page(eval_page(document), version=_version())
