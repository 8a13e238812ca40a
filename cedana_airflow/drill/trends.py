"""Trend figures across drills: does restore keep working, and is it getting slower?

Per mode: how many drills, the pass rate, and the 50th/95th percentiles of the RTO, the restore
time and the lost work, over the reports that measured them. Dry runs and drills that stopped before
acting (kill switch, outside their windows, nothing eligible) prove nothing and are left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .report import DrillReport

__all__ = ["trends"]


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile: a value that some drill really had, never an interpolation."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def trends(reports: Sequence[DrillReport]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    counted = [r for r in reports if r.counts()]
    for mode in sorted({r.mode for r in counted}):
        rs = [r for r in counted if r.mode == mode]
        figures: dict[str, Any] = {"drills": len(rs), "passed": sum(r.ok for r in rs),
                                   "pass_rate": round(sum(r.ok for r in rs) / len(rs), 3),
                                   "last": rs[-1].finished_at.isoformat(), "last_ok": rs[-1].ok}
        for name in ("rto_seconds", "restore_seconds", "lost_work_seconds"):
            values = [v for r in rs if (v := getattr(r, name)) is not None]
            figures[name] = {"p50": _percentile(values, 50), "p95": _percentile(values, 95)}
        out[mode] = figures
    return out
