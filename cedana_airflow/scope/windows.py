"""Time windows: when something disruptive (a live drill) may happen, written the way people say it.

A window is ``HH:MM-HH:MM`` (every day) or ``DAYS HH:MM-HH:MM`` where DAYS is a day (``Sat``), a
range (``Mon-Fri``) or a comma list (``Sat,Sun``); times are UTC, the end is excluded, and a window
whose end is before its start runs past midnight (``Fri 22:00-02:00`` ends Saturday 02:00).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

__all__ = ["Window", "in_any_window", "parse_window"]

_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_SHAPE = re.compile(r"^(?:(?P<days>[A-Za-z,\-]+)\s+)?(?P<h1>\d{1,2}):(?P<m1>\d{2})-(?P<h2>\d{1,2}):(?P<m2>\d{2})$")


@dataclass(frozen=True)
class Window:
    text: str
    days: frozenset[int]  # weekday() numbers the window starts on
    start: int  # minutes after midnight
    end: int

    def contains(self, at: datetime) -> bool:
        at = at.astimezone(timezone.utc)
        minute = at.hour * 60 + at.minute
        if self.start < self.end:
            return at.weekday() in self.days and self.start <= minute < self.end
        # past midnight: the late part belongs to today's window, the early part to yesterday's
        return ((at.weekday() in self.days and minute >= self.start)
                or ((at.weekday() - 1) % 7 in self.days and minute < self.end))


def _day(name: str, text: str) -> int:
    try:
        return _DAYS.index(name.strip().lower()[:3])
    except ValueError:
        raise ValueError(f"window {text!r}: {name!r} is not a day; use Mon, Tue, Wed, Thu, Fri, Sat, Sun") from None


def parse_window(text: str) -> Window:
    """One window; a ValueError names what is wrong with it."""
    m = _SHAPE.match(text.strip())
    if not m:
        raise ValueError(f"window {text!r} is not 'HH:MM-HH:MM' or 'DAYS HH:MM-HH:MM' (e.g. 'Sat 02:00-06:00', UTC)")
    times = [int(m[k]) for k in ("h1", "m1", "h2", "m2")]
    if times[0] > 23 or times[2] > 24 or times[1] > 59 or times[3] > 59 or (times[2] == 24 and times[3]):
        raise ValueError(f"window {text!r}: a time is out of range")
    start, end = times[0] * 60 + times[1], times[2] * 60 + times[3]
    if start == end:
        raise ValueError(f"window {text!r} is empty: its start and end are the same")
    days: set[int] = set()
    for part in (m["days"] or "mon-sun").split(","):
        a, _, b = part.partition("-")
        first, last = _day(a, text), _day(b or a, text)
        days.update((first + i) % 7 for i in range((last - first) % 7 + 1))
    return Window(text, frozenset(days), start, end)


def in_any_window(windows: tuple[Window, ...], at: datetime) -> bool:
    """No windows: any time."""
    return not windows or any(w.contains(at) for w in windows)
