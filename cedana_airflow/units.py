"""Sizes as people read them: binary units (KiB, MiB, GiB), the way memory and GPU tools print them.

One formatter for every place that shows a size to a person (the checkpoint browser, its chart, the
demo's summary, the CLI's tables and lines, progress, the task log), so none reads "333 MB" where another
reads "318 MiB". Scripts read sizes from ``--json``, in bytes (0.9.0 moved the CLI's tables from decimal MB).
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
