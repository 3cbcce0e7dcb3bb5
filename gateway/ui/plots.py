"""Line charts as inline SVG, drawn on the server: no chart library, nothing to load."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timezone
from html import escape

from markupsafe import Markup

COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2e}"
    return f"{v:.3g}"


def _x_label(v: float, time_axis: bool, span: float) -> str:
    if not time_axis:
        return _fmt(v)
    fmt = "%H:%M:%S" if span < 3600 else "%m-%d %H:%M"
    return datetime.fromtimestamp(v, timezone.utc).strftime(fmt)


def line_chart(title: str, series: dict[str, Sequence[tuple[float, float]]], *, x_label: str = "",
               time_axis: bool = False, width: int = 460, height: int = 200) -> Markup:
    """An SVG chart of one or more (x, y) series; x in Unix seconds when *time_axis*."""
    points = [(x, y) for s in series.values() for x, y in s if math.isfinite(y)]
    left, right, top, bottom = 56, 12, 24, 34
    w, h = width - left - right, height - top - bottom
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
             f'<text x="{left}" y="15" class="chart-title">{escape(title)}</text>']
    if not points:
        parts.append(f'<text x="{left + w / 2}" y="{top + h / 2}" text-anchor="middle" class="chart-empty">'
                     'no data yet</text></svg>')
        return Markup("".join(parts))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    if y0 == y1:
        y0, y1 = y0 - 1, y1 + 1
    pad = (y1 - y0) * 0.08
    y0, y1 = y0 - pad, y1 + pad

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * w

    def sy(y: float) -> float:
        return top + h - (y - y0) / (y1 - y0) * h

    parts.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="chart-frame"/>')
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{sy(yv):.1f}" y2="{sy(yv):.1f}" class="chart-grid"/>'
                     f'<text x="{left - 4}" y="{sy(yv) + 4:.1f}" text-anchor="end" class="chart-tick">'
                     f'{escape(_fmt(yv))}</text>')
    if y0 < 0 < y1:
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{sy(0):.1f}" y2="{sy(0):.1f}" class="chart-zero"/>')
    for i, xv in enumerate((x0, (x0 + x1) / 2, x1)):
        anchor = ("start", "middle", "end")[i]
        parts.append(f'<text x="{sx(xv):.1f}" y="{top + h + 14}" text-anchor="{anchor}" class="chart-tick">'
                     f'{escape(_x_label(xv, time_axis, x1 - x0))}</text>')
    if time_axis and not x_label:
        x_label = "time (UTC)"
    if x_label:
        parts.append(f'<text x="{left + w / 2}" y="{height - 3}" text-anchor="middle" class="chart-tick">'
                     f'{escape(x_label)}</text>')
    for i, (name, s) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        pts = [(sx(x), sy(y)) for x, y in s if math.isfinite(y)]
        if len(pts) > 1:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="'
                         + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
        for x, y in pts if len(pts) <= 60 else ():
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.4" fill="{color}"/>')
        if len(series) > 1:
            parts.append(f'<text x="{left + w - 4}" y="{top + 14 + 13 * i}" text-anchor="end" fill="{color}" '
                         f'class="chart-legend">{escape(name)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
