"""Sizes and durations as people read and write them. Sizes in binary units (KiB, MiB, GiB), the way memory
and GPU tools print them; durations as ``45s``, ``7m12s``, ``1.5h``, and read back from ``90``, ``30m``, ``1h``.

One formatter for every place that shows a size to a person (the checkpoint browser, its chart, the
demo's summary, the CLI's tables and lines, progress, the task log), so none reads "333 MB" where another
reads "318 MiB". Scripts read sizes from ``--json``, in bytes (0.9.0 moved the CLI's tables from decimal MB).
"""

from __future__ import annotations

import re

__all__ = ["binary_size", "duration_text", "parse_duration"]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def binary_size(n: float) -> str:
    """``binary_size(33_000_000) == '31.5 MiB'``; bytes below 1,000 as ``'512 B'``. At most three digits
    before the point (1,005 KiB is ``'1.0 MiB'``, as ``ls -h`` says it): a log line's sizes read alike."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in _UNITS:
        n /= 1024
        if abs(n) < 999.5 or unit == _UNITS[-1]:
            return f"{n:,.1f} {unit}" if abs(n) < 99.95 else f"{n:,.0f} {unit}"
    raise AssertionError("unreachable")


def duration_text(seconds: float) -> str:
    """7m12s, 9.4h, 45s: short, for a log line."""
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.2g}s"
    if seconds < 3600:
        m, s = divmod(round(seconds), 60)
        return f"{m}m{s:02d}s" if s else f"{m}m"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?", re.ASCII)  # "٣m" is no duration
_SECONDS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number of seconds (``90``, ``0.5``) or with a unit (``30s``, ``10m``, ``1h``,
    ``2d``, ``250ms``), or several (``1h30m``). ValueError names what it takes."""
    spelled = text.strip().lower()
    parts = list(_DURATION.finditer(spelled))
    if not parts or "".join(m.group(0) for m in parts).replace(" ", "") != spelled.replace(" ", "") or (
            len(parts) > 1 and any(m.group(2) is None for m in parts)):
        raise ValueError(f"{text!r} is not a duration: give seconds (90) or a number with a unit (30s, 10m, 1h, 2d)")
    return sum(float(m.group(1)) * _SECONDS[m.group(2)] for m in parts)
