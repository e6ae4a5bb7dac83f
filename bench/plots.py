"""Dependency-free SVG plots: empirical CDFs of several series on one chart."""

from __future__ import annotations

import math
from html import escape

COLORS = {"fencedlease": "#1f77b4", "client-go": "#d62728"}
FALLBACK = ["#2ca02c", "#9467bd", "#8c564b", "#ff7f0e"]


def _nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    start = math.ceil(lo / step) * step
    ticks, t = [], start
    while t <= hi + 1e-12:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100 or float(v).is_integer():
        return f"{v:g}"
    if abs(v) >= 1:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.3g}"


def ecdf_svg(series: dict[str, list[float]], *, title: str, xlabel: str, log_x: bool = False,
             vlines: list[tuple[float, str]] | None = None, width: int = 760, height: int = 420) -> str:
    """One step line per series: the fraction of trials at or below x."""
    vals = [v for s in series.values() for v in s]
    vlines = vlines or []
    if not vals:
        vals = [0.0, 1.0]
    lo, hi = min(vals + [x for x, _ in vlines]), max(vals + [x for x, _ in vlines])
    if log_x:
        lo = max(min(v for v in vals if v > 0) if any(v > 0 for v in vals) else 1e-3, 1e-6)
        lo_l, hi_l = math.floor(math.log10(lo)), math.ceil(math.log10(max(hi, lo * 10)))
    else:
        pad = (hi - lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad
    ml, mr, mt, mb = 70, 20, 40, 55
    pw, ph = width - ml - mr, height - mt - mb

    def X(v: float) -> float:
        if log_x:
            v = max(v, 10 ** lo_l)
            return ml + (math.log10(v) - lo_l) / (hi_l - lo_l) * pw
        return ml + (v - lo) / (hi - lo) * pw

    def Y(f: float) -> float:
        return mt + (1 - f) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    # grid and axes
    xt = [10 ** e for e in range(lo_l, hi_l + 1)] if log_x else _nice_ticks(lo, hi)
    for t in xt:
        x = X(t)
        out.append(f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{mt + ph}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{mt + ph + 18}" text-anchor="middle">{_fmt(t)}</text>')
    for f in (0, 0.25, 0.5, 0.75, 0.9, 1.0):
        y = Y(f)
        out.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">{f:g}</text>')
    out.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{ml + pw / 2}" y="{height - 12}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text x="16" y="{mt + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {mt + ph / 2})">fraction of trials</text>')
    for x, label in vlines:
        px = X(x)
        out.append(f'<line x1="{px:.1f}" y1="{mt}" x2="{px:.1f}" y2="{mt + ph}" stroke="#555" '
                   f'stroke-dasharray="5,4"/>')
        out.append(f'<text x="{px + 4:.1f}" y="{mt + 14}" fill="#555">{escape(label)}</text>')
    # series; the legend goes in whichever corner (top left, bottom right) the curves leave empty
    def crowd(left_top: bool) -> int:
        n = 0
        for ser in series.values():
            ss = sorted(ser)
            for k, v in enumerate(ss):
                fx, fy = (X(v) - ml) / pw, (k + 0.5) / len(ss)
                n += (fx < 0.4 and fy > 0.7) if left_top else (fx > 0.6 and fy < 0.3)
        return n

    top_left = crowd(True) <= crowd(False)
    legend_y = mt + 12 if top_left else mt + ph - 20 * len(series) + 4
    for i, (name, s) in enumerate(series.items()):
        color = COLORS.get(name, FALLBACK[i % len(FALLBACK)])
        s = sorted(s)
        if s:
            pts = [(X(s[0]), Y(0))]
            for k, v in enumerate(s):
                pts.append((X(v), Y(k / len(s))))
                pts.append((X(v), Y((k + 1) / len(s))))
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        lx = ml + 12 if top_left else ml + pw - 206
        if i == 0:
            out.append(f'<rect x="{lx - 6}" y="{legend_y - 12}" width="200" height="{20 * len(series) + 4}" '
                       f'fill="white" fill-opacity="0.9" stroke="#ccc"/>')
        out.append(f'<line x1="{lx}" y1="{legend_y + 20 * i}" x2="{lx + 24}" y2="{legend_y + 20 * i}" '
                   f'stroke="{color}" stroke-width="3"/>')
        out.append(f'<text x="{lx + 30}" y="{legend_y + 20 * i + 4}">{escape(name)} (n={len(s)})</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
