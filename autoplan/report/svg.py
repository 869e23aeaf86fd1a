"""Small inline SVG charts for the HTML report (no dependencies, no scripts, no network).

Each function returns one `<svg>` element as text; sizes are in SVG user units (px).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

from autoplan.report.timeline import Block

__all__ = ["PALETTE", "stacked_bars", "timeline"]

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
_WIDTH, _LABEL_W, _ROW_H, _BAR_H = 780, 200, 26, 18


def _nice_ticks(vmax: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least vmax (1, 2 or 5 times a power of ten apart)."""
    if vmax <= 0:
        return [0.0]
    raw = vmax / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(k * power for k in (1, 2, 5, 10) if k * power >= raw)
    return [i * step for i in range(int(math.ceil(vmax / step - 1e-9)) + 1)]


def _text(x: float, y: float, text: str, *, anchor: str = "start", size: int = 11,
          fill: str = "#222") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}">{escape(text)}</text>')


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{h:.2f}" '
            f'fill="{fill}">{tip}</rect>')


def _legend(items: Sequence[tuple[str, str]]) -> tuple[list[str], float]:
    """Legend entries left to right, wrapping at the chart width; (elements, height)."""
    out, x, y = [], _LABEL_W, 14.0
    for name, color in items:
        width = 24 + 6.5 * len(name)
        if x + width > _WIDTH and x > _LABEL_W:
            x, y = _LABEL_W, y + 16
        out += [_rect(x, y - 9, 10, 10, color), _text(x + 14, y, name)]
        x += width
    return out, y + 8


def _axis(scale: float, ticks: list[float], y0: float, y1: float,
          fmt: Callable[[float], str]) -> list[str]:
    out = []
    for t in ticks:
        x = _LABEL_W + t * scale
        out.append(f'<line x1="{x:.1f}" y1="{y0:.1f}" x2="{x:.1f}" y2="{y1:.1f}" '
                   'stroke="#ddd"/>')
        out.append(_text(x, y1 + 14, fmt(t), anchor="middle", size=10))
    return out


def _svg(height: float, body: list[str], title: str) -> str:
    # inline SVG in HTML5 needs no xmlns; the page then holds no URL at all
    return (f'<svg viewBox="0 0 {_WIDTH} {height:.0f}" width="{_WIDTH}" height="{height:.0f}" '
            f'font-family="system-ui, sans-serif" role="img" aria-label="{escape(title)}">'
            + "".join(body) + "</svg>")


def stacked_bars(rows: Sequence[tuple[str, Sequence[tuple[str, float]]]], *,
                 fmt: Callable[[float], str], title: str,
                 markers: Sequence[tuple[str, float]] = (),
                 colors: dict[str, str] | None = None) -> str:
    """Horizontal stacked bars: rows of (label, [(kind, value)]); `markers` are labelled
    vertical lines (e.g. the device memory), drawn as an arrow at the right edge when they lie
    far beyond the bars (so that small bars stay readable). Kinds share colours across rows."""
    kinds = list(dict.fromkeys(k for _, parts in rows for k, _ in parts))
    colors = dict(colors or {})
    for k in kinds:
        colors.setdefault(k, PALETTE[len(colors) % len(PALETTE)])
    bars_max = max([sum(v for _, v in parts) for _, parts in rows] + [0])
    on_scale = [(n, v) for n, v in markers if bars_max == 0 or v <= 2 * bars_max]
    off_scale = [(n, v) for n, v in markers if (n, v) not in on_scale]
    ticks = _nice_ticks(max([bars_max] + [v for _, v in on_scale]))
    scale = (_WIDTH - _LABEL_W - 60) / (ticks[-1] or 1)
    body, top = _legend([(k, colors[k]) for k in kinds])
    top += 14 if markers else 4
    y_end = top + _ROW_H * len(rows)
    body += _axis(scale, ticks, top - 4, y_end, fmt)
    for i, (label, parts) in enumerate(rows):
        y = top + i * _ROW_H + (_ROW_H - _BAR_H) / 2
        body.append(_text(_LABEL_W - 6, y + _BAR_H - 5, label, anchor="end"))
        x = _LABEL_W
        for kind, value in parts:
            body.append(_rect(x, y, value * scale, _BAR_H, colors[kind],
                              f"{label}: {kind} {fmt(value)}"))
            x += value * scale
        body.append(_text(x + 4, y + _BAR_H - 5, fmt(sum(v for _, v in parts)), size=10))
    for name, value in on_scale:
        x = _LABEL_W + value * scale
        body.append(f'<line x1="{x:.1f}" y1="{top - 10:.1f}" x2="{x:.1f}" y2="{y_end:.1f}" '
                    'stroke="#c00" stroke-dasharray="4 3"/>')
        body.append(_text(x - 4, top - 8, f"{name} {fmt(value)}", anchor="end", size=10,
                          fill="#c00"))
    for name, value in off_scale:
        body.append(_text(_WIDTH - 4, top - 8, f"{name} {fmt(value)} (off scale) \u2192",
                          anchor="end", size=10, fill="#c00"))
    return _svg(y_end + 24, body, title)


def timeline(blocks: Sequence[Block], pp: int, step_time_s: float, *,
             fmt: Callable[[float], str], title: str, window_s: float | None = None) -> str:
    """Pipeline ranks (rows) x time: forward and backward blocks labelled with PyTorch's
    `2F0` text form where they are wide enough; the rest of the step after a rank's last
    block (e.g. the exposed gradient sync) is grey. `window_s` draws only [0, window_s)."""
    end = window_s or max([b.end_s for b in blocks] + [step_time_s, 0])
    ticks = _nice_ticks(end)
    scale = (_WIDTH - _LABEL_W - 30) / (ticks[-1] or 1)
    colors = {"F": PALETTE[0], "B": PALETTE[4]}
    body, top = _legend([("forward", colors["F"]), ("backward", colors["B"]),
                         ("rest of the step (gradient sync, ...)", "#ccc")])
    top += 4
    y_end = top + _ROW_H * pp
    body += _axis(scale, ticks, top - 4, y_end, fmt)
    for r in range(pp):
        y = top + r * _ROW_H + (_ROW_H - _BAR_H) / 2
        body.append(_text(_LABEL_W - 6, y + _BAR_H - 5, f"pp rank {r}", anchor="end"))
        last = max((b.end_s for b in blocks if b.rank == r), default=0.0)
        if min(step_time_s, end) > last:
            body.append(_rect(_LABEL_W + last * scale, y, (min(step_time_s, end) - last) * scale,
                              _BAR_H, "#ccc", f"rank {r}: rest of the step"))
    for b in blocks:
        if b.start_s >= end:
            continue
        y = top + b.rank * _ROW_H + (_ROW_H - _BAR_H) / 2
        x, w = _LABEL_W + b.start_s * scale, (min(b.end_s, end) - b.start_s) * scale
        what = "forward" if b.kind == "F" else "backward"
        body.append(_rect(x, y, w, _BAR_H, colors[b.kind],
                          f"{b.label}: stage {b.stage} {what} of microbatch {b.microbatch}, "
                          f"{fmt(b.start_s)} - {fmt(b.end_s)}"))
        if w >= 3:  # a white edge separates neighbouring blocks
            body.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{_BAR_H}" '
                        'fill="none" stroke="#fff" stroke-width="0.5"/>')
        if w >= 7 * len(b.label) + 4:
            body.append(_text(x + w / 2, y + _BAR_H - 5, b.label, anchor="middle", size=10,
                              fill="#fff"))
    return _svg(y_end + 24, body, title)
