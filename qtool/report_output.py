"""A report document written to a file: JSON, or the HTML report when the path ends in `.html`
(`--report x.html`, `--html x.html`). Staged beside its target and committed by one rename
(`qtool.formats.writer.StagedFile`), never at a path qtool reads.

    kind        documents               JSON                                       HTML
    quantize    [RunReport.to_json()]   the document                               qtool.html_report.render_quantize
    compare     [Comparison.to_json()]  the document; several: overlay_document    render_compare (overlaid)
    check       [Audit.to_json()]       the document                               render_check
    eval        [the eval document]     the document                               render_eval
"""

from __future__ import annotations

import json
import os
from typing import Any
from collections.abc import Sequence

from qtool.errors import InternalError, UsageError
from qtool.formats.writer import StagedFile, stage_file

__all__ = ["KINDS", "is_html", "render_report", "stage_report", "refuse_report_paths"]

KINDS = ("quantize", "compare", "check", "eval")


def is_html(path: str) -> bool:
    return os.fspath(path).lower().endswith((".html", ".htm"))


def render_report(kind: str, documents: Sequence[dict[str, Any]], *, html: bool) -> bytes:
    """The bytes of the report file for `kind`'s documents."""
    if kind not in KINDS or not documents or (kind != "compare" and len(documents) != 1):
        raise InternalError(f"render_report({kind!r}, {len(documents)} documents)")
    if html:
        from qtool import html_report

        page = {
            "quantize": lambda: html_report.render_quantize(documents[0]),
            "compare": lambda: html_report.render_compare(documents),
            "check": lambda: html_report.render_check(documents[0]),
            "eval": lambda: html_report.render_eval(documents[0]),
        }[kind]()
        return page.encode("utf-8")
    if kind == "compare" and len(documents) > 1:
        from qtool.comparison_overlay import overlay_document

        return (json.dumps(overlay_document(documents), indent=2) + "\n").encode("utf-8")
    return (json.dumps(documents[0], indent=2) + "\n").encode("utf-8")


def stage_report(
    path: str, kind: str, documents: Sequence[dict[str, Any]], *, html: bool | None = None, overwrite: bool = False
) -> StagedFile:
    """The report written in full beside `path`, to `commit()` into place. `html` None: by the
    suffix."""
    return stage_file(
        path, render_report(kind, documents, html=is_html(path) if html is None else html), overwrite=overwrite
    )


def refuse_report_paths(inputs: Sequence[str], paths: Sequence[str | None], *, overwrite: bool | None = None) -> None:
    """Refuse, before anything is read, a report path that is empty, is or lies inside an input
    (`inputs`: resolved paths, `qtool.formats.loader.input_paths`), or is another report's;
    with `overwrite` False, also one that exists (staging would refuse it after the work)."""
    seen: dict[str, str] = {}
    for path in paths:
        if path is None:
            continue
        if not os.fspath(path).strip():
            raise UsageError("the report path is empty", option="report")
        real = os.path.realpath(path)
        for source in inputs:
            if real == source:
                raise UsageError(
                    f"report {path} is the input {source}", hint="write to a new path; qtool never modifies its input"
                )
            if real.startswith(source.rstrip(os.sep) + os.sep):
                raise UsageError(
                    f"report {path} lies inside the input {source}", hint="write beside the input, not into it"
                )
        if real in seen:
            raise UsageError(f"reports {seen[real]} and {path} are the same file", hint="give each report its own path")
        if overwrite is False and os.path.lexists(path):
            raise UsageError(
                f"report {path} already exists",
                hint="allow overwriting to replace it, or choose another path",
                option="overwrite",
            )
        seen[real] = os.fspath(path)
