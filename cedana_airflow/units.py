"""Sizes as people read them: binary units (KiB, MiB, GiB), the way memory and GPU tools print them.

One formatter for the places that show a size to a person in prose or on a page (the checkpoint
browser, its chart, the demo's summary), so those never read "333 MB" in one and "318 MiB" in another.
The CLI's tables still print decimal MB (scripts read those columns); moving them is its own change.
"""

from __future__ import annotations

__all__ = ["binary_size"]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def binary_size(n: float) -> str:
    """``binary_size(333_000_000) == '317.6 MiB'``; bytes below 1 KiB as ``'512 B'``."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in _UNITS:
        n /= 1024
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:,.1f} {unit}" if abs(n) < 100 else f"{n:,.0f} {unit}"
    raise AssertionError("unreachable")
