"""The per-ID chart: checkpoints over time, drawn on the server as one inline SVG, no JS library.

The page is Jinja2-autoescaped, so the chart is a Markup built only from numbers formatted here and
text passed through markupsafe.escape. Colours are the page's CSS variables and currentColor, so its
light and dark themes apply. viewBox + width="100%" lets it shrink to any frame without overflowing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone, tzinfo

from markupsafe import Markup, escape

from ...format.manifest import Manifest
from ...store.restores import RestoreRecord
from ...units import binary_size

__all__ = ["checkpoint_chart"]

_MULT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50}
# wall-clock steps a reader counts in, seconds to a week
_STEPS = (1, 2, 5, 10, 15, 20, 30, 60, 120, 180, 300, 600, 900, 1200, 1800, 3600, 7200, 10800, 14400,
          21600, 43200, 86400, 172800, 345600, 604800)
_L, _R, _T, _B = 64, 52, 30, 46  # margins: size ticks, freeze ticks, legend, seq + time labels + title
# the page's theme variables (browser.css), so light and dark both apply; its .chart rules may override
_SIZE, _FREEZE, _RESTORE, _FRESH = "var(--accent)", "var(--warn)", "var(--good)", "var(--bad)"
_GRID, _MUTED = "var(--line)", "var(--muted)"


def _n(v: float) -> str:
    return f"{v:.1f}"


def _epoch(t: datetime) -> float:
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()  # a naive time is UTC, as written


def _time_ticks(t0: float, t1: float, tz: tzinfo) -> tuple[list[float], str]:
    """Ticks on the local wall clock of ``tz`` (13:00 in Berlin, not 12:00 UTC), as near 5 as the steps
    allow and never over 6, and their strftime format. The offset is t0's: a DST change may skew day steps."""
    off = (datetime.fromtimestamp(t0, tz).utcoffset() or timedelta(0)).total_seconds()

    def first(step: float) -> float:
        return math.ceil((t0 + off) / step) * step - off

    def count(step: float) -> int:  # arithmetic, so a year at 1 s steps lists nothing
        return int((t1 - first(step)) // step) + 1

    step = min((*_STEPS, math.ceil((t1 - t0) / 5 / 86400) * 86400), key=lambda s: (count(s) > 6, abs(count(s) - 5)))
    days = datetime.fromtimestamp(t0, tz).date() != datetime.fromtimestamp(t1, tz).date()
    fmt = "%b %d" if step >= 86400 else "%H:%M:%S" if step < 60 else "%b %d %H:%M" if days else "%H:%M"
    return [first(step) + k * step for k in range(count(step))], fmt


def _reads_exactly(v: int) -> bool:
    num, unit = binary_size(v).split()
    return float(num.replace(",", "")) * _MULT[unit] == v


def _size_ticks(top: int) -> list[int]:
    """Powers of two, so ticks read 0, 64 MiB, 128 MiB ...; coarser while the shared formatter would round
    one (1.25 GiB shows as '1.2 GiB'): a tick label must be the value at its line."""
    step = 1
    while top / step > 5 or not all(_reads_exactly(k * step) for k in range(math.ceil(top / step) + 1)):
        step *= 2
    return [k * step for k in range(math.ceil(top / step) + 1)]


def _seconds_ticks(top: float) -> list[float]:
    mag = 10 ** math.floor(math.log10(top / 5))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= top / 5 * (1 - 1e-9))
    return [round(k * step, 9) for k in range(math.ceil(top / step - 1e-9) + 1)]


def _finite(v: float) -> float:
    return v if math.isfinite(v) and v > 0 else 0.0


