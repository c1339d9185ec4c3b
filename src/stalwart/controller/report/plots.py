"""Small, dependency-free SVG plots: line charts with marks on the time axis, stacked bars.

Used by the HTML report (`stalwart report --html`) and meant for anything else that wants the same
pictures as plain text (a cluster simulator's ETTR curve, say). Every function returns one
self-contained ``<svg>`` element as a string: no scripts, no external references, text escaped.
"""
from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# One palette for every picture (the dashboard's JavaScript uses the same colours).
COLORS = {
    "loss": "#2563eb", "throughput": "#0d9488", "ettr": "#16a34a", "window_ettr": "#9333ea",
    "detection": "#f59e0b", "localization": "#ef4444", "failover": "#3b82f6",
    "lost_progress": "#6b7280", "hot_update": "#8b5cf6", "startup": "#a3a3a3", "other": "#d4d4d4",
    "incident": "#dc2626", "axis": "#9ca3af", "grid": "#e5e7eb", "text": "#374151",
}


@dataclass
class Series:
    """One line: ``points`` are (x, y); None or non-finite y breaks the line."""

    name: str
    points: Sequence[tuple[float, float | None]]
    color: str = COLORS["loss"]
    dash: str | None = None


@dataclass
class Mark:
    """A vertical mark at ``x`` (a span to ``x2`` when given), labelled, e.g. an incident."""

    x: float
    label: str
    x2: float | None = None
    color: str = COLORS["incident"]


@dataclass
class _Frame:
    width: int
    height: int
    left: int = 52
    right: int = 14
    top: int = 26
    bottom: int = 34
    x0: float = 0.0
    x1: float = 1.0
    y0: float = 0.0
    y1: float = 1.0
    extra: list[str] = field(default_factory=list)

    def sx(self, x: float) -> float:
        span = self.x1 - self.x0 or 1.0
        return self.left + (self.width - self.left - self.right) * (x - self.x0) / span

    def sy(self, y: float) -> float:
        span = self.y1 - self.y0 or 1.0
        return self.height - self.bottom - (self.height - self.top - self.bottom) * (y - self.y0) / span


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (1, 2, 2.5, 5 x 10^k steps)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"ticks need finite bounds, got {lo}, {hi}")
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    out, k = [], 0
    while first + k * step <= hi + step * 1e-9:
        out.append(round(first + k * step, 12))
        k += 1
    return out


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.3g}"
    return f"{v:.4g}"


def _finite(y) -> bool:
    return y is not None and isinstance(y, (int, float)) and math.isfinite(y)


