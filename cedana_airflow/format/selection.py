"""Which checkpoint a restore uses: a pure function over manifests, tested without a store.

The newest complete checkpoint wins, newest meaning the highest (try_number, seq): a checkpoint
written late by an older try that is still running somewhere (a stale writer) never outranks one
written by a newer try. Callers walk the list in order and fall back to the next one when a
checkpoint fails verification.
"""

from __future__ import annotations

from collections.abc import Iterable

from .manifest import Manifest

__all__ = ["restore_order"]


def restore_order(manifests: Iterable[Manifest]) -> list[Manifest]:
    return sorted(manifests, key=lambda m: (m.try_number, m.seq), reverse=True)
