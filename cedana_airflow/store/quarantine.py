"""Bad chunks are set aside, so that the next heartbeat of any writer uploads them again.

Writers skip a chunk the previous checkpoint already stored, so a chunk that went bad in the store
(bit rot, a truncated upload, a deleted object) would poison every later checkpoint that shares it.
A reader that finds one (a restore, a drill's verify, ``cedana-airflow check --repair``) writes a
record ``quarantine/<digest>.json`` (when, which node, why) and removes the bad object from
``chunks/``; a writer lists ``quarantine/`` before each checkpoint, and a recorded chunk that is
absent from ``chunks/`` is uploaded again from the workload's memory, which heals every checkpoint
that names it. Order and races (docs/store-format.md, "Quarantine"):

- the record is written before the chunk is removed, so a writer that sees the chunk gone also sees
  why, and never takes its absence for "nothing to do";
- right before removing, the reader reads the chunk once more and removes it only if it is still
  bad: a writer may have uploaded a good copy meanwhile. What remains is a window of one request, in
  which a good copy can be removed; the record stays, so the next heartbeat uploads it again;
- records are history (``check`` lists them); gc removes one only once it has settled, its chunk
  healed or named by no checkpoint, and older than the grace period (hygiene.py).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterable

from ..errors import CorruptCheckpoint
from ..format import chunking
from ..format.layout import QUARANTINE, chunk_key, quarantine_digest, quarantine_key
from .read_stats import READS
from .base import Store

__all__ = ["heal_known", "quarantined", "read_chunk", "records", "set_aside"]

log = logging.getLogger(__name__)

def _intact(store: Store, digest: str) -> bool:
    try:
        return chunking.intact(store.get_chunk(digest), digest)
    except CorruptCheckpoint:  # missing
        return False


def set_aside(store: Store, digest: str, size: int, reader: str, why: str) -> bool:
    """Record ``digest`` as bad and remove it from ``chunks/`` if it is still bad; True when removed.

    The chunk is judged on its own (its content against its name), never by the size the manifest that
    named it claims: a manifest written by whoever can write the store could otherwise name another
    checkpoint's good chunk with a wrong size and have every reader delete it."""
    if _intact(store, digest):
        log.warning("chunk %s is intact: what named it with size %d does not match it (%s); kept", digest, size, why)
        return False
    record = {"digest": digest, "at": time.time(), "node": reader or socket.gethostname(), "why": why}
    store.put_if_absent(quarantine_key(digest), json.dumps(record).encode())  # the first finding is kept
    if _intact(store, digest):
        log.warning("chunk %s was bad but a good copy is in the store now; kept", digest)
        return False
    store.delete(chunk_key(digest))
    log.warning("chunk set aside digest=%s reason=%s: the next heartbeat of a writer that has it uploads it "
                "again", digest, why)
    return True


def read_chunk(store: Store, digest: str, size: int, reader: str = "") -> bytes | memoryview:
    """A chunk's raw bytes, verified; a bad or missing one is set aside, then CorruptCheckpoint raised."""
    t0 = time.perf_counter()
    try:
        blob = store.get_chunk(digest)
        t1 = time.perf_counter()
        raw = chunking.decode(blob, digest, size)
        READS.add(len(raw), t1 - t0, time.perf_counter() - t1)
        return raw
    except CorruptCheckpoint as e:
        set_aside(store, digest, size, reader, str(e))
        raise


def quarantined(store: Store) -> set[str]:
    """Digests with a quarantine record."""
    return {d for o in store.list_objects(QUARANTINE) if (d := quarantine_digest(o.key)) is not None}


def heal_known(store: Store, known: set[str]) -> set[str]:
    """Drop from ``known`` (chunks a writer would skip) those set aside and absent from the store, so they
    are uploaded again; returns them. One listing per checkpoint, one existence check per recorded chunk."""
    gone = {d for d in quarantined(store) & known if not store.has_chunk(d)}
    known.difference_update(gone)
    return gone


def records(store: Store, digests: Iterable[str] | None = None) -> list[dict[str, object]]:
    """The quarantine records (all, or of ``digests``), oldest first."""
    out = []
    for d in sorted(quarantined(store) if digests is None else set(digests)):
        raw = store.get(quarantine_key(d))
        if raw:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
    return sorted(out, key=lambda r: float(str(r.get("at", 0))))
