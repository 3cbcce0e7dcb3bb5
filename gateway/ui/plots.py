"""Line charts as inline SVG, drawn on the server: nothing to load, nothing run in the browser.

Hand-drawn rather than matplotlib: the charts are small and few, a chart renders in well under a
millisecond, the page keeps its own CSS (classes, not baked colours), each point can carry an
SVG ``<title>`` (the hover value, without JavaScript), and the gateway needs no plotting
dependency. What makes axes hard to keep right lives here and is tested on its own
(tests/gateway/ui/test_ui_training.py): ``nice_ticks`` (1/2/5 x 10^k steps covering the data),
``tick_labels`` (fixed decimals from the step, an SI prefix outside 0.001..10,000: never
``-4.75e-03``) and ``time_ticks``.

A chart draws one ``<g class="series">`` per series and never joins two series: callers pass
one series per training run (or per policy version); inside a series a non-finite value
(NaN, inf) breaks the line and is counted in the chart's title instead of drawn."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

from markupsafe import Markup

COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f", "#78716c",
          "#1e3a8a")
PREFIXES = ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))
TIME_STEPS = (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400,
              7 * 86400, 14 * 86400, 30 * 86400, 91 * 86400, 365 * 86400)

MAX_DRAWN = 600  # vertices a series' line keeps (``thin``): more than a chart has pixels across
Series = Mapping[str, Sequence[tuple[float, float]]]


def finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def nice_step(span: float, count: int = 5) -> float:
    """The 1, 2 or 5 x 10^k step that cuts *span* into at most about *count* intervals."""
    raw = span / max(1, count)
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * mag >= raw * (1 - 1e-9):
            return m * mag
    return 10 * mag  # pragma: no cover - the loop ends at 10


def nice_ticks(lo: float, hi: float, count: int = 5, *, integer: bool = False) -> tuple[list[float], float]:
    """Ticks at a nice step from at or below *lo* to at or above *hi*, and the step; with
    *integer*, the step is a whole number (training steps)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("ticks need finite bounds")
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo <= max(abs(lo), abs(hi)) * 1e-12 or hi - lo < 1e-300:
        # flat to a chart's eye, or a span so small that a fifth of it underflows (0 and 5e-324):
        # a band around the middle, a tenth of it wide each way (one unit around zero)
        mid = lo + (hi - lo) / 2
        pad = abs(mid) * 0.1 if abs(mid) > 1e-290 else 1.0
        lo, hi = mid - pad, mid + pad
    step = nice_step(hi - lo, count)
    if integer:
        step = max(1.0, round(step))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [i * step for i in range(first, last + 1)], step


def _scale(magnitude: float) -> tuple[float, str]:
    if 1e-3 <= magnitude < 1e4 or magnitude == 0:
        return 1.0, ""
    for scale, suffix in PREFIXES:
        if magnitude >= scale:
            return scale, suffix
    return PREFIXES[-1]


def tick_labels(ticks: Sequence[float], step: float) -> list[str]:
    """Labels for ticks *step* apart: as many decimals as the step needs, and an SI prefix for
    the whole axis when its values are >= 10,000 or < 0.001 (``20µ``, ``1.5k``)."""
    scale, suffix = _scale(max((abs(t) for t in ticks), default=0.0) or step)
    decimals = max(0, -math.floor(math.log10(step / scale) + 1e-9))
    out = []
    for t in ticks:
        text = f"{t / scale:.{decimals}f}"
        if float(text) == 0:
            out.append("0")
        else:
            out.append(text + suffix)
    return out