def _bounds(series: Iterable[Series], marks: Sequence[Mark], y_min: float | None,
            y_max: float | None) -> tuple[float, float, float, float] | None:
    pts = [(float(x), float(y)) for s in series for x, y in s.points if y is not None and _finite(y) and _finite(x)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if not xs:
        return None
    xs += [m.x for m in marks] + [m.x2 for m in marks if m.x2 is not None]
    y0 = min(ys) if y_min is None else y_min
    y1 = max(ys) if y_max is None else y_max
    if y1 == y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    return min(xs), max(xs), y0, y1


def _axes(f: _Frame, x_label: str, y_label: str, x_ticks: bool = True) -> list[str]:
    esc = html.escape
    out = []
    for t in nice_ticks(f.y0, f.y1):
        y = f.sy(t)
        out.append(f'<line x1="{f.left}" y1="{y:.1f}" x2="{f.width - f.right}" y2="{y:.1f}" '
                   f'stroke="{COLORS["grid"]}"/>')
        out.append(f'<text x="{f.left - 4}" y="{y + 3.5:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in nice_ticks(f.x0, f.x1, 6) if x_ticks else []:
        x = f.sx(t)
        out.append(f'<line x1="{x:.1f}" y1="{f.height - f.bottom}" x2="{x:.1f}" '
                   f'y2="{f.height - f.bottom + 4}" stroke="{COLORS["axis"]}"/>')
        out.append(f'<text x="{x:.1f}" y="{f.height - f.bottom + 15}" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<line x1="{f.left}" y1="{f.height - f.bottom}" x2="{f.width - f.right}" '
               f'y2="{f.height - f.bottom}" stroke="{COLORS["axis"]}"/>')
    out.append(f'<text x="{(f.left + f.width - f.right) / 2:.0f}" y="{f.height - 4}" '
               f'text-anchor="middle">{esc(x_label)}</text>')
    out.append(f'<text x="12" y="{(f.top + f.height - f.bottom) / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 12 {(f.top + f.height - f.bottom) / 2:.0f})">{esc(y_label)}</text>')
    return out


def _polylines(f: _Frame, s: Series) -> list[str]:
    """One polyline per unbroken run of finite points."""
    runs: list[list[str]] = [[]]
    for x, y in s.points:
        if y is not None and _finite(y) and _finite(x):
            runs[-1].append(f"{f.sx(x):.1f},{f.sy(y):.1f}")
        elif runs[-1]:
            runs.append([])
    dash = f' stroke-dasharray="{html.escape(s.dash)}"' if s.dash else ""
    out = []
    for pts in runs:
        if len(pts) == 1:
            cx, cy = pts[0].split(",")
            out.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{s.color}"/>')
        elif pts:
            out.append(f'<polyline class="series" data-name="{html.escape(s.name)}" fill="none" '
                       f'stroke="{s.color}" stroke-width="1.6"{dash} points="{" ".join(pts)}"/>')
    return out


def _marks(f: _Frame, marks: Sequence[Mark]) -> list[str]:
    out = []
    for m in marks:
        x = f.sx(m.x)
        tip = f"<title>{html.escape(m.label)}</title>"
        if m.x2 is not None and m.x2 > m.x:
            w = max(1.0, f.sx(m.x2) - x)
            out.append(f'<rect class="mark" x="{x:.1f}" y="{f.top}" width="{w:.1f}" '
                       f'height="{f.height - f.top - f.bottom}" fill="{m.color}" fill-opacity="0.12">{tip}</rect>')
        out.append(f'<line class="mark" x1="{x:.1f}" y1="{f.top}" x2="{x:.1f}" y2="{f.height - f.bottom}" '
                   f'stroke="{m.color}" stroke-dasharray="3 2">{tip}</line>')
        out.append(f'<text x="{x + 2:.1f}" y="{f.top + 9}" fill="{m.color}" font-size="9">'
                   f'{html.escape(m.label.split(":")[0])}</text>')
    return out


def _legend_places(f: _Frame, series: Sequence[Series]) -> list[tuple[float, int]]:
    """(x, row) of each series' legend entry: rows wrap at the frame's width."""
    out, x, row = [], float(f.left), 0
    for s in series:
        w = 26 + 7 * len(s.name)
        if x > f.left and x + w - 8 > f.width - f.right:
            x, row = float(f.left), row + 1
        out.append((x, row))
        x += w
    return out


def _legend(f: _Frame, series: Sequence[Series]) -> list[str]:
    out = []
    places = _legend_places(f, series)
    rows = max((r for _, r in places), default=0)
    for s, (x, row) in zip(series, places):
        y = f.top - 12 - 13 * (rows - row)
        out.append(f'<line x1="{x}" y1="{y}" x2="{x + 14}" y2="{y}" stroke="{s.color}" '
                   f'stroke-width="2"/>')
        out.append(f'<text x="{x + 18}" y="{y + 4}">{html.escape(s.name)}</text>')
    return out


def _svg(f: _Frame, title: str, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" role="img" width="{f.width}" '
            f'height="{f.height}" viewBox="0 0 {f.width} {f.height}" font-family="sans-serif" '
            f'font-size="10" fill="{COLORS["text"]}"><title>{html.escape(title)}</title>'
            + "".join(body) + "</svg>")


def _centered(f: _Frame, text: str) -> str:
    return f'<text x="{f.width / 2:.0f}" y="{f.height / 2:.0f}" text-anchor="middle">{html.escape(text)}</text>'


def line_chart(series: Sequence[Series], *, title: str, x_label: str, y_label: str,
               marks: Sequence[Mark] = (), width: int = 640, height: int = 220,
               y_min: float | None = None, y_max: float | None = None) -> str:
    """A line chart of ``series`` with optional vertical ``marks`` (incidents on a time axis)."""
    f = _Frame(width, height)
    b = _bounds(series, marks, y_min, y_max)
    if b is None:
        return _svg(f, title, [_centered(f, f"{title}: no data yet")])
    f.x0, f.x1, f.y0, f.y1 = b
    f.top += 13 * max((r for _, r in _legend_places(f, series)), default=0)   # a legend that wraps
    body = _axes(f, x_label, y_label) + _marks(f, marks)
    for s in series:
        body += _polylines(f, s)
    return _svg(f, title, body + _legend(f, series))


def stacked_bars(bars: Sequence[tuple[str, Mapping[str, float]]], *, keys: Sequence[str], title: str,
                 y_label: str = "seconds", width: int = 640, height: int = 240) -> str:
    """Vertical bars, one per (label, {key: value}), each stacked in the order of ``keys``."""
    f = _Frame(width, height, bottom=40)
    if not bars:
        return _svg(f, title, [_centered(f, f"{title}: nothing to show")])
    totals = [sum(max(0.0, float(v.get(k) or 0.0)) for k in keys) for _, v in bars]
    f.x0, f.x1, f.y0, f.y1 = 0.0, float(len(bars)), 0.0, max(max(totals), 1e-9)
    body = _axes(f, "", y_label, x_ticks=False)
    slot = (width - f.left - f.right) / len(bars)
    bw = min(48.0, slot * 0.6)
    for i, (label, vals) in enumerate(bars):
        x = f.sx(i + 0.5) - bw / 2
        acc = 0.0
        for k in keys:
            v = max(0.0, float(vals.get(k) or 0.0))
            if v <= 0:
                continue
            y_top, y_bot = f.sy(acc + v), f.sy(acc)
            body.append(f'<rect class="bar" data-key="{html.escape(k)}" x="{x:.1f}" y="{y_top:.1f}" '
                        f'width="{bw:.1f}" height="{max(0.5, y_bot - y_top):.1f}" '
                        f'fill="{COLORS.get(k, COLORS["other"])}"><title>{html.escape(label)} '
                        f'{html.escape(k)}: {v:.2f} {html.escape(y_label)}</title></rect>')
            acc += v
        body.append(f'<text x="{f.sx(i + 0.5):.1f}" y="{height - f.bottom + 14}" text-anchor="middle">'
                    f'{html.escape(label)}</text>')
    legend = [Series(k, [], color=COLORS.get(k, COLORS["other"])) for k in keys]
    return _svg(f, title, body + _legend(f, legend))
