"""Text from files as a message shows it: control characters escaped, overlong names cut.

Names in checkpoints come from strangers. A tensor name that swallowed the tensor table is
16 KB; echoed whole, one error line fills the terminal and buries what went wrong. Messages
(errors, hints, warnings) show such a name cut to `NAME_LIMIT` characters with "…"; data
outputs (tables, JSON, reports) keep names whole.

A message is escaped once and then cut, so what is cut is what is shown: a name the message
already spells with `repr` (`'a\\x01b'`) is not escaped again (`\\\\x01`), and a quoted name
is cut whether or not it holds spaces.
"""

from __future__ import annotations

import re

__all__ = ["escape", "shorten", "excerpt", "message_line", "counted", "NAME_LIMIT", "LINE_LIMIT"]

NAME_LIMIT = 200  # characters of one name (a run without spaces) in a message
LINE_LIMIT = 2000  # characters of one message line, whatever it holds
_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\\": "\\\\"}
_ESCAPE_LETTERS = frozenset("tnrxuU")  # what follows the backslash of an escape this module writes
# What a message cuts: a quoted name (as `repr` quotes it: escapes inside, quotes not inside a
# word, so "llama.cpp's" opens nothing) of more than NAME_LIMIT characters with its quotes, spaces or not, or
# any run of more than NAME_LIMIT non-space characters. Each alternative advances over
# characters that only it can take, so the scan is linear.
_LONG_NAME = re.compile(
    r"(?<!\w)(?P<q>['\"])(?P<quoted>(?:[^'\"\\]|\\.|(?!(?P=q))['\"]){%d,})(?P=q)(?!\w)|(?P<word>\S{%d,})"
    % (NAME_LIMIT - 1, NAME_LIMIT + 1)
)


def escape(text: str, *, backslashes: bool = True) -> str:
    """Escape control and non-printable characters (bidi overrides too), so a tensor name from a
    file can't move the cursor, clear the screen, fake a line of output or reorder what a page
    shows (as gguf_dump's `sanitize_name` does). A backslash is doubled only where what follows
    it would read as one of these escapes (a letter of `\\t \\n \\r \\x \\u \\U`, a backslash,
    or an escaped character), so data outputs (TSV, tables) read back one way and a user's
    pattern `re:.*foo\\.bar` shows as typed. `backslashes=False` leaves every backslash, which
    makes escaping idempotent: messages, whose names `repr` may have escaped already."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    last = len(text) - 1
    for at, char in enumerate(text):
        if char == "\\":
            following = text[at + 1] if at < last else ""
            ambiguous = backslashes and (
                following in _ESCAPE_LETTERS
                or following in _ESCAPES
                or (following != "" and not following.isprintable())
            )
            out.append("\\\\" if ambiguous else "\\")
        elif char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def shorten(text: str, limit: int = NAME_LIMIT) -> str:
    """`text` if it fits in `limit` characters, else its first `limit - 1` and "…"."""
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def excerpt(text: str, limit: int = NAME_LIMIT) -> str:
    """`text` (a name, a foreign exception's message) as part of a message: escaped once, as
    `message_line` leaves it, then cut to `limit` characters. Cutting first and escaping after
    let a cut name grow tenfold (an invisible tag character escapes to 10 characters)."""
    return shorten(escape(text, backslashes=False), limit)


def message_line(text: str) -> str:
    """One message line: escaped once (a name `repr` spelled keeps its one level of escapes),
    then every quoted name and every run of more than NAME_LIMIT non-space characters
    shortened, and the whole cut at LINE_LIMIT. Linear in the text."""
    line = _LONG_NAME.sub(_shortened, escape(text, backslashes=False))
    return shorten(line, LINE_LIMIT)


def _shortened(found: re.Match) -> str:
    if found.group("word") is not None:
        return shorten(found.group("word"))
    quote = found.group("q")
    return quote + shorten(found.group("quoted"), NAME_LIMIT - 2) + quote  # with its quotes, NAME_LIMIT


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """ "1 finding", "2 findings": a count and its noun in the number it takes."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