def value_label(v: float) -> str:
    """A single value for a hover or a table: four significant digits, no exponent; an SI
    prefix only outside 0.0001..1,000,000 (``0.00085``, ``123456``, ``20µ``, ``3.5M``)."""
    if not finite(v):
        return str(v)
    if v == 0:
        return "0"
    scale, suffix = (1.0, "") if 1e-4 <= abs(v) < 1e6 else _scale(abs(v))
    x = v / scale
    decimals = max(0, 3 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text + suffix


def time_ticks(lo: float, hi: float, count: int = 5) -> tuple[list[float], list[str]]:
    """Ticks for Unix-second bounds at a whole number of seconds, minutes, hours or days, with
    labels that say no more than the span needs (UTC)."""
    if hi <= lo:
        lo, hi = lo - 30, hi + 30
    step = next((s for s in TIME_STEPS if (hi - lo) / s <= count), TIME_STEPS[-1])
    first, last = math.ceil(lo / step), math.floor(hi / step)
    ticks = [i * step for i in range(first, last + 1)] or [lo]
    if step < 60:
        fmt = "%H:%M:%S"
    elif step < 86400:
        fmt = "%H:%M" if hi - lo < 86400 else "%m-%d %H:%M"
    else:
        fmt = "%Y-%m-%d" if hi - lo > 300 * 86400 else "%m-%d"
    return ticks, [datetime.fromtimestamp(t, UTC).strftime(fmt) for t in ticks]


def palette(names: Sequence[str]) -> dict[str, str]:
    """A colour for each name, in order: pass it to every chart of a page."""
    return {n: COLORS[i % len(COLORS)] for i, n in enumerate(dict.fromkeys(names))}


def _segments(points: Sequence[tuple[float, float]]) -> tuple[list[list[tuple[float, float]]], int]:
    """The series sorted by x, cut at its non-finite values; and how many those were."""
    out: list[list[tuple[float, float]]] = [[]]
    skipped = 0
    isfinite = math.isfinite
    ordered = sorted(points, key=lambda p: p[0])
    for x, y in ordered:
        try:
            ok = isfinite(x) and isfinite(y)
        except TypeError:
            ok = False
        if ok:
            out[-1].append((x, y))
        else:
            skipped += 1
            if out[-1]:
                out.append([])
    return [s for s in out if s], skipped


def thin(points: Sequence[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    """At most about *most* of the points, in order: the lowest and highest of each run of
    neighbours, so a spike survives (a chart is a few hundred pixels wide)."""
    if len(points) <= most:
        return list(points)
    per = math.ceil(len(points) / max(1, most // 2))
    out: list[tuple[float, float]] = []
    for i in range(0, len(points), per):
        chunk = points[i:i + per]
        lo, hi = min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])
        out += sorted({lo, hi}, key=lambda p: p[0])
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out


def _legend_rows(names: Sequence[str], width: int, left: int) -> list[list[tuple[int, str]]]:
    rows: list[list[tuple[int, str]]] = [[]]
    x = left
    for i, name in enumerate(names):
        w = 22 + int(6.4 * len(name)) + 14
        if rows[-1] and x + w > width:
            rows.append([])
            x = left
        rows[-1].append((i, name))
        x += w
    return rows


@dataclass(frozen=True)
class _Plot:
    """A chart's plot area in SVG units and the data range it shows: the scales from data to SVG."""

    left: int
    top: int
    w: int
    h: int
    x0: float
    x1: float
    y0: float
    y1: float

    def sx(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * self.w

    def sy(self, y: float) -> float:
        return self.top + self.h - (y - self.y0) / (self.y1 - self.y0) * self.h


def line_chart(title: str, series: Series, *, x_label: str = "step", time_axis: bool = False,
               integer_x: bool = True, width: int = 520, height: int = 210, testid: str | None = None,
               colors: Mapping[str, str] | None = None) -> Markup:
    """An SVG chart with one line per series: x is a step (or Unix seconds with *time_axis*).
    Every drawn point carries a ``<title>`` with its series, x and value; the legend sits
    under the plot. *colors* keeps a series' colour the same across charts (see ``palette``)."""
    names = [n for n in series]
    color_of = {n: (colors or {}).get(n) or COLORS[i % len(COLORS)] for i, n in enumerate(names)}
    cut = {n: _segments(series[n]) for n in names}
    skipped = sum(s for _, s in cut.values())
    points = [p for segs, _ in cut.values() for seg in segs for p in seg]
    left, right, top = 58, 14, 26
    plot_h = height - top - 40
    w = width - left - right
    legend = _legend_rows(names, width - right, left) if names and (len(names) > 1 or points) else []
    total_h = top + plot_h + 40 + 16 * len(legend) + (4 if legend else 0)
    tid = f' data-testid="{escape(testid)}"' if testid else ""
    parts = [(f'<svg class="chart" role="img" viewBox="0 0 {width} {total_h}" width="{width}" height="{total_h}" '
              f'xmlns="http://www.w3.org/2000/svg"{tid}><title>{escape(title)}</title>'),
             f'<text x="{left}" y="16" class="chart-title">{escape(title)}</text>']
    if skipped:
        parts.append(f'<text x="{width - right}" y="16" text-anchor="end" class="chart-note">'
                     f'{skipped} non-finite value{"s" if skipped != 1 else ""} not drawn</text>')
    if not points:
        parts.append(f'<rect x="{left}" y="{top}" width="{w}" height="{plot_h}" class="chart-frame"/>'
                     f'<text x="{left + w / 2}" y="{top + plot_h / 2}" text-anchor="middle" class="chart-empty">'
                     'no data yet</text></svg>')
        return Markup("".join(parts))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    yticks, ystep = nice_ticks(min(ys), max(ys), 4)
    xticks, xlabels, x0, x1 = _x_ticks(xs, time_axis, integer_x)
    plot = _Plot(left, top, w, plot_h, x0, x1, yticks[0], yticks[-1])
    parts += _axes(plot, yticks, tick_labels(yticks, ystep), xticks, xlabels,
                   "time (UTC)" if time_axis else x_label)

    def x_text(x: float) -> str:
        if time_axis:
            return datetime.fromtimestamp(x, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"{x_label} {value_label(x)}" if x_label else value_label(x)

    for name in names:
        parts += _series(plot, name, color_of[name], cut[name][0], x_text)
    parts += _legend(legend, color_of, left, top + plot_h + 48)
    parts.append("</svg>")
    return Markup("".join(parts))


def _x_ticks(xs: Sequence[float], time_axis: bool, integer_x: bool) -> tuple[list[float], list[str], float, float]:
    """The x axis' ticks, their labels and the range it shows."""
    if time_axis:
        x0, x1 = min(xs), max(xs)
        if x0 == x1:
            x0, x1 = x0 - 30, x1 + 30
        xticks, xlabels = time_ticks(x0, x1)
        return xticks, xlabels, x0, x1
    xticks, xstep = nice_ticks(min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1, 6, integer=integer_x)
    return xticks, tick_labels(xticks, xstep), xticks[0], xticks[-1]


def _axes(plot: _Plot, yticks: Sequence[float], ylabels: Sequence[str], xticks: Sequence[float],
          xlabels: Sequence[str], axis: str) -> list[str]:
    """The frame, the grid lines with their tick labels, and the x axis' name."""
    left, top, w, plot_h = plot.left, plot.top, plot.w, plot.h
    parts = [f'<rect x="{left}" y="{top}" width="{w}" height="{plot_h}" class="chart-frame"/>']
    for yv, label in zip(yticks, ylabels):
        y = plot.sy(yv)
        cls = "chart-zero" if label == "0" and len(yticks) > 1 and yv not in (plot.y0, plot.y1) else "chart-grid"
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}" class="{cls}"/>'
                     f'<text x="{left - 5}" y="{y + 3.5:.1f}" text-anchor="end" class="chart-tick">{escape(label)}</text>')
    for xv, label in zip(xticks, xlabels):
        if plot.x0 - 1e-9 <= xv <= plot.x1 + 1e-9:
            x = plot.sx(xv)
            # a label at either edge stays inside the chart
            anchor = "end" if x > left + w - 3 * len(label) else "start" if x < left + 3 * len(label) - 10 else "middle"
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}" '
                         f'class="chart-frame"/><text x="{x:.1f}" y="{top + plot_h + 15}" text-anchor="{anchor}" '
                         f'class="chart-tick">{escape(label)}</text>')
    if axis:
        parts.append(f'<text x="{left + w / 2}" y="{top + plot_h + 31}" text-anchor="middle" '
                     f'class="chart-axis">{escape(axis)}</text>')
    return parts


def _series(plot: _Plot, name: str, color: str, segs: Sequence[Sequence[tuple[float, float]]],
            x_text: Callable[[float], str]) -> list[str]:
    """One series: its line (thinned to MAX_DRAWN vertices) and a hover target per point, or per
    stride of points in a long series."""
    sx, sy = plot.sx, plot.sy
    n = sum(len(s) for s in segs)
    parts = [f'<g class="series" data-series="{escape(name)}">']
    for seg in segs:
        if len(seg) > 1:
            drawn = thin(seg, max(2, math.ceil(MAX_DRAWN * len(seg) / n)))
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="'
                         + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in drawn) + '"/>')
    stride = max(1, math.ceil(n / 200))  # a hover target for at most ~200 points a series
    for seg in segs:
        cls = "pt dot" if n <= 60 or len(seg) == 1 else "pt"
        marked = list(range(0, len(seg), stride))
        if marked[-1] != len(seg) - 1:
            marked.append(len(seg) - 1)
        for j in marked:
            x, y = seg[j]
            parts.append(f'<circle class="{cls}" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}">'
                         f'<title>{escape(name)} · {escape(x_text(x))}: {escape(value_label(y))}</title>'
                         '</circle>')
    parts.append("</g>")
    return parts


def _legend(legend: Sequence[Sequence[tuple[int, str]]], color_of: Mapping[str, str], left: int,
            ly: int) -> list[str]:
    """The legend's rows (_legend_rows) under the plot, from *ly* down."""
    parts = []
    for r, row in enumerate(legend):
        x = left
        for _, name in row:
            color = color_of[name]
            parts.append(f'<line x1="{x}" x2="{x + 16}" y1="{ly + 16 * r - 4}" y2="{ly + 16 * r - 4}" stroke="{color}" '
                         f'stroke-width="3"/><text x="{x + 21}" y="{ly + 16 * r}" class="chart-legend">'
                         f'{escape(name)}</text>')
            x += 22 + int(6.4 * len(name)) + 14
    return parts