def checkpoint_chart(manifests: Sequence[Manifest], restores: Sequence[RestoreRecord], *, tz: tzinfo = timezone.utc,
                     width: int = 960, height: int = 260) -> Markup | None:
    """Checkpoints over time: stored size per checkpoint as bars (image size as an outline behind), the
    freeze as a line on the right axis, restores as dashed verticals. None when there are none."""
    if not manifests:
        return None
    ms = sorted(manifests, key=lambda m: (_epoch(m.created_at), m.seq))
    rs = sorted(restores, key=lambda r: _epoch(r.at))
    times = [_epoch(m.created_at) for m in ms] + [_epoch(r.at) for r in rs]
    t0, t1 = min(times), max(times)
    if t1 - t0 < 60:  # one checkpoint, or all at once: a minute around them, so the axis still has ticks
        t0, t1 = (t0 + t1) / 2 - 30, (t0 + t1) / 2 + 30
    x0, x1, y0, y1 = _L, max(width - _R, _L + 1), _T, max(height - _B, _T + 1)
    bw = max(2.0, min(24.0, (x1 - x0) / len(ms) * 0.6))
    pad = bw / 2 + 4  # the first and last bar stay inside the axes

    def x(t: float) -> float:
        return x0 + pad + (t - t0) / (t1 - t0) * (x1 - x0 - 2 * pad)

    sizes = _size_ticks(max(1024, *(max(m.image_bytes, m.stored_bytes) for m in ms)))
    freezes = [_finite(m.freeze_seconds) for m in ms]
    secs = _seconds_ticks(max(freezes) if max(freezes) >= 1e-3 else 1.0)  # no freeze: a 0-1 s axis

    def ys(v: float) -> float:
        return y1 - v / sizes[-1] * (y1 - y0)

    def yf(v: float) -> float:
        return y1 - v / secs[-1] * (y1 - y0)

    def when(t: float, fmt: str = "%Y-%m-%d %H:%M:%S %Z") -> str:
        return datetime.fromtimestamp(t, tz).strftime(fmt)

    zone = getattr(tz, "key", None) or tz.tzname(datetime.fromtimestamp(t0, tz)) or "local"

    n_restored, n_fresh = sum(r.outcome == "restored" for r in rs), sum(r.outcome == "fresh" for r in rs)
    lo, hi = min(freezes), max(freezes)
    summary = (f"{len(ms)} checkpoint{'s' * (len(ms) != 1)}, {binary_size(ms[-1].stored_bytes)} newest, "
               f"freeze {f'{lo:.1f}-{hi:.1f}' if f'{lo:.1f}' != f'{hi:.1f}' else f'{hi:.1f}'} s, "
               f"{n_restored} restore{'s' * (n_restored != 1)}"
               + (f", {n_fresh} fresh start{'s' * (n_fresh != 1)}" if n_fresh else ""))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="ckpt-chart" viewBox="0 0 {width} {height}" width="100%" '
           f'preserveAspectRatio="xMidYMid meet" role="img" aria-label="{escape(summary)}" '
           f'font-family="system-ui, sans-serif" font-size="11" fill="currentColor">']

    # axes: size gridlines + ticks on the left, freeze ticks on the right, time along the bottom
    for v in sizes:
        out.append(f'<line class="grid" x1="{x0}" x2="{x1}" y1="{_n(ys(v))}" y2="{_n(ys(v))}" stroke="{_GRID}"/>'
                   f'<text class="ytick" x="{x0 - 6}" y="{_n(ys(v) + 4)}" text-anchor="end">'
                   f'{escape(binary_size(v))}</text>')
    for s in secs:
        out.append(f'<text class="ftick" x="{x1 + 6}" y="{_n(yf(s) + 4)}" fill="{_FREEZE}">{s:g} s</text>')
    ticks, tfmt = _time_ticks(t0, t1, tz)
    for t in ticks:
        tx = _n(x(t))
        out.append(f'<line class="xtick" x1="{tx}" x2="{tx}" y1="{y1}" y2="{y1 + 4}" stroke="currentColor"/>'
                   f'<text class="xtick" x="{tx}" y="{y1 + 28}" text-anchor="middle">{escape(when(t, tfmt))}</text>')
    out.append(f'<path class="axis" d="M{x0} {y0}V{y1}H{x1}V{y0}" fill="none" stroke="{_GRID}"/>'
               f'<text class="xtitle" x="{_n((x0 + x1) / 2)}" y="{height - 4}" text-anchor="middle" fill="{_MUTED}">'
               f'time ({escape(zone)})</text>')

    # one bar per checkpoint (its image as an outline behind); seq labels where there is room, one per 28 px
    last_label, dots = -math.inf, []
    for m, f in zip(ms, freezes):
        cx, left = x(_epoch(m.created_at)), _n(x(_epoch(m.created_at)) - bw / 2)
        tip = escape(f"seq {m.seq} · try {m.try_number} · node {m.node}\nstored {binary_size(m.stored_bytes)} of "
                     f"{binary_size(m.image_bytes)} image\nfreeze {f:.2f} s\n{when(_epoch(m.created_at))}")
        out.append(f'<g class="ckpt"><title>{tip}</title>'
                   f'<rect class="image" x="{left}" y="{_n(ys(m.image_bytes))}" width="{_n(bw)}" '
                   f'height="{_n(y1 - ys(m.image_bytes))}" fill="none" stroke="{_MUTED}"/>'
                   f'<rect class="bar" x="{left}" y="{_n(ys(m.stored_bytes))}" width="{_n(bw)}" '
                   f'height="{_n(y1 - ys(m.stored_bytes))}" fill="{_SIZE}"/></g>')
        if cx - last_label >= 28:
            out.append(f'<text class="seq" x="{_n(cx)}" y="{y1 + 14}" text-anchor="middle" fill="{_MUTED}">'
                       f'#{m.seq}</text>')
            last_label = cx
        dots.append(f'<circle class="freeze-dot" cx="{_n(cx)}" cy="{_n(yf(f))}" r="3" fill="{_FREEZE}">'
                    f'<title>{tip}</title></circle>')
    line = " ".join(f"{_n(x(_epoch(m.created_at)))},{_n(yf(f))}" for m, f in zip(ms, freezes))
    out += [f'<polyline class="freeze" points="{line}" fill="none" stroke="{_FREEZE}" stroke-width="1.5"/>', *dots]

    # restores: dashed where a checkpoint came back, dotted where a try started fresh; close labels stack
    last_x, row = -math.inf, 0
    for r in rs:
        rx, restored = x(_epoch(r.at)), r.outcome == "restored"
        row, last_x = (row + 1) % 3 if rx - last_x < 110 else 0, rx
        label = f"restored seq {r.seq} / try {r.try_number}" if restored else "fresh"
        detail = (f"from node {r.from_node} to {r.node}\nrestore {r.restore_seconds:.2f} s, gap {r.gap_seconds:.0f} s"
                  if restored else f"try {r.try_number} · node {r.node}\n"
                  f"{r.reason or ', '.join(r.refused) or 'nothing to resume'}")
        tip = escape(f"{label}\n{detail}\n{when(_epoch(r.at))}")
        cls, colour, dash = ("restore", _RESTORE, "5 3") if restored else ("fresh", _FRESH, "1 3")
        end = rx > x1 - 120  # a label near the right edge runs leftwards
        out.append(f'<g class="mark"><title>{tip}</title><line class="{cls}" x1="{_n(rx)}" x2="{_n(rx)}" '
                   f'y1="{y0}" y2="{y1}" stroke="{colour}" stroke-width="1.5" stroke-dasharray="{dash}"/>'
                   f'<text class="{cls}-label" x="{_n(rx - 3 if end else rx + 3)}" y="{y0 + 10 + 12 * row}" '
                   f'text-anchor="{"end" if end else "start"}" fill="{colour}">{escape(label)}</text></g>')

    # legend above the plot, its marks in the same classes so the page's .chart rules style both alike
    lx = x0
    for name, mark in (("stored size", f'<rect class="bar" width="10" height="10" fill="{_SIZE}"/>'),
                       ("image size", f'<rect class="image" width="10" height="10" fill="none" stroke="{_MUTED}"/>'),
                       ("freeze (right axis)", f'<line class="freeze" x2="14" y1="5" y2="5" stroke="{_FREEZE}"/>'
                                               f'<circle class="freeze-dot" cx="7" cy="5" r="3" fill="{_FREEZE}"/>'),
                       ("restore", f'<line class="restore" x1="5" x2="5" y2="10" stroke="{_RESTORE}" '
                                   'stroke-dasharray="3 2"/>'),
                       ("fresh start", f'<line class="fresh" x1="5" x2="5" y2="10" stroke="{_FRESH}" '
                                       'stroke-dasharray="1 2"/>')):
        out.append(f'<g class="legend" transform="translate({lx} 8)">{mark}<text x="18" y="9">{name}</text></g>')
        lx += 30 + 6 * len(name)
    out.append("</svg>")
    return Markup("".join(out))
