"""The report's two bar charts: per-weight SQNR as the document's histogram (SVG: 5 dB bins,
exact weights apart), and bits per weight by scheme for each model (HTML rows, so names and
figures wrap inside the card, with SVG bars). A candidate has the same colour class (`s-N`) in
both and in the depth chart; overlaid histogram bars stand side by side. Each bar has a
`<title>` with its exact figures; the bars only draw what the document holds.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from qtool.html_report.svg import attr, display, fmt_bytes, nice_ticks, text

__all__ = ["sqnr_histogram_chart", "bits_by_scheme_chart"]

_W = 560


def sqnr_histogram_chart(
    histograms: Sequence[dict[str, Any]], series_names: Sequence[str], *, threshold: float | None, label: str
) -> str:
    """One bar per 5 dB bin (from the lowest filled bin of any series to the highest), then
    `exact` and `no signal` when any series has them."""
    lows = [b["from_db"] for h in histograms for b in h["bins"]]
    step = histograms[0]["bin_db"] if histograms else 5
    slots: list[tuple[str, str]] = []  # (key, label)
    if lows:
        low, high = min(lows), max(lows)
        slots = [(f"bin:{v}", f"{v}–{v + step}") for v in range(low, high + step, step)]
    extras = [("exact", "exact"), ("no_signal", "no signal")]
    slots += [(key, name) for key, name in extras if any(h.get(key) for h in histograms)]
    if not slots:
        return '<p class="empty">No weight has a measured SQNR.</p>'

    def count(h: dict[str, Any], key: str) -> int:
        if key.startswith("bin:"):
            start = int(key[4:])
            return next((b["weights"] for b in h["bins"] if b["from_db"] == start), 0)
        return int(h.get(key, 0))

    height, left, bottom, top = 240, 56, 40, 14
    most = max(1, max(count(h, key) for h in histograms for key, _ in slots))
    ticks = [t for t in nice_ticks(0, most, 5) if t <= most * 1.05 and float(t).is_integer()]
    band = (_W - left - 10) / len(slots)
    width = band * 0.8 / len(histograms)
    out = [
        f'<svg class="chart histogram" viewBox="0 0 {_W} {height}" role="img" aria-label="{attr(label)}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for tick in ticks:
        y = top + (1 - tick / most) * (height - top - bottom)
        out.append(f'<line class="grid" x1="{left}" x2="{_W - 10}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{int(tick)}</text>')
    out.append(
        f'<text class="axis-title" transform="translate(14 {(top + height - bottom) / 2:.0f}) rotate(-90)" text-anchor="middle">weights</text>'
    )
    every = max(1, len(slots) // 14)
    for index, (key, name) in enumerate(slots):
        x0 = left + index * band + band * 0.1
        for series, h in enumerate(histograms):
            value = count(h, key)
            bar = value / most * (height - top - bottom)
            x = x0 + series * width
            who = f"{display(series_names[series])}: " if len(histograms) > 1 else ""
            unit = " dB" if key.startswith("bin:") else ""
            out.append(
                f'<rect class="bar s-{series}{" special" if not key.startswith("bin:") else ""}" x="{x:.1f}" y="{height - bottom - bar:.1f}" '
                f'width="{max(width - 1, 1):.1f}" height="{bar:.1f}"><title>{text(f"{who}{name}{unit}: {value} weights")}</title></rect>'
            )
            if value and len(slots) * len(histograms) <= 40:
                out.append(
                    f'<text class="bar-value" x="{x + width / 2:.1f}" y="{height - bottom - bar - 3:.1f}" text-anchor="middle">{value}</text>'
                )
        if index % every == 0 or not key.startswith("bin:"):
            out.append(
                f'<text class="tick" x="{left + (index + 0.5) * band:.1f}" y="{height - bottom + 15}" text-anchor="middle">{text(name)}</text>'
            )
    if threshold is not None and lows:
        position = (threshold - min(lows)) / step
        if 0 <= position <= len([s for s in slots if s[0].startswith("bin:")]):
            x = left + position * band
            out.append(
                f'<line class="threshold" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - bottom}"><title>{text(f"gate: min SQNR {threshold:g} dB")}</title></line>'
            )
    out.append(
        f'<text class="axis-title" x="{(left + _W) / 2:.0f}" y="{height - 6}" text-anchor="middle">SQNR (dB)</text>'
    )
    out.append("</svg>")
    return "".join(out)


def bits_by_scheme_chart(models: Sequence[tuple[str, dict[str, Any], int | None]], *, label: str) -> str:
    """A bar per (model, scheme): bits per weight, with weights and bytes. `models` holds
    (role, model summary, series): the series is the model's colour in the other charts (None
    for the reference, drawn grey), so a candidate has one colour on the whole page.

    Rows are HTML (names and figures wrap inside the card, whatever their length); only the
    bars and the grid are SVG, placed in percent of the bar column so no text is scaled."""
    rows = [
        (name, scheme, entry, series) for name, model, series in models for scheme, entry in model["by_scheme"].items()
    ]
    if not rows:
        return '<p class="empty">No weights.</p>'
    most = max(16.0, max(entry["bits_per_weight"] for _, _, entry, _ in rows))
    ticks = [t for t in nice_ticks(0, most, 5) if t <= most]

    def at(value: float) -> str:
        return f"{value / most * 100:.3f}%"

    grid = "".join(f'<line class="grid" x1="{at(t)}" x2="{at(t)}" y1="0" y2="100%"/>' for t in ticks)
    out = [f'<div class="bits" role="group" aria-label="{attr(label)}">']
    for name, scheme, entry, series in rows:
        detail = f"{entry['bits_per_weight']} bits · {entry['weights']} weights · {fmt_bytes(entry['bytes'])}"
        tooltip = f"{name}: {scheme}: {entry['bits_per_weight']} bits per weight, {entry['weights']} weights, {entry['parameters']} parameters, {entry['bytes']} bytes"
        colour = "ref" if series is None else f"s-{series}"
        out.append(
            f'<span class="bits-name">{text(f"{name}: {scheme}" if len(models) > 1 else scheme)}</span>'
            f'<svg class="bits-bar" width="100%" height="18" aria-hidden="true">{grid}'
            f'<rect class="bar {colour}{" plain" if scheme == "plain" else ""}" x="0" y="3" width="{at(max(entry["bits_per_weight"], most / 500))}" height="12">'
            f"<title>{text(tooltip)}</title></rect></svg>"
            f'<span class="bits-value">{text(detail)}</span>'
        )
    labels = "".join(
        f'<text class="tick" x="{at(t)}" y="12" text-anchor="{"start" if t == 0 else "end" if t == ticks[-1] and t / most > 0.9 else "middle"}">{t:g}</text>'
        for t in ticks
    )
    out.append(
        f'<span></span><svg class="bits-axis" width="100%" height="16" aria-hidden="true">{labels}</svg><span></span>'
    )
    out.append('<span></span><span class="axis-title bits-title">bits per weight</span><span></span>')
    out.append("</div>")
    return "".join(out)
