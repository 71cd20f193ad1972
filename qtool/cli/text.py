"""Making untrusted text safe and numbers readable for a terminal."""

from __future__ import annotations

from qtool.message_text import escape  # the one escape, shared with the HTML report

__all__ = ["escape", "human_bytes", "human_count"]


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
