"""Making untrusted text safe and numbers readable for a terminal."""

from __future__ import annotations

__all__ = ["escape", "human_bytes", "human_count"]

_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\\": "\\\\"}


def escape(text: str) -> str:
    """Escape control and non-printable characters, so a tensor name from a file can't move the
    cursor, clear the screen or fake a line of output (as gguf_dump's `sanitize_name` does)."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_count(count: int) -> str:
    value = float(count)
    for unit in ("", "K", "M", "B", "T"):
        if abs(value) < 1000 or unit == "T":
            return f"{int(value)}" if unit == "" else f"{value:.2f}{unit}"
        value /= 1000
    raise AssertionError("unreachable")


def paragraphs(text: str) -> str:
    """Join each prose paragraph's lines into one, so the help renderer can wrap it to the
    terminal; a paragraph starting with \\b (examples) keeps its lines."""
    out = []
    for block in text.strip("\n").split("\n\n"):
        out.append(block if block.startswith("\b") else " ".join(line.strip() for line in block.splitlines()))
    return "\n\n".join(out)
