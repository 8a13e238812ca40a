"""Which checkpoint a restore uses, and whether it is still worth restoring: pure functions over
manifests, tested without a store.

The newest complete checkpoint wins, newest meaning the highest (try_number, seq): a checkpoint
written late by an older try that is still running somewhere (a stale writer) never outranks one
written by a newer try. Callers walk the list in order and fall back to the next one when a
checkpoint fails verification.

A checkpoint can also be too old to restore: a real-time reader's data has moved on
(``max_restore_gap``), or the license the process held has expired (``lease``). Such a workload
starts fresh instead; :func:`limits_exceeded` says which limit a checkpoint's age broke.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import NamedTuple

from .manifest import Manifest

__all__ = ["AgeLimit", "limits_exceeded", "restore_order"]


class AgeLimit(NamedTuple):
    """The oldest a checkpoint may be and still be restored, and the setting that says so."""

    name: str  # "max_restore_gap" or "lease"
    seconds: float


def restore_order(manifests: Iterable[Manifest]) -> list[Manifest]:
    return sorted(manifests, key=lambda m: (m.try_number, m.seq), reverse=True)


def limits_exceeded(m: Manifest, now: datetime, limits: Iterable[AgeLimit]) -> tuple[float, list[AgeLimit]]:
    """The checkpoint's age at ``now`` (its restore gap, in seconds) and the limits it is beyond, in order."""
    gap = (now - m.created_at).total_seconds()
    return gap, [limit for limit in limits if gap > limit.seconds]
