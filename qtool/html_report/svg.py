"""Small pieces every chart of the HTML report shares: escaping, axis ticks, numbers with
units, and the marker shapes that tell projection kinds apart without colour.

Markup is built as strings with every text from a file escaped (`text`, `attr`): weight names
come from strangers. No style attributes: the page's Content-Security-Policy allows only its
own stylesheet, so colours and dashes come from classes (`k-down`, `s-1`) the CSS defines.
"""

from __future__ import annotations

import html
import math

from qtool.message_text import escape
from qtool.weight_position import KINDS

__all__ = [
    "text",
    "attr",
    "shown",
    "display",
    "nice_ticks",
    "fmt_db",
    "fmt_bytes",
    "fmt_number",
    "fmt_power",
    "kind_class",
    "MARKERS",
    "marker_for",
    "kind_label",
]

# marker shapes, drawn in a box of +-1 (scaled where used); kinds take them in KINDS order
MARKERS = {
    "circle": "M1 0A1 1 0 1 1-1 0A1 1 0 1 1 1 0Z",
    "square": "M-.85-.85H.85V.85H-.85Z",
    "triangle": "M0-1.1L1 .75H-1Z",
    "diamond": "M0-1.15L1.15 0L0 1.15L-1.15 0Z",
    "triangle-down": "M0 1.1L1-.75H-1Z",
    "plus": "M-.35-1.1H.35V-.35H1.1V.35H.35V1.1H-.35V.35H-1.1V-.35H-.35Z",
    "cross": "M-1-.5L-.5-1L0-.5L.5-1L1-.5L.5 0L1 .5L.5 1L0 .5L-.5 1L-1 .5L-.5 0Z",
    "star": "M0-1.15L.3-.4L1.1-.35L.5 .15L.7 1L0 .5L-.7 1L-.5 .15L-1.1-.35L-.3-.4Z",
    "hexagon": "M-.5-.9H.5L1 0L.5 .9H-.5L-1 0Z",
    "pentagon": "M0-1.05L1 -.3L.62 .9H-.62L-1-.3Z",
}
_SHAPES = list(MARKERS)
_LABELS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "qkv": "qkv (fused)", "kv": "kv (MLA)", "gate": "gate_proj",
           "up": "up_proj", "gate_up": "gate_up (fused)", "down": "down_proj", "experts": "experts (worst per layer)",
           "router": "router", "norm": "norm", "embed": "embedding", "lm_head": "lm_head", "bias": "bias", "other": "other",
           "hidden": "hidden state"}  # fmt: skip


def text(value: object) -> str:
    """Text content, escaped."""
    return html.escape(str(value), quote=False)


def attr(value: object) -> str:
    """An attribute value, escaped (use inside double quotes)."""
    return html.escape(str(value), quote=True)


def shown(name: str) -> str:
    """A name from a file as the page shows it (`display`), HTML-escaped."""
    return text(display(name))


def display(name: str) -> str:
    """Control and invisible characters (bidi overrides too) written as escapes, as the CLI's
    tables do, so a name can't reorder or hide what the page shows."""
    return escape(name)


def kind_class(kind: str | None) -> str:
    """The CSS class of a kind: k-<kind>, or k-other."""
    return f"k-{kind}" if kind in KINDS else "k-other"


def kind_label(kind: str | None) -> str:
    return _LABELS.get(kind or "other", kind or "other")


def marker_for(kind: str | None) -> str:
    """The marker shape's name for a kind (two kinds share a shape only past the tenth)."""
    index = KINDS.index(kind) if kind in KINDS else len(KINDS)
    return _SHAPES[index % len(_SHAPES)]


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round tick values covering [low, high] (1, 2, 5 x 10^n steps)."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9 and len(ticks) < 50:
        ticks.append(round(value, 10))
        value += step
    return ticks


def fmt_number(value: float, digits: int = 4) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}"


_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def fmt_power(value: float) -> str:
    """A tick of a log axis: 10⁻⁶, 2×10⁻³, 1, 10 (a value that is not m×10ⁿ with an integer m:
    `fmt_number`)."""
    if not (math.isfinite(value) and value > 0):
        return fmt_number(value) if math.isfinite(value) else str(value)
    power = math.floor(math.log10(value) + 1e-9)
    mantissa = value / 10.0**power
    if abs(mantissa - round(mantissa)) > 1e-6:
        return fmt_number(value)
    head = "" if round(mantissa) == 1 else f"{round(mantissa)}×"
    if power in (0, 1):
        return f"{round(value):d}"
    return f"{head}10{str(power).translate(_SUPERSCRIPT)}"


def fmt_db(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} dB"


def fmt_bytes(count: int | None) -> str:
    if count is None:
        return "—"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"
