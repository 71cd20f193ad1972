"""The one output sink. Commands hand it a JSON document and rows; it renders them as a human
table, JSON, TSV or names. Data goes to stdout; errors, warnings and progress to stderr.

Only this module writes to the terminal.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from qtool.cli.collapse import collapse_rows
from qtool.cli.text import escape
from qtool.message_text import message_line

__all__ = ["FORMATS", "Column", "Rows", "Section", "Output", "print_error", "print_warning", "progress"]

FORMATS = ("auto", "table", "json", "tsv", "names")


@dataclass
class Column:
    header: str
    human: Callable[[Any], str] | None = None  # how the human table shows a raw value
    justify: str = "left"


@dataclass
class Rows:
    """Raw values, one list per row; column 0 is the name. TSV shows them as they are."""

    columns: list[Column]
    rows: list[list[Any]]
    collapse_keys: Sequence[int] = ()  # columns that must agree for repeated layers to fold
    collapse_sums: Sequence[int] = ()  # columns added up when they fold
    title: str | None = None


@dataclass
class Section:
    """Extra tables for the human view only (the summary). JSON carries the same facts."""

    title: str
    columns: list[Column]
    rows: list[list[Any]] = field(default_factory=list)
    show_header: bool = True


def _stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


class Output:
    def __init__(self, fmt: str = "auto", collapse: bool = True) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown output format {fmt!r}")
        # auto: a table for a person at a terminal, TSV for a pipe
        self.format = ("table" if _stdout_is_tty() else "tsv") if fmt == "auto" else fmt
        self.collapse = collapse

    def emit(self, document: dict[str, Any], rows: Rows | None, sections: Sequence[Section] = ()) -> None:
        """`rows` may be None when the format is json, which prints the document only."""
        if self.format == "json":
            # For a person: indented, and ASCII-only so no name from a file reaches the terminal
            # raw (C1 controls, bidi overrides). For a pipe: compact, where json's C encoder is
            # ~10x faster, and UTF-8.
            _escape_surrogates_on_stdout()
            tty = _stdout_is_tty()
            if tty:
                document = {key: _materialized(value) for key, value in document.items()}
                sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=True) + "\n")
            else:
                _write_compact(document)
        elif rows is None:
            raise TypeError("rows are needed for every format but json")
        elif self.format == "tsv":
            lines = ["\t".join(c.header for c in rows.columns)]
            lines += ["\t".join(escape(_raw(v)) for v in row) for row in rows.rows]
            sys.stdout.write("\n".join(lines) + "\n")
        elif self.format == "names":
            sys.stdout.write("".join(escape(str(row[0])) + "\n" for row in rows.rows))
        else:
            self._table(rows, sections)
        sys.stdout.flush()

    def _table(self, rows: Rows, sections: Sequence[Section]) -> None:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=False)
        if not console.is_terminal:
            console.width = 240
        data = rows.rows
        if self.collapse and rows.collapse_keys:
            data = collapse_rows(data, rows.collapse_keys, rows.collapse_sums)
        console.print(_rich_table(rows.title, rows.columns, data))
        for section in sections:
            if section.rows:
                console.print()
                console.print(_rich_table(section.title, section.columns, section.rows, section.show_header))


def _escape_surrogates_on_stdout() -> None:
    """A path from the command line or a folder listing that is not UTF-8 reaches qtool as
    lone surrogates (Python's surrogateescape); names from files never do (the readers refuse
    them). Written to stdout, such a character raised UnicodeEncodeError half-way through a
    document, or (under the C locale) went out as a raw byte that is not UTF-8. Backslash
    escapes write it as `\\udcff`, which is JSON's own escape for it: the document stays valid
    JSON and valid UTF-8, whatever the locale."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="backslashreplace")


def _materialized(value: Any) -> Any:
    return value if isinstance(value, (dict, list, str, int, float, bool, type(None))) else list(value)


_BATCH = 4096  # entries of a streamed list encoded per json.dumps call (C speed, bounded memory)


def _write_compact(document: dict[str, Any]) -> None:
    """`json.dumps(document)` written piece by piece: a value that is an iterator (a listing of
    1.6M weights) is encoded a batch at a time as it is produced, never held whole."""
    write = sys.stdout.write
    write("{")
    for index, (key, value) in enumerate(document.items()):
        write((", " if index else "") + json.dumps(str(key), ensure_ascii=False) + ": ")
        if isinstance(value, (dict, list, str, int, float, bool, type(None))):
            write(json.dumps(value, ensure_ascii=False))
            continue
        write("[")
        iterator, first = iter(value), True
        while batch := list(itertools.islice(iterator, _BATCH)):
            write(("" if first else ", ") + json.dumps(batch, ensure_ascii=False)[1:-1])
            first = False
        write("]")
    write("}\n")


def _raw(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return "x".join(str(v) for v in value)
    return str(value)


def _rich_table(title: str | None, columns: list[Column], rows: list[list[Any]], show_header: bool = True):
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=title, title_justify="left", title_style="bold", show_edge=False, pad_edge=False, show_header=show_header
    )
    for column in columns:
        table.add_column(column.header, justify=column.justify, overflow="fold")  # type: ignore[arg-type]
    for row in rows:
        cells = [column.human(value) if column.human else _raw(value) for column, value in zip(columns, row)]
        table.add_row(*(Text(escape(cell)) for cell in cells))  # Text: no markup from file contents
    return table


def print_error(message: str, hint: str | None = None) -> None:
    """One `error:` line and a `hint:` line; names from files in them cut (qtool.message_text)."""
    sys.stderr.write(f"error: {message_line(message)}\n")
    if hint:
        sys.stderr.write(f"hint: {message_line(hint)}\n")
    sys.stderr.flush()


def print_warning(message: str) -> None:
    sys.stderr.write(f"warning: {message_line(message)}\n")


def print_status(message: str, quiet: bool = False) -> None:
    """One line of progress on stderr (a calibrated layer done); nothing when quiet."""
    if not quiet:
        sys.stderr.write(f"{escape(message)}\n")


@contextlib.contextmanager
def progress(
    description: str, total: int, quiet: bool = False, count: str | None = None, bytes_: bool = True
) -> Iterator[Callable[[int], None]]:
    """A Rich progress bar on stderr, advanced by the callback it yields. Silent when stderr is
    not a terminal, or when quiet. With `count` ("shard jobs"), each call is also one of those
    done, counted in the description. `bytes_` False: `total` counts steps (layers), shown as
    done/total."""
    if quiet or not sys.stderr.isatty():
        yield lambda _advance: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    amounts = (DownloadColumn(), TransferSpeedColumn()) if bytes_ else (MofNCompleteColumn(),)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        *amounts,
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=total)
        if count is None:
            yield lambda advance: bar.advance(task, advance)
            return
        done = 0

        def advance_counted(advance: int) -> None:
            nonlocal done
            done += 1
            bar.update(task, advance=advance, description=f"{description} ({done} {count} done)")

        yield advance_counted
