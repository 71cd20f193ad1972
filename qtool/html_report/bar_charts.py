"""The report's bar charts: per-weight SQNR as the document's histogram (SVG: 5 dB bins,
exact weights apart), the per-token KL divergence of an evaluation in decades (SVG, one
histogram drawing for both), and bits per weight by scheme for each model (HTML rows, so names
and figures wrap inside the card, with SVG bars). A candidate has the same colour class (`s-N`)
in all of them and in the depth charts; overlaid histogram bars stand side by side, and
`series_legend` names their colours. Each bar has a `<title>` with its exact figures; the bars
only draw what the document holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

from qtool.html_report.svg import attr, display, fmt_bytes, fmt_power, nice_ticks, shown, text

__all__ = ["sqnr_histogram_chart", "kld_histogram_chart", "bits_by_scheme_chart", "series_legend"]

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

    line = None
    if threshold is not None and lows:
        position = (threshold - min(lows)) / step
        if 0 <= position <= len([s for s in slots if s[0].startswith("bin:")]):
            line = (position, f"gate: min SQNR {threshold:g} dB")
    return _bars(
        [_Slot(f"{name}{' dB' if key.startswith('bin:') else ''}", key.startswith("bin:")) for key, name in slots],
        [[count(h, key) for key, _ in slots] for h in histograms],
        list(range(len(histograms))),
        series_names,
        ticks=[name for _, name in slots],
        ticks_at_edges=False,
        keep_tick=[not key.startswith("bin:") for key, _ in slots],
        threshold=line,
        noun="weights",
        x_title="SQNR (dB)",
        label=label,
    )


def kld_histogram_chart(
    histograms: Sequence[Sequence[dict[str, Any]]],
    series: Sequence[int],
    series_names: Sequence[str],
    *,
    label: str,
) -> str:
    """The per-token KL divergence (nats) in the evaluation document's decades
    (`kld_histogram`: `{from, to, tokens}`, the last bin open above): one bar per bin, the
    edges written under the bars' sides. `series` is each histogram's colour (a candidate's
    index on the compare page)."""
    bins = histograms[0] if histograms else []
    if not bins:
        return '<p class="empty">No token was scored.</p>'
    edges = [_edge(b["from"]) for b in bins] + [_edge(bins[-1]["to"])]
    slots = [
        _Slot(f"KL {b['from']:g} to {b['to']:g}" if b["to"] is not None else f"KL {b['from']:g} and above", True)
        for b in bins
    ]
    counts = [[int(h[i]["tokens"]) if i < len(h) else 0 for i in range(len(bins))] for h in histograms]
    return _bars(
        slots,
        counts,
        series,
        series_names,
        ticks=edges,
        ticks_at_edges=True,
        keep_tick=[True] * len(edges),
        threshold=None,
        noun="tokens",
        x_title="KL divergence per token (nats)",
        label=label,
    )


def _edge(value: float | None) -> str:
    """A bin edge as the axis writes it: 0, 10⁻⁶ ... 1, 10; ∞ for an open end."""
    return "∞" if value is None else "0" if value == 0 else fmt_power(value)


@dataclass(frozen=True)
class _Slot:
    name: str  # the bar's tooltip name: "15–20 dB", "KL 0.001 to 0.01"
    measured: bool  # False: a special bar (exact, no signal), drawn lighter


def _bars(
    slots: Sequence[_Slot],
    counts: Sequence[Sequence[int]],
    series: Sequence[int],
    series_names: Sequence[str],
    *,
    ticks: Sequence[str],
    ticks_at_edges: bool,
    keep_tick: Sequence[bool],
    threshold: tuple[float, str] | None,
    noun: str,
    x_title: str,
    label: str,
) -> str:
    """The SVG of a histogram: `counts[h][slot]` for each drawn histogram `h`, side by side in
    a slot, coloured by `series[h]`. `ticks` name the slots (under their middles) or, with
    `ticks_at_edges`, their edges (one more than the slots); `threshold` is (position in slots,
    its label)."""
    height, left, bottom, top = 240, 56, 40, 14
    most = max(1, max((value for row in counts for value in row), default=0))
    ticks_y = [t for t in nice_ticks(0, most, 5) if t <= most * 1.05 and float(t).is_integer()]
    band = (_W - left - 10) / len(slots)
    width = band * 0.8 / len(counts)
    out = [
        f'<svg class="chart histogram" viewBox="0 0 {_W} {height}" role="img" aria-label="{attr(label)}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for tick in ticks_y:
        y = top + (1 - tick / most) * (height - top - bottom)
        out.append(f'<line class="grid" x1="{left}" x2="{_W - 10}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{int(tick)}</text>')
    out.append(
        f'<text class="axis-title" transform="translate(14 {(top + height - bottom) / 2:.0f}) rotate(-90)" text-anchor="middle">{text(noun)}</text>'
    )
    every = max(1, len(ticks) // 14)
    for index, slot in enumerate(slots):
        x0 = left + index * band + band * 0.1
        for order, row in enumerate(counts):
            value = row[index]
            bar = value / most * (height - top - bottom)
            x = x0 + order * width
            who = f"{display(series_names[series[order]])}: " if len(counts) > 1 else ""
            out.append(
                f'<rect class="bar s-{series[order]}{"" if slot.measured else " special"}" x="{x:.1f}" y="{height - bottom - bar:.1f}" '
                f'width="{max(width - 1, 1):.1f}" height="{bar:.1f}"><title>{text(f"{who}{slot.name}: {value} {noun}")}</title></rect>'
            )
            if value and len(slots) * len(counts) <= 40:
                out.append(
                    f'<text class="bar-value" x="{x + width / 2:.1f}" y="{height - bottom - bar - 3:.1f}" text-anchor="middle">{value}</text>'
                )
        if not ticks_at_edges and (index % every == 0 or keep_tick[index]):
            out.append(
                f'<text class="tick" x="{left + (index + 0.5) * band:.1f}" y="{height - bottom + 15}" text-anchor="middle">{text(ticks[index])}</text>'
            )
    if ticks_at_edges:
        for index, name in enumerate(ticks):
            if index % every == 0 or keep_tick[index]:
                out.append(
                    f'<text class="tick" x="{left + index * band:.1f}" y="{height - bottom + 15}" text-anchor="middle">{text(name)}</text>'
                )
    if threshold is not None:
        x = left + threshold[0] * band
        out.append(
            f'<line class="threshold" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - bottom}"><title>{text(threshold[1])}</title></line>'
        )
    out.append(
        f'<text class="axis-title" x="{(left + _W) / 2:.0f}" y="{height - 6}" text-anchor="middle">{text(x_title)}</text>'
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


def series_legend(series_names: Sequence[str], series: Sequence[int] | None = None) -> str:
    """Overlaid candidates' colours under a histogram (a bar's swatch and the name), empty for
    one candidate. `series`: each name's colour index (default: its position)."""
    if len(series_names) < 2:
        return ""
    indices = list(range(len(series_names))) if series is None else series
    items = "".join(
        f'<li><svg viewBox="0 0 14 14" aria-hidden="true"><rect class="bar s-{index}" x="1" y="1" width="12" height="12"/></svg><span class="mono">{shown(name)}</span></li>'
        for index, name in zip(indices, series_names)
    )
    return f'<ul class="legend series">{items}</ul>'
