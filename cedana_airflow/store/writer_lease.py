"""The writer lease: one supervisor at a time writes a checkpoint ID.

Two supervisors of one ID with the same try number (the same task started twice, a node that lost
contact and came back) would interleave their seqs and prune each other's checkpoints, and "the
latest" would switch between two process trees. A lease object per ID, written by compare-and-swap
like the listing index, lets only one of them write::

    leases/<checkpoint id>.json   {"holder": "9f2c...", "node": "node-a", "try_number": 1,
                                   "ttl_seconds": 60, "renewed_at": 1764441600.0, ...}

The holder renews it every third of its TTL from a thread of its own, so a long upload never lets
it lapse. Another supervisor takes it over when

- it is held by an older try (Airflow's retry and Clear always advance the try number): the old
  holder is *fenced*; it notices at its next renewal or commit and stops checkpointing;
- its holder ran on this machine (same boot, same PID namespace) and that process is gone;
- it was not renewed for a whole TTL, as this supervisor observed it. Observed time, not the
  holder's clock: clocks of two nodes may disagree, a renewal cannot be faked by skew.

Otherwise a renewal seen while waiting proves the holder alive, and the newcomer is refused with one
line naming it (WriterLeaseHeld). The holder checks the lease once more right before each commit
point; what is left is a window of one request, documented in docs/store-format.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, ValidationError

from ..engine.procfs import process_start
from ..errors import CedanaError, WriterFenced, WriterLeaseHeld
from ..failpoints import failpoint
from ..format.layout import lease_key
from .base import Store

__all__ = ["LeaseRecord", "WriterLease", "lease_key"]

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.5


class LeaseRecord(BaseModel):
    """The lease object's content. Unknown fields are ignored: later versions may add some."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    format_version: int = 1
    holder: str  # random per supervisor: the only identity compared
    node: str
    try_number: int
    host: str
    boot_id: str  # with pid_ns: whether this machine can tell if ``pid`` is still alive
    pid_ns: str
    pid: int
    pid_start: int  # the process's start time in clock ticks: a reused pid is another process
    ttl_seconds: float
    acquired_at: float
    renewed_at: float
    owner: str = ""  # the Airflow task that holds it ("dag/task/map index"); "" outside Airflow (0.8.0)

    def describe(self, now: float) -> str:
        return (f"node {self.node} (try {self.try_number}, pid {self.pid} on host {self.host}), "
                f"renewed {max(0.0, now - self.renewed_at):.0f} s ago")


