"""Small inline SVG charts for the HTML report (no dependencies, no scripts, no network).

Each function returns one `<svg>` element as text; sizes are in SVG user units (px).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

from autoplan.report.timeline import Block

__all__ = ["PALETTE", "text_width", "stacked_bars", "timeline", "labelled_blocks"]

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
_WIDTH, _ROW_H, _BAR_H, _PAD = 780, 26, 18, 6
_MAX_LABEL_W = 340  # row labels beyond this are cut with "..." (full text in the tooltip)
# [Note: text extent]
# An SVG cannot measure its text, so every label column, margin and label position below comes
# from an estimate of the text's width: each character's advance in DejaVu Sans, the widest
# common fallback for system-ui (Linux; Segoe UI, SF Pro and Helvetica are narrower), rounded
# up into four classes (measured in headless Chromium: "compute" is 4.43 em, digits 0.636 em).
# tests/test_report.py checks the charts' geometry with this estimate, and the estimate
# against a browser's layout where Chromium is installed.
_NARROW = set(" .,:;'|!ijlIJft-()[]/\\r")  # <= 0.40 em
_WIDE = set("ABCDGHKNOQRUVXZw&#+<=>^~\u2192")  # <= 0.84 em
_WIDEST = set("mMW%@")  # <= 1.0 em; other ASCII and the micro sign <= 0.64 em


def _char_em(c: str) -> float:
    if c in _NARROW:
        return 0.40
    if c in _WIDE:
        return 0.84
    if c in _WIDEST or (c > "\x7f" and c != "\u00b5"):
        return 1.0
    return 0.64


def text_width(text: str, size: float) -> float:
    """Estimated width of `text` at font size `size`, px, never less than the browser's
    ([Note: text extent])."""
    return size * sum(_char_em(c) for c in text)


def _fit(text: str, size: float, width: float) -> str:
    """`text`, cut with "..." so that it fits `width` px ([Note: text extent])."""
    if text_width(text, size) <= width:
        return text
    while len(text) > 1 and text_width(text + "...", size) > width:
        text = text[:-1]
    return text + "..."


def _label_w(labels: Sequence[str]) -> float:
    """The row-label column: the longest label (11 px) plus padding, at most _MAX_LABEL_W."""
    return min(max([text_width(t, 11) for t in labels] + [40]) + 2 * _PAD, _MAX_LABEL_W)


def _nice_ticks(vmax: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least vmax (1, 2 or 5 times a power of ten apart)."""
    if vmax <= 0:
        return [0.0]
    raw = vmax / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(k * power for k in (1, 2, 5, 10) if k * power >= raw)
    return [i * step for i in range(int(math.ceil(vmax / step - 1e-9)) + 1)]


def _text(x: float, y: float, text: str, *, anchor: str = "start", size: int = 11,
          fill: str = "#222", title: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}">{tip}{escape(text)}</text>')


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{h:.2f}" '
            f'fill="{fill}">{tip}</rect>')


def _legend(items: Sequence[tuple[str, str]], left: float) -> tuple[list[str], float]:
    """Legend entries left to right from x = `left`, wrapping at the chart width; (elements,
    height)."""
    out, x, y = [], left, 14.0
    for name, color in items:
        width = 14 + text_width(name, 11) + 10
        if x + width > _WIDTH and x > left:
            x, y = left, y + 16
        out += [_rect(x, y - 9, 10, 10, color), _text(x + 14, y, name)]
        x += width
    return out, y + 8


def _axis(left: float, scale: float, ticks: list[float], y0: float, y1: float,
          fmt: Callable[[float], str]) -> list[str]:
    out = []
    for t in ticks:
        x = left + t * scale
        out.append(f'<line x1="{x:.1f}" y1="{y0:.1f}" x2="{x:.1f}" y2="{y1:.1f}" '
                   'stroke="#ddd"/>')
        out.append(_text(x, y1 + 14, fmt(t), anchor="middle", size=10))
    return out


