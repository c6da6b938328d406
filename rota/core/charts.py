"""The overview's throughput chart as inline SVG, drawn on the server: no script, no
library, and it refreshes with the rest of the page. Pure: numbers in, markup out."""

from __future__ import annotations

from html import escape

WIDTH, HEIGHT = 1000, 220
LEFT, RIGHT, TOP, BOTTOM = 44, 12, 12, 26  # room for the axis labels
# Each series: its colour (the legend in the page uses the same CSS classes).
SERIES = ("enqueued", "completed", "failed", "discarded")


def nice_ceiling(value: int) -> int:
    """The smallest of 1, 2, 5 x 10^n at or above ``value`` (at least 1): the y axis's top."""
    top = 1
    while True:
        for step in (1, 2, 5):
            if step * top >= value:
                return step * top
        top *= 10


def throughput_svg(minute_labels: list[str], series: dict[str, list[int]]) -> str:
    """A line per series over the minutes given (oldest first), with a hover title per
    minute giving every figure. ``minute_labels`` name each minute ("10:42")."""
    minutes = len(minute_labels)
    peak = nice_ceiling(max((max(values, default=0) for values in series.values()), default=0))
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = inner_w / max(minutes - 1, 1)

    def x(i: int) -> float:
        return LEFT + i * step

    def y(v: int) -> float:
        return TOP + inner_h - inner_h * v / peak

    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img"'
             f' aria-label="jobs per minute over the last {minutes} minutes"'
             f' xmlns="http://www.w3.org/2000/svg">']
    for fraction in (0, 0.5, 1):  # grid lines and their figures
        value = peak * fraction
        gy = y(int(value)) if fraction != 0.5 else TOP + inner_h / 2
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{gy:.1f}"'
                     f' y2="{gy:.1f}"/>')
        label = f"{value:g}"
        parts.append(f'<text class="axis" x="{LEFT - 6}" y="{gy + 4:.1f}"'
                     f' text-anchor="end">{label}</text>')
    for i in range(0, minutes, 15):  # a time label every quarter of an hour
        parts.append(f'<text class="axis" x="{x(i):.1f}" y="{HEIGHT - 8}"'
                     f' text-anchor="middle">{escape(minute_labels[i])}</text>')
    if minutes:
        parts.append(f'<text class="axis" x="{x(minutes - 1):.1f}" y="{HEIGHT - 8}"'
                     f' text-anchor="end">now</text>')
    for name in SERIES:
        values = series.get(name)
        if not values:
            continue
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
        parts.append(f'<polyline class="line {name}" points="{points}"/>')
    for i, label in enumerate(minute_labels):  # hover targets: one band per minute
        figures = ", ".join(f"{name} {series[name][i]}" for name in SERIES if name in series)
        parts.append(f'<rect class="hover" x="{x(i) - step / 2:.1f}" y="{TOP}"'
                     f' width="{step:.1f}" height="{inner_h}"><title>{escape(label)}:'
                     f' {escape(figures)}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)
