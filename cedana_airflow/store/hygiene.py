"""What a store accumulates besides chunks, and when gc may take it (``check`` reports the same).

A store that runs for years must not grow without bound. Besides unreferenced chunks and temporary
files (gc.py), three kinds of object outlive their use, and each expires by the grace rule chunks
follow (untouched for ``grace_seconds``, by the store's own clock: the object's mtime):

- a **writer lease** (``leases/<id>.json``) that nobody renewed for the grace period and its TTL: its
  holder is gone (a live one rewrites it every third of its TTL, and a deleted live lease is written
  again at its next renewal);
- a **quarantine record** whose chunk is back in the store (healed) or named by no checkpoint any more
  (nothing to heal): history that has done its work. A record of a chunk still missing and still
  named stays, since it is what makes a writer upload that chunk again;
- a file store's **sidecar lock** (``.lock-<name>``) of the listing index and the leases: removed only
  while gc holds it and nobody else does (FileStore.delete), so no writer is ever left holding a lock
  that another cannot see.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..format.layout import INDEX, LEASES, QUARANTINE, is_cas_lock, is_temp, quarantine_digest
from .base import Store

__all__ = ["Stale", "find_stale"]


@dataclass
class Stale:
    """Keys gc may remove, by kind."""

    leases: list[str] = field(default_factory=list)
    quarantine: list[str] = field(default_factory=list)
    sidecars: list[str] = field(default_factory=list)
    temp: list[str] = field(default_factory=list)

    def keys(self) -> Iterable[str]:
        return [*self.leases, *self.quarantine, *self.sidecars, *self.temp]


def _lease_ttl(store: Store, key: str) -> float:
    try:
        return float(json.loads(store.get(key) or b"{}").get("ttl_seconds", 0.0))
    except (ValueError, TypeError, AttributeError):
        return 0.0  # unreadable: the grace period alone decides


def find_stale(store: Store, *, referenced: set[str], present: set[str], cutoff: float) -> Stale:
    """What has expired: ``referenced`` chunks are named by some checkpoint, ``present`` ones are in
    the store, ``cutoff`` is now minus the grace period (store time)."""
    out = Stale()
    for prefix in (LEASES, INDEX, QUARANTINE):
        for obj in store.list_objects(prefix):
            if is_temp(obj.key):  # an interrupted write of a file store
                if obj.mtime < cutoff:
                    out.temp.append(obj.key)
            elif is_cas_lock(obj.key):
                if obj.mtime < cutoff:
                    out.sidecars.append(obj.key)
            elif prefix == LEASES:
                if obj.mtime < cutoff and obj.mtime + _lease_ttl(store, obj.key) < cutoff:
                    out.leases.append(obj.key)
            elif prefix == QUARANTINE:
                digest = quarantine_digest(obj.key)
                if digest is not None and obj.mtime < cutoff and (digest in present or digest not in referenced):
                    out.quarantine.append(obj.key)
    return out