def _svg(height: float, body: list[str], title: str) -> str:
    # inline SVG in HTML5 needs no xmlns; the page then holds no URL at all
    return (f'<svg viewBox="0 0 {_WIDTH} {height:.0f}" width="{_WIDTH}" height="{height:.0f}" '
            f'font-family="system-ui, sans-serif" role="img" aria-label="{escape(title)}">'
            + "".join(body) + "</svg>")


def _row_label(left: float, y: float, label: str) -> str:
    """A row's label, right-aligned in the label column, cut to fit (full text as tooltip)."""
    fitted = _fit(label, 11, left - 2 * _PAD)
    return _text(left - _PAD, y + _BAR_H - 5, fitted, anchor="end",
                 title=label if fitted != label else "")


def _clear_of(x: float, width: float, lines_x: Sequence[float]) -> float:
    """The leftmost start >= x of a label `width` px wide that crosses none of the vertical
    lines at `lines_x` (a label that would cross one starts right of it)."""
    for lx in sorted(lines_x):
        if x - 2 <= lx <= x + width + 2:
            x = lx + 4
    return x


def _marker_label(x: float, y: float, text: str) -> str:
    """A marker's label left of its line at `x`, or right of it where the left lacks room."""
    width = text_width(text, 10)
    if x - 4 - width >= 0:
        return _text(x - 4, y, text, anchor="end", size=10, fill="#c00")
    return _text(min(x + 4, _WIDTH - width), y, text, size=10, fill="#c00")


def stacked_bars(rows: Sequence[tuple[str, Sequence[tuple[str, float]]]], *,
                 fmt: Callable[[float], str], title: str,
                 markers: Sequence[tuple[str, float]] = (),
                 colors: dict[str, str] | None = None) -> str:
    """Horizontal stacked bars: rows of (label, [(kind, value)]), each with its total at its
    end; `markers` are labelled vertical lines (e.g. the device memory), drawn as an arrow at
    the right edge when they lie far beyond the bars (so that small bars stay readable).
    Kinds share colours across rows. The label column and the right margin fit the longest
    row label and total ([Note: text extent]); a total that would cross a marker line is
    written right of the line."""
    kinds = list(dict.fromkeys(k for _, parts in rows for k, _ in parts))
    colors = dict(colors or {})
    for k in kinds:
        colors.setdefault(k, PALETTE[len(colors) % len(PALETTE)])
    totals = [sum(v for _, v in parts) for _, parts in rows]
    bars_max = max(totals + [0])
    on_scale = [(n, v) for n, v in markers if bars_max == 0 or v <= 2 * bars_max]
    off_scale = [(n, v) for n, v in markers if (n, v) not in on_scale]
    ticks = _nice_ticks(max([bars_max] + [v for _, v in on_scale]))
    left = _label_w([label for label, _ in rows])
    right = max([text_width(fmt(t), 10) + 2 * _PAD for t in totals]
                + [text_width(fmt(ticks[-1]), 10) / 2 + _PAD])
    scale = (_WIDTH - left - right) / (ticks[-1] or 1)
    body, top = _legend([(k, colors[k]) for k in kinds], left)
    top += 4 + 14 * len(markers)  # one line per marker label
    y_end = top + _ROW_H * len(rows)
    body += _axis(left, scale, ticks, top - 4, y_end, fmt)
    marker_x = [left + value * scale for _, value in on_scale]
    for i, ((label, parts), total) in enumerate(zip(rows, totals)):
        y = top + i * _ROW_H + (_ROW_H - _BAR_H) / 2
        body.append(_row_label(left, y, label))
        x = left
        for kind, value in parts:
            body.append(_rect(x, y, value * scale, _BAR_H, colors[kind],
                              f"{label}: {kind} {fmt(value)}"))
            x += value * scale
        text = fmt(total)
        body.append(_text(_clear_of(x + 4, text_width(text, 10), marker_x), y + _BAR_H - 5,
                          text, size=10))
    for i, (name, value) in enumerate(markers):
        y = top - 8 - 14 * (len(markers) - 1 - i)
        if (name, value) in off_scale:
            body.append(_text(_WIDTH - 4, y, f"{name} {fmt(value)} (off scale) \u2192",
                              anchor="end", size=10, fill="#c00"))
            continue
        x = left + value * scale
        body.append(f'<line x1="{x:.1f}" y1="{y - 10:.1f}" x2="{x:.1f}" y2="{y_end:.1f}" '
                    'stroke="#c00" stroke-dasharray="4 3"/>')
        body.append(_marker_label(x, y, f"{name} {fmt(value)}"))
    return _svg(y_end + 24, body, title)


