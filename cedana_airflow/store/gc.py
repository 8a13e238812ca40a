"""Retention and garbage collection.

Retention removes manifests: the newest ``keep`` checkpoints of an ID (in restore order) stay, and
an ID whose task succeeded can be removed whole. Chunks are never removed there, because other
checkpoints may share them. Garbage collection removes chunks no manifest names, and temporary
files of interrupted writes, once they are older than a grace period, and what else has expired
(hygiene.py: leases of gone holders, settled quarantine records, sidecar locks), under the exclusive gc lock
(writers hold shared locks, see locks.py). Rules: docs/store-format.md, "Locking and garbage collection".
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..format.layout import CHUNKS, checkpoint_prefix, chunk_digest, is_temp, manifest_key, rounds_prefix
from ..errors import CorruptCheckpoint
from ..format.manifest import Manifest
from ..ids import validate_checkpoint_id
from . import index
from .base import Store
from .hygiene import find_stale
from .locks import acquire_gc
from .restores import delete_restores
from .transfer import load_manifests, load_manifests_of

__all__ = ["GcReport", "prune_checkpoints", "delete_checkpoint_id", "collect_garbage", "DEFAULT_GRACE_SECONDS"]

log = logging.getLogger(__name__)

#: A chunk younger than this is spared even when no manifest names it yet (an upload in flight).
DEFAULT_GRACE_SECONDS = 3600.0
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def prune_checkpoints(store: Store, checkpoint_id: str, keep: int,
                      trusted: Callable[[Manifest], bool] | None = None) -> tuple[list[Manifest], list[Manifest]]:
    """Remove all but the newest ``keep`` checkpoints of an ID; return (kept, removed), newest first.
    With ``trusted`` (the writer's key), only checkpoints it vouches for count and are pruned: a forged
    manifest ranked newest (a high try number) must not push the real ones out."""
    if keep < 1:
        raise ValueError("keep must be at least 1: the newest checkpoint is never pruned")
    found = [m for m in load_manifests(store, checkpoint_id) if trusted is None or trusted(m)]
    kept, removed = found[:keep], found[keep:]
    for m in removed:
        store.delete(manifest_key(checkpoint_id, m.seq))
    if removed:
        log.info("checkpoints pruned checkpoint_id=%s removed=%d kept=%d", checkpoint_id, len(removed), keep)
    return kept, removed


def delete_checkpoint_id(store: Store, checkpoint_id: str, seqs: Collection[int] | None = None) -> int:
    """Remove every checkpoint of an ID (its task succeeded), or only ``seqs`` (those a user was allowed
    to delete: one written since is another's to judge); return how many."""
    validate_checkpoint_id(checkpoint_id)
    chosen = store.list_seqs(checkpoint_id) if seqs is None else sorted(seqs)
    for seq in chosen:
        store.delete(manifest_key(checkpoint_id, seq))
    delete_restores(store, checkpoint_id)  # its history goes with it: nothing is left to resume
    left = load_manifests(store, checkpoint_id) if seqs is not None else []
    if left:  # written meanwhile: kept, and listed as what is left
        log.warning("checkpoint ID %s: %d checkpoint(s) written after the delete was allowed are kept",
                    checkpoint_id, len(left))
        index.record_checkpoint(store, left[0], left)
    else:
        index.forget(store, checkpoint_id)
    log.info("checkpoints deleted checkpoint_id=%s removed=%d", checkpoint_id, len(chosen))
    return len(chosen)


@dataclass(frozen=True)
class GcReport:
    dry_run: bool
    manifests: int
    chunks_kept: int
    chunks_removed: int
    bytes_removed: int
    young_unreferenced: int  # spared by the grace period
    temp_removed: int
    # hygiene.py: what else had expired (additive in 0.5.1)
    leases_removed: int = 0
    quarantine_removed: int = 0
    sidecars_removed: int = 0


def _named_by_unread(store: Store, by_id: dict[str, list[Manifest]]) -> set[str]:
    """Chunks named by manifests this version could not read (a later format, a block it does not know):
    every 64-hex ``digest`` anywhere in their JSON. A checkpoint another node can restore keeps its chunks,
    whatever this node makes of it; only a manifest that is not JSON at all names nothing."""
    out: set[str] = set()
    for cid, ms in by_id.items():
        read = {m.seq for m in ms}
        for seq in store.list_seqs(cid):
            if seq in read:
                continue
            try:
                doc = json.loads(store.get_manifest(cid, seq))
            except (ValueError, CorruptCheckpoint):
                continue
            out |= _digests_in(doc)
    return out


def _digests_in(doc: object) -> set[str]:
    if isinstance(doc, dict):
        found = {v for k, v in doc.items() if k == "digest" and isinstance(v, str) and _DIGEST.match(v)}
        return found.union(*(_digests_in(v) for v in doc.values()))
    if isinstance(doc, list):
        return set().union(*(_digests_in(v) for v in doc))
    return set()


def collect_garbage(store: Store, *, grace_seconds: float = DEFAULT_GRACE_SECONDS, dry_run: bool = False,
                    wait_seconds: float = 0.0) -> GcReport:
    """``wait_seconds``: how long to wait for checkpoints being written to finish (locks.acquire_gc)."""
    lock = acquire_gc(store, wait_seconds)
    try:
        ids = store.list_ids()
        by_id = load_manifests_of(store, ids)
        manifests = [m for ms in by_id.values() for m in ms]
        if not dry_run:
            index.rebuild_index(store, by_id)  # the listing index is a cache: gc makes it agree again
        referenced = set().union(*(m.chunk_digests() for m in manifests)) | _named_by_unread(store, by_id)
        cutoff = time.time() - grace_seconds
        kept = removed = freed = young = temps = 0
        present: set[str] = set()  # chunks that stay
        for obj in list(store.list_objects(CHUNKS)):
            if is_temp(obj.key):
                if obj.mtime < cutoff:
                    temps += 1
                    if not dry_run:
                        store.delete(obj.key)
                continue
            if chunk_digest(obj.key) in referenced:
                kept += 1
                present.add(chunk_digest(obj.key))
            elif obj.mtime >= cutoff:
                young += 1
                present.add(chunk_digest(obj.key))
            else:
                removed += 1
                freed += obj.size
                if not dry_run:
                    store.delete(obj.key)
        for cid in ids:  # temporary manifests of writers killed before their commit point, a job's old rounds
            rounds = rounds_prefix(cid)
            for obj in list(store.list_objects(checkpoint_prefix(cid))):
                if (is_temp(obj.key) or obj.key.startswith(rounds)) and obj.mtime < cutoff:
                    temps += 1
                    if not dry_run:
                        store.delete(obj.key)
        stale = find_stale(store, referenced=referenced, present=present, cutoff=cutoff)
        if not dry_run:
            for key in stale.keys():
                store.delete(key)
            # a lock file someone holds is left (FileStore.delete): count only what went
            stale.sidecars = [k for k in stale.sidecars if store.get(k) is None]
        temps += len(stale.temp)
    finally:
        lock.release(store)
    report = GcReport(dry_run, len(manifests), kept, removed, freed, young, temps, len(stale.leases),
                      len(stale.quarantine), len(stale.sidecars))
    log.info("gc done dry_run=%s manifests=%d chunks_kept=%d chunks_removed=%d bytes_removed=%d "
             "young_unreferenced=%d temp_removed=%d leases_removed=%d quarantine_removed=%d sidecars_removed=%d",
             *report.__dict__.values())
    return report