@functools.cache
def _machine() -> tuple[str, str]:
    """This machine's boot and our PID namespace: a process's constants, read once."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return boot, pid_ns


def _gone_here(rec: LeaseRecord) -> bool:
    """Whether the holder ran on this machine, in our PID namespace, and that process is gone."""
    boot, pid_ns = _machine()
    if not boot or rec.boot_id != boot or not rec.pid_ns or rec.pid_ns != pid_ns or not rec.pid_start:
        return False  # another machine or namespace (its pid means nothing here), or nothing to compare
    return process_start(rec.pid) != rec.pid_start


def _parse(raw: bytes | None) -> LeaseRecord | None:
    if raw is None:
        return None
    try:
        return LeaseRecord.model_validate_json(raw)
    except (ValidationError, ValueError):
        log.warning("writer lease unreadable; it is replaced")  # a damaged lease protects nobody
        return None


class WriterLease:
    """This supervisor's lease on one checkpoint ID: acquire, renew (a thread), confirm, release."""

    def __init__(self, store: Store, checkpoint_id: str, *, node: str, try_number: int, ttl_seconds: float,
                 owner: str = "") -> None:
        self.store, self.checkpoint_id, self.key = store, checkpoint_id, lease_key(checkpoint_id)
        self.node, self.try_number, self.ttl, self.owner = node, try_number, ttl_seconds, owner
        self.holder = uuid.uuid4().hex
        self._acquired_at = 0.0
        self._fenced: str | None = None
        self._host, self._pid_start = socket.gethostname(), process_start(os.getpid()) or 0
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the record ---------------------------------------------------------------------------
    def _record(self) -> bytes:
        now = time.time()
        boot, pid_ns = _machine()
        return LeaseRecord(
            holder=self.holder, node=self.node, try_number=self.try_number, host=self._host, boot_id=boot,
            pid_ns=pid_ns, pid=os.getpid(), pid_start=self._pid_start, ttl_seconds=self.ttl,
            acquired_at=self._acquired_at or now, renewed_at=now, owner=self.owner,
        ).model_dump_json().encode()

    def _ttl(self, cur: LeaseRecord) -> float:
        # The record's TTL, but never far beyond ours: a record with a TTL of years must not hold us forever.
        return min(cur.ttl_seconds, 4 * self.ttl)

    def _takeover_reason(self, cur: LeaseRecord) -> str | None:
        lapsed = time.time() - cur.renewed_at
        if lapsed > 2 * self._ttl(cur):  # twice the TTL: a clock skew of up to one TTL cannot fake it
            return f"it lapsed {lapsed:.0f} s ago"
        if cur.owner and self.owner and cur.owner != self.owner:
            raise self._held(cur, f"it is held for another task ({cur.owner}), not this one ({self.owner}); a newer "
                                  "try takes over only its own task's lease. Give this task its own checkpoint_id.")
        if cur.try_number < self.try_number:
            return f"its try {cur.try_number} is older than ours ({self.try_number})"
        if cur.try_number == self.try_number and _gone_here(cur):
            return f"its process {cur.pid} on this machine is gone"
        return None

    # -- acquire ------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lease, waiting up to one TTL to learn whether a holder of our try is still alive.

        Raises WriterLeaseHeld when a newer try holds it, or when the holder renews it while we wait.
        """
        seen: LeaseRecord | None = None
        seen_since = 0.0
        while True:
            raw, token = self.store.get_versioned(self.key)
            cur = _parse(raw)
            reason = "it was free" if cur is None else None
            if cur is not None:
                if cur.holder == self.holder:
                    reason = "it is ours"
                else:
                    reason = self._takeover_reason(cur)
                    if reason is None and cur.try_number > self.try_number:
                        raise self._held(cur, f"a newer try ({cur.try_number}) holds it; this try ({self.try_number}) "
                                              "is stale and must not write. Nothing was started or restored.")
            if reason is None:
                assert cur is not None
                now = time.monotonic()
                if seen is None or cur.holder != seen.holder:
                    seen, seen_since = cur, now
                    log.warning("writer lease of checkpoint ID %s is held by %s; waiting up to %.0f s to learn "
                                "whether that supervisor is still alive", self.checkpoint_id,
                                cur.describe(time.time()), self._ttl(cur))
                elif cur.renewed_at != seen.renewed_at:
                    raise self._held(cur, "it is alive (it renewed the lease while we waited). Two supervisors must "
                                          "not write one ID: stop the other one, or start this one with a higher "
                                          "try number (--try-number; Airflow raises it on every retry) to take over.")
                elif now - seen_since >= self._ttl(cur):
                    reason = f"it was not renewed for {now - seen_since:.0f} s (its TTL is {self._ttl(cur):.0f} s)"
                if reason is None:
                    time.sleep(min(_POLL_SECONDS, self._ttl(cur) / 4))
                    continue
            self._acquired_at = time.time()
            if self.store.put_if_version(self.key, self._record(), token):
                if cur is not None and cur.holder != self.holder:
                    log.warning("writer lease of checkpoint ID %s taken over from %s: %s", self.checkpoint_id,
                                cur.describe(time.time()), reason)
                log.debug("writer lease acquired checkpoint_id=%s holder=%s", self.checkpoint_id, self.holder)
                return
            # Another supervisor wrote it between our read and our write: look again.

    def _held(self, cur: LeaseRecord, why: str) -> WriterLeaseHeld:
        return WriterLeaseHeld(f"checkpoint ID {self.checkpoint_id} is being written by {cur.describe(time.time())}; {why}")

    # -- while holding ------------------------------------------------------------------------
    @property
    def fenced(self) -> str | None:
        """Why this supervisor lost the lease (it must not write again), or None while it holds it."""
        return self._fenced

    def _fence(self, cur: LeaseRecord) -> None:
        if self._fenced is None:
            self._fenced = (f"checkpoint ID {self.checkpoint_id} was taken over by {cur.describe(time.time())}; "
                            "this supervisor stops checkpointing it (the workload keeps running, unprotected)")
            log.warning("writer lease lost: %s", self._fenced)

    def confirm(self) -> None:
        """Right before a commit point: raise WriterFenced unless the lease is still ours."""
        if self._fenced is None:
            cur = _parse(self.store.get_versioned(self.key)[0])
            if cur is not None and cur.holder != self.holder:
                self._fence(cur)
        if self._fenced is not None:
            raise WriterFenced(self._fenced)

    def renew(self) -> None:
        """Push the expiry forward; finding another holder fences us instead."""
        failpoint("heartbeat.lease")
        for _ in range(3):
            if self._fenced is not None:
                return
            raw, token = self.store.get_versioned(self.key)
            cur = _parse(raw)
            if cur is not None and cur.holder != self.holder:
                self._fence(cur)
                return
            if self.store.put_if_version(self.key, self._record(), token):
                return

    def _renew_loop(self) -> None:
        failing = False
        while not self._halt.wait(self.ttl / 3):
            try:
                self.renew()
                failing = False
            except CedanaError as e:  # the store is down: heartbeats fail too; keep trying
                (log.debug if failing else log.warning)("writer lease not renewed checkpoint_id=%s: %s",
                                                        self.checkpoint_id, e)
                failing = True
            if self._fenced is not None:
                return

    @contextlib.contextmanager
    def held(self) -> Iterator[WriterLease]:
        """Acquire, renew in the background, and release on the way out (even on an error)."""
        self.acquire()
        self._thread = threading.Thread(target=self._renew_loop, name="cedana-writer-lease", daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self.release()

    def release(self) -> None:
        self._halt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._fenced is not None:
            return  # not ours any more: the new holder's
        try:
            cur = _parse(self.store.get_versioned(self.key)[0])
            if cur is not None and cur.holder == self.holder:
                self.store.delete(self.key)
        except CedanaError as e:  # it lapses by itself after one TTL
            log.warning("writer lease not released checkpoint_id=%s: %s", self.checkpoint_id, e)