def _timeline_layout(blocks: Sequence[Block], pp: int, step_time_s: float,
                     window_s: float | None, fmt: Callable[[float], str]):
    """(left, scale px/s, end s, ticks) of a timeline ([Note: text extent])."""
    end = window_s or max([b.end_s for b in blocks] + [step_time_s, 0])
    ticks = _nice_ticks(end)
    left = _label_w([f"pp rank {pp - 1}"])
    right = text_width(fmt(ticks[-1]), 10) / 2 + _PAD
    return left, (_WIDTH - left - right) / (ticks[-1] or 1), end, ticks


def _fits_label(b: Block, width: float) -> bool:
    return width >= text_width(b.label, 10) + 4


def labelled_blocks(blocks: Sequence[Block], pp: int, step_time_s: float, *,
                    fmt: Callable[[float], str], window_s: float | None = None) -> int:
    """How many blocks `timeline` (same arguments) draws wide enough to carry their label."""
    _, scale, end, _ = _timeline_layout(blocks, pp, step_time_s, window_s, fmt)
    return sum(1 for b in blocks if b.start_s < end
               and _fits_label(b, (min(b.end_s, end) - b.start_s) * scale))


def timeline(blocks: Sequence[Block], pp: int, step_time_s: float, *,
             fmt: Callable[[float], str], title: str, window_s: float | None = None) -> str:
    """Pipeline ranks (rows) x time: forward and backward blocks labelled with PyTorch's
    `2F0` text form where they are wide enough (`labelled_blocks` counts them; every block
    names itself in its tooltip); the rest of the step after a rank's last block (e.g. the
    exposed gradient sync) is grey. `window_s` draws only [0, window_s)."""
    left, scale, end, ticks = _timeline_layout(blocks, pp, step_time_s, window_s, fmt)
    colors = {"F": PALETTE[0], "B": PALETTE[4], "I": PALETTE[4], "W": PALETTE[2]}
    names = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
    kinds = [k for k in names if any(b.kind == k for b in blocks)] or ["F", "B"]
    body, top = _legend([*((names[k], colors[k]) for k in kinds),
                         ("rest of the step (gradient sync, ...)", "#ccc")], left)
    top += 4
    y_end = top + _ROW_H * pp
    body += _axis(left, scale, ticks, top - 4, y_end, fmt)
    for r in range(pp):
        y = top + r * _ROW_H + (_ROW_H - _BAR_H) / 2
        body.append(_row_label(left, y, f"pp rank {r}"))
        last = max((b.end_s for b in blocks if b.rank == r), default=0.0)
        if min(step_time_s, end) > last:
            body.append(_rect(left + last * scale, y, (min(step_time_s, end) - last) * scale,
                              _BAR_H, "#ccc", f"rank {r}: rest of the step"))
    for b in blocks:
        if b.start_s >= end:
            continue
        y = top + b.rank * _ROW_H + (_ROW_H - _BAR_H) / 2
        x, w = left + b.start_s * scale, (min(b.end_s, end) - b.start_s) * scale
        what = names[b.kind]
        body.append(_rect(x, y, w, _BAR_H, colors[b.kind],
                          f"{b.label}: stage {b.stage} {what} of microbatch {b.microbatch}, "
                          f"{fmt(b.start_s)} - {fmt(b.end_s)}"))
        if w >= 3:  # a white edge separates neighbouring blocks
            body.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{_BAR_H}" '
                        'fill="none" stroke="#fff" stroke-width="0.5"/>')
        if _fits_label(b, w):
            body.append(_text(x + w / 2, y + _BAR_H - 5, b.label, anchor="middle", size=10,
                              fill="#fff"))
    return _svg(y_end + 24, body, title)
