"""The job widget's training curve, drawn as a few lines of SVG (and a sparkline for text).

Why SVG in an ``HTML`` widget rather than bqplot or plotly: the widget already redraws from a
follower thread in batches, an SVG string of a few hundred points costs microseconds and one
comm message, it needs no JavaScript extension installed in the frontend (so it draws wherever
ipywidgets' HTML does, including static notebook renderers that keep widget state), and it adds
no dependency. The chart shows up to three metrics against step, a marker line at every
checkpoint, preemption, resume, migration and resize (at the step the curve had reached), and
the job's device count shaded beneath the curve.
"""
from __future__ import annotations

import html
import math
from typing import Optional

from singularity_sdk.metrics import Series
from singularity_sdk.protocol import EventType

WIDTH, HEIGHT = 620, 170
PAD_L, PAD_R, PAD_T, PAD_B = 60, 12, 22, 20
COLORS = ("#2563eb", "#dc2626", "#059669")
MARK = {
    EventType.CHECKPOINTED: ("C", "#0e7490"), EventType.PREEMPTED: ("P", "#b45309"),
    EventType.RESUMED: ("R", "#15803d"), EventType.MIGRATED: ("M", "#7c3aed"),
    EventType.RESIZED: ("S", "#7c3aed"), EventType.NODE_LOST: ("L", "#dc2626"),
}
SPARKS = "▁▂▃▄▅▆▇█"


def primary(series: Series) -> Optional[str]:
    """The metric a one-line summary shows: a ``loss`` if there is one, else the first."""
    names = series.names()
    return next((n for n in names if "loss" in n.lower()), names[0] if names else None)


def sparkline(series: Series, width: int = 32) -> str:
    """``loss ▇▆▅▃▂▁ 0.123 @ step 40``: the plain-text form of the chart ("" without points)."""
    name = primary(series)
    if name is None:
        return ""
    pts = [p for p in series.points if name in p and math.isfinite(p[name])][-width:]
    if not pts:
        return ""
    vals = [p[name] for p in pts]
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    bars = "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / span * len(SPARKS)))] for v in vals)
    return f"{name} {bars} {vals[-1]:.4g} @ step {pts[-1]['step']}"


def svg(series: Series) -> str:
    """The chart as an SVG element (an empty string until the job reports a number)."""
    names = series.names()[:3]
    pts = [p for p in series.points if any(n in p for n in names)]
    if not pts:
        return ""
    xs = [float(p["step"]) for p in pts]
    x0, x1 = min(xs), max(xs)
    xspan = (x1 - x0) or 1.0
    w, h = WIDTH - PAD_L - PAD_R, HEIGHT - PAD_T - PAD_B

    def sx(x: Optional[float]) -> float:
        return PAD_L + ((x if x is not None else x0) - x0) / xspan * w

    parts = [f'<svg class="singularity-chart-svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg" '
             'style="font:11px sans-serif;background:#fff">']
    parts += _devices(series, sx, x1, h)
    parts.append(f'<rect x="{PAD_L}" y="{PAD_T}" width="{w}" height="{h}" fill="none" stroke="#d1d5db"/>')
    legend = []
    for i, name in enumerate(names):
        line = [(float(p["step"]), p[name]) for p in pts if name in p and math.isfinite(p[name])]
        if not line:
            continue
        vals = [v for _, v in line]
        lo, hi = min(vals), max(vals)
        yspan = (hi - lo) or 1.0
        path = " ".join(f"{sx(x):.1f},{PAD_T + h - (v - lo) / yspan * h:.1f}" for x, v in line)
        color = COLORS[i]
        parts.append(f'<polyline class="singularity-curve" data-name="{html.escape(name)}" points="{path}" '
                     f'fill="none" stroke="{color}" stroke-width="1.5"/>')
        if i == 0:
            parts.append(f'<text x="{PAD_L - 4}" y="{PAD_T + 8}" text-anchor="end" fill="#6b7280">{hi:.3g}</text>'
                         f'<text x="{PAD_L - 4}" y="{PAD_T + h}" text-anchor="end" fill="#6b7280">{lo:.3g}</text>')
        legend.append(f'<tspan fill="{color}">{html.escape(name)} {vals[-1]:.4g}</tspan>')
    parts.append(f'<text x="{PAD_L}" y="14">{"  ".join(legend)}</text>')
    stacked: dict[int, int] = {}  # markers at the same x get their labels one under another
    for m in series.markers:
        label, color = MARK.get(m.type, ("?", "#374151"))
        x = sx(m.step)
        row = stacked[round(x)] = stacked.get(round(x), -1) + 1
        parts.append(f'<g class="singularity-marker singularity-marker-{m.type.value}">'
                     f'<title>{m.type.value} at step {m.step}</title>'
                     f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{PAD_T + h}" stroke="{color}" '
                     f'stroke-dasharray="3,2"/><text x="{x + 2:.1f}" y="{PAD_T + 10 + 11 * (row % 10)}" '
                     f'fill="{color}">{label}</text></g>')
    parts.append(f'<text x="{PAD_L}" y="{HEIGHT - 5}" fill="#6b7280">step {x0:g}</text>'
                 f'<text x="{PAD_L + w}" y="{HEIGHT - 5}" text-anchor="end" fill="#6b7280">{x1:g}</text></svg>')
    return "".join(parts)


def _devices(series: Series, sx, x_end: float, h: float) -> list[str]:
    """Bands under the curve, their height the job's device count (relative to its largest)."""
    changes = [(x, n) for x, n in series.devices]
    most = max((n for _, n in changes), default=0)
    if not most:
        return []
    out = []
    for i, (x, n) in enumerate(changes):
        end = changes[i + 1][0] if i + 1 < len(changes) else x_end
        left, right = sx(x), sx(end)
        if n and right > left:
            bh = h * n / most * 0.9
            out.append(f'<rect class="singularity-devices" x="{left:.1f}" y="{PAD_T + h - bh:.1f}" '
                       f'width="{right - left:.1f}" height="{bh:.1f}" fill="#93c5fd" fill-opacity="0.25">'
                       f'<title>{n} device(s)</title></rect>')
    return out
