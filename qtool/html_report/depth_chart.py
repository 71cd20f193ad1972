"""Error along the depth of a model: one SVG chart, layer index on x, a per-weight figure on y
(SQNR in dB, bits per weight for `check`; on a log axis an evaluation's hidden-state error after
each layer), one mark per projection kind per layer and per series (a quantized model; two when
reports are overlaid).

- Several weights at one (series, layer, kind), a mixture's experts above all, are one mark:
  the worst of them, its tooltip naming it, the best, and how many there are.
- Kinds differ by colour and by marker shape; overlaid series by colour, line dash and filled
  or hollow marks, so no difference rests on colour alone.
- The gate's threshold is drawn across; the worst marks are labelled; weights with no layer
  (embeddings, lm_head) stand apart at the right.
- Each mark is `<g class="mark" data-series data-layer data-kind data-name>` (the name
  percent-encoded, UTF-8) with a `<title>`:
  hovering names the weight and its figures, and the page's script jumps to its table row.

The chart only places figures the report document holds; it computes none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from urllib.parse import quote

from qtool.html_report.svg import (
    MARKERS,
    attr,
    display,
    fmt_number,
    fmt_power,
    kind_class,
    kind_label,
    marker_for,
    nice_ticks,
    text,
)
from qtool.weight_position import KINDS

__all__ = ["Mark", "Axis", "depth_chart", "LABELLED_WORST"]

LABELLED_WORST = 3
_W, _H = 1000, 380
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 18, 16, 46
_APART = 78  # the no-layer strip's width
_MARK = 5.0


@dataclass(frozen=True)
class Mark:
    series: int
    layer: int | None
    kind: str | None
    expert: int | None
    value: float
    name: str
    detail: str  # more figures for the tooltip: "max abs err 0.0059 · 33.0 KiB"


@dataclass(frozen=True)
class Axis:
    title: str  # "SQNR"
    unit: str  # "dB"
    worse: str  # "low" or "high": which end is worse
    threshold: float | None = None
    threshold_label: str = ""
    log: bool = False  # a log10 y axis (ratios that span decades: the hidden-state error); values > 0

    def show(self, value: float) -> str:
        return f"{fmt_number(value, 4)} {self.unit}".strip()

    def plot(self, value: float) -> float:
        """Where a value lies along the y axis, in the axis' own units (log10 on a log axis)."""
        return math.log10(value) if self.log else value

    def tick_label(self, value: float) -> str:
        return fmt_power(value) if self.log else fmt_number(value, 4)


def _log_ticks(low: float, high: float) -> list[float]:
    """Round values between 10**low and 10**high: decades where three or more fit, else 1, 2, 5
    (and then 1-9) times a decade; a long range keeps every second, fifth... decade."""
    decades = list(range(math.ceil(low - 1e-9), math.floor(high + 1e-9) + 1))
    if len(decades) >= 3:
        step = next(s for s in (1, 2, 5, 10, 20, 50, 100) if len(decades) / s <= 12)
        return [10.0**d for d in decades if d % step == 0]
    for mantissas in ((1, 2, 5), range(1, 10)):
        ticks = [
            m * 10.0**d
            for d in range(math.floor(low) - 1, math.ceil(high) + 1)
            for m in mantissas
            if low - 1e-9 <= math.log10(m * 10.0**d) <= high + 1e-9
        ]
        if len(ticks) >= 3:
            return ticks
    return ticks or [10.0**low]


@dataclass
class _Group:
    worst: Mark
    best: Mark
    count: int


def _worse(axis: Axis, a: Mark, b: Mark) -> bool:
    return a.value < b.value if axis.worse == "low" else a.value > b.value


def _groups(marks: Sequence[Mark], axis: Axis) -> dict[tuple[int, int | None, str | None], _Group]:
    groups: dict[tuple[int, int | None, str | None], _Group] = {}
    for mark in marks:
        key = (mark.series, mark.layer, mark.kind)
        group = groups.get(key)
        if group is None:
            groups[key] = _Group(mark, mark, 1)
            continue
        group.count += 1
        if _worse(axis, mark, group.worst):
            group.worst = mark
        if _worse(axis, group.best, mark):
            group.best = mark
    return groups


