"""The overview's throughput chart as inline SVG, drawn on the server: no script, no
library, and it refreshes with the rest of the page. Pure: numbers in, markup out."""

from __future__ import annotations

from datetime import datetime
from html import escape

from rota.base.protocol import rfc3339

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


def start_index(minute_starts: list[str], started_at: str | None) -> int | None:
    """Which of ``minute_starts`` (GET /stats's RFC 3339 minutes) the server started in
    (``started_at``), if any: where the chart and ``rota watch`` mark its start."""
    if not started_at:
        return None
    minute = rfc3339(datetime.fromisoformat(started_at).timestamp() // 60 * 60)
    return minute_starts.index(minute) if minute in minute_starts else None


def throughput_svg(minute_labels: list[str], series: dict[str, list[int]],
                   marker: tuple[int, str] | None = None) -> str:
    """A line per series over the minutes given (oldest first), with a hover title per
    minute giving every figure. ``minute_labels`` name each minute ("10:42"). ``marker``:
    a dashed vertical line at that minute, with its text (the server's start: the counts
    before it are the last run's, kept in the store)."""
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
    if marker is not None and 0 <= marker[0] < minutes:
        mx = x(marker[0])
        right = marker[0] > minutes * 3 / 4  # its text on the side with room
        parts.append(f'<line class="marker" x1="{mx:.1f}" x2="{mx:.1f}" y1="{TOP}"'
                     f' y2="{TOP + inner_h}" stroke="#8a8f98" stroke-width="1.5"'
                     ' stroke-dasharray="5 4"/>')
        parts.append(f'<text class="axis marker" x="{mx + (-5 if right else 5):.1f}"'
                     f' y="{TOP + 12}" text-anchor="{"end" if right else "start"}">'
                     f'{escape(marker[1])}</text>')
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
