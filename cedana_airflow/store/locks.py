"""Store locks: garbage collection is exclusive; checkpoint writers hold a shared lock each.

A lock is an object under ``locks/`` created with a create-only write, holding who took it::

    locks/gc                          {"kind": "gc", "host": "node-3", "pid": 4711, "time": 1764441600.0}
    locks/writer-node-1-812-9f2c...   {"kind": "writer", ...}

Taking one writes it first and only then looks for the other kind, so of a writer and a gc that
start together at least one sees the other and backs off. A lock is stale after 30 minutes, or at
once when its host is this host and its pid is gone; stale locks are ignored and removed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from ..errors import StoreBusy
from ..format.layout import GC_LOCK_KEY, LOCKS, writer_lock_key
from .base import Store

__all__ = ["Lock", "STALE_AFTER_SECONDS", "acquire_gc", "acquire_writer", "live_locks"]

log = logging.getLogger(__name__)

STALE_AFTER_SECONDS = 30 * 60


@dataclass(frozen=True)
class Lock:
    key: str
    kind: str
    host: str
    pid: int
    time: float

    def stale(self, now: float) -> bool:
        if now - self.time > STALE_AFTER_SECONDS:
            return True
        return self.host == socket.gethostname() and not os.path.exists(f"/proc/{self.pid}")

    def release(self, store: Store) -> None:
        store.delete(self.key)


def _body(kind: str) -> bytes:
    return json.dumps({"kind": kind, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()


def _parse(key: str, raw: bytes | None) -> Lock | None:
    try:
        d = json.loads(raw or b"")
        return Lock(key, str(d["kind"]), str(d["host"]), int(d["pid"]), float(d["time"]))
    except (ValueError, KeyError, TypeError):
        return None


def live_locks(store: Store, kind: str) -> list[Lock]:
    """Locks of ``kind`` that are not stale; stale ones found on the way are removed."""
    now, out = time.time(), []
    for obj in store.list_objects(LOCKS):
        lock = _parse(obj.key, store.get(obj.key))
        if lock is None or lock.kind != kind:
            continue
        if lock.stale(now):
            log.info("removing stale lock key=%s host=%s pid=%d", lock.key, lock.host, lock.pid)
            store.delete(lock.key)
            continue
        out.append(lock)
    return out


def _mine(key: str, kind: str) -> Lock:
    return Lock(key, kind, socket.gethostname(), os.getpid(), time.time())


def acquire_writer(store: Store) -> Lock:
    """A writer's shared lock; StoreBusy while a garbage collection runs."""
    key = writer_lock_key(socket.gethostname(), os.getpid(), uuid.uuid4().hex[:12])
    store.put_if_absent(key, _body("writer"))
    mine = _mine(key, "writer")
    gc = live_locks(store, "gc")
    if gc:
        mine.release(store)
        raise StoreBusy(
            f"store {store.url}: garbage collection by {gc[0].host} pid {gc[0].pid} is running. "
            "This checkpoint is skipped; the next heartbeat tries again."
        )
    return mine


def acquire_gc(store: Store, wait_seconds: float = 0.0, poll_seconds: float = 0.5) -> Lock:
    """The exclusive lock for garbage collection; StoreBusy while another gc runs, or while writers
    still run ``wait_seconds`` after it was taken.

    Holding the lock while it waits is what lets gc win on a store written around the clock: from the
    moment it is taken no new writer starts (each skips its heartbeat), so only the saves already under
    way are waited for. Dropping it at once instead (``wait_seconds`` 0, the only way before 0.5.1) lost
    every gc to 32 writers heartbeating every 2 s (docs/faults.md)."""
    for _ in range(2):
        if store.put_if_absent(GC_LOCK_KEY, _body("gc")):
            break
        held = live_locks(store, "gc")
        if held:
            raise StoreBusy(
                f"store {store.url}: garbage collection is already running on {held[0].host} pid {held[0].pid}. "
                "Wait for it to finish."
            )
    else:
        raise StoreBusy(f"store {store.url}: could not take {GC_LOCK_KEY}. Retry.")
    mine = _mine(GC_LOCK_KEY, "gc")
    deadline = time.monotonic() + wait_seconds
    while writers := live_locks(store, "writer"):
        left = deadline - time.monotonic()
        if left <= 0:
            mine.release(store)
            waited = f" after waiting {wait_seconds:g} s" if wait_seconds > 0 else ""
            raise StoreBusy(
                f"store {store.url}: {len(writers)} checkpoint(s) are still being written{waited} (e.g. by "
                f"{writers[0].host} pid {writers[0].pid}). Retry gc in a moment, or give it longer (gc --wait)."
            )
        time.sleep(min(poll_seconds, left))
    return mine