def _title(axis: Axis, group: _Group, series_names: Sequence[str]) -> str:
    worst = group.worst
    where = f"layer {worst.layer}" if worst.layer is not None else "no layer"
    head = f"{display(series_names[worst.series])} · " if len(series_names) > 1 else ""
    if group.count == 1:
        return f"{head}{display(worst.name)}\n{where} · {kind_label(worst.kind)}\n{axis.title} {axis.show(worst.value)} · {worst.detail}"
    return (
        f"{head}{where} · {kind_label(worst.kind)} · {group.count} weights\n"
        f"worst: {display(worst.name)}, {axis.title} {axis.show(worst.value)} · {worst.detail}\n"
        f"best: {display(group.best.name)}, {axis.title} {axis.show(group.best.value)}"
    )


def _short(mark: Mark, axis: Axis) -> str:
    where = f"L{mark.layer} " if mark.layer is not None else ""
    expert = f" e{mark.expert}" if mark.expert is not None else ""
    return f"{where}{mark.kind or 'other'}{expert}: {axis.show(mark.value)}"


def depth_chart(marks: Sequence[Mark], axis: Axis, series_names: Sequence[str], *, label: str) -> str:
    """The chart's SVG markup; `label` is its accessible name."""
    if not marks:
        return f'<p class="empty">No weight has a finite {text(axis.title)} to plot.</p>'
    groups = _groups(marks, axis)
    left = _LEFT + (14 if axis.log else 0)  # room for the log axis' longer ticks (5×10⁻³)
    kinds = sorted(
        {kind for _, _, kind in groups}, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k or "")
    )
    layers = [layer for _, layer, _ in groups if layer is not None]
    apart = any(layer is None for _, layer, _ in groups)
    plot_right = _W - _RIGHT - (_APART if apart else 0)
    values = [g.worst.value for g in groups.values()] + [g.best.value for g in groups.values()]
    if axis.threshold is not None:
        values.append(axis.threshold)
    values = [axis.plot(v) for v in values]
    low, high = min(values), max(values)
    span = high - low or max(abs(high), 1.0)
    if axis.log:  # at least a decade shown, ticks inside it in decades or 1-2-5 steps
        pad = max(0.05 * (high - low), (1.0 - (high - low)) / 2)
        y_low, y_high = low - pad, high + pad
        ticks = _log_ticks(y_low, y_high)
    else:
        ticks = nice_ticks(low - 0.05 * span, high + 0.05 * span)
        y_low, y_high = min(ticks[0], low - 0.05 * span), max(ticks[-1], high + 0.05 * span)

    def y_of(value: float) -> float:
        return _TOP + (y_high - axis.plot(value)) / (y_high - y_low) * (_H - _TOP - _BOTTOM)

    first, last = (min(layers), max(layers)) if layers else (0, 0)
    band = (plot_right - left) / (last - first + 1)
    spread = min(band * 0.7, _MARK * 2.2 * len(kinds) * len(series_names))

    def offset(kind: str | None, series: int) -> float:
        slots = len(kinds) * len(series_names)
        slot = kinds.index(kind) * len(series_names) + series
        return 0.0 if slots == 1 else (slot / (slots - 1) - 0.5) * spread

    def x_of(layer: int | None, kind: str | None, series: int) -> float:
        if layer is None:
            return plot_right + _APART / 2 + offset(kind, series) * min(1.0, (_APART * 0.8) / max(spread, 1))
        return left + (layer - first + 0.5) * band + offset(kind, series)

    scale = max(2.2, min(_MARK, band / max(len(kinds), 1)))
    out = [
        f'<svg class="chart depth" viewBox="0 0 {_W} {_H}" role="img" aria-label="{attr(label)}" xmlns="http://www.w3.org/2000/svg">',
        "<defs>" + "".join(f'<path id="m-{name}" d="{d}"/>' for name, d in MARKERS.items()) + "</defs>",
    ]
    for tick in ticks:  # y grid and labels
        y = y_of(tick)
        out.append(f'<line class="grid" x1="{left}" x2="{plot_right}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(
            f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{text(axis.tick_label(tick))}</text>'
        )
    out.append(
        f'<text class="axis-title" transform="translate(14 {(_TOP + _H - _BOTTOM) / 2:.0f}) rotate(-90)" text-anchor="middle">'
        f"{text(axis.title)}{' (' + text(axis.unit) + ')' if axis.unit and axis.unit not in axis.title else ''}</text>"
    )
    if layers:
        for tick in nice_ticks(first, last, max(2, min(last - first + 1, 16))):
            if float(tick).is_integer() and first <= tick <= last:
                x = left + (tick - first + 0.5) * band
                out.append(
                    f'<text class="tick" x="{x:.1f}" y="{_H - _BOTTOM + 16}" text-anchor="middle">{int(tick)}</text>'
                )
        out.append(
            f'<text class="axis-title" x="{(left + plot_right) / 2:.0f}" y="{_H - 8}" text-anchor="middle">layer</text>'
        )
    out.append(f'<line class="axis" x1="{left}" x2="{plot_right}" y1="{_H - _BOTTOM}" y2="{_H - _BOTTOM}"/>')
    if apart:
        x = plot_right + 8
        out.append(f'<line class="axis apart" x1="{x}" x2="{x}" y1="{_TOP}" y2="{_H - _BOTTOM}"/>')
        out.append(
            f'<text class="axis-title" x="{plot_right + _APART / 2 + 4:.0f}" y="{_H - 8}" text-anchor="middle">no layer</text>'
        )
    if axis.threshold is not None:
        y = y_of(axis.threshold)
        out.append(
            f'<line class="threshold" x1="{left}" x2="{plot_right}" y1="{y:.1f}" y2="{y:.1f}"><title>{text(axis.threshold_label)}</title></line>'
        )
        out.append(f'<text class="threshold-label" x="{left + 6}" y="{y - 5:.1f}">{text(axis.threshold_label)}</text>')
    # one line per (series, kind) through its layers, in layer order
    for series in range(len(series_names)):
        for kind in kinds:
            points = sorted(
                (layer, g.worst.value)
                for (s, layer, k), g in groups.items()
                if s == series and k == kind and layer is not None
            )
            if len(points) > 1:
                path = " ".join(f"{x_of(layer, kind, series):.1f},{y_of(value):.1f}" for layer, value in points)
                out.append(f'<polyline class="line {kind_class(kind)} s-{series}" points="{path}"/>')
    ordered = sorted(
        groups.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1], kinds.index(kv[0][2]))
    )
    for (series, layer, kind), group in ordered:
        x, y = x_of(layer, kind, series), y_of(group.worst.value)
        out.append(
            f'<g class="mark {kind_class(kind)} s-{series}" data-series="{series}" data-layer="{"" if layer is None else layer}" '
            f'data-kind="{attr(kind or "other")}" data-name="{attr(quote(group.worst.name, safe=""))}" data-value="{group.worst.value!r}" tabindex="0">'
            f"<title>{text(_title(axis, group, series_names))}</title>"
            f'<use href="#m-{marker_for(kind)}" transform="translate({x:.1f} {y:.1f}) scale({scale:.2f})"/></g>'
        )
    worst = sorted(groups.values(), key=lambda g: g.worst.value, reverse=axis.worse == "high")[:LABELLED_WORST]
    placed: list[float] = []
    for group in worst:  # labels beside their marks, pushed apart vertically where they would overlap
        mark = group.worst
        x, y = x_of(mark.layer, mark.kind, mark.series), y_of(mark.value)
        anchor, dx = ("end", -9) if x > _W * 0.7 else ("start", 9)
        step = 15 if y < (_TOP + _H - _BOTTOM) / 2 else -15  # toward the roomier half of the plot
        at = min(max(y + (16 if step > 0 else -8), _TOP + 10), _H - _BOTTOM - 4)
        while any(abs(at - other) < 14 for other in placed):
            at += step
        placed.append(at)
        out.append(
            f'<text class="worst-label" x="{x + dx:.1f}" y="{at:.1f}" text-anchor="{anchor}">{text(_short(mark, axis))}</text>'
        )
    out.append("</svg>")
    return "".join(out)
