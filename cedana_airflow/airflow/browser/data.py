"""What the checkpoint browser shows, filtered by what a user may read: no FastAPI, no HTML here.

Each item under a checkpoint ID belongs to the DAG its own ``airflow`` block names: a manifest, a
restore record, a row of the listing index (which carries its manifest's DAG). An ID is no one
DAG's: an author may set any ID, so a manifest of DAG A under DAG B's ID must not show A's users
B's checkpoints (issue 48). A user sees the items of DAGs the auth manager lets them read, and an
item no DAG owns (taken by the CLI) only when they may read every DAG. The store is the
api-server's: the ``[cedana]`` store, through ``aws_conn_id`` for S3, exactly as a task reaches it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import cache

from ...format.manifest import Manifest
from ...store.base import Store
from ...store.index import IndexRow, ShardCache
from ...store.listing import IdListing, list_store
from ...store.restores import RestoreRecord, list_restores
from ...store.transfer import load_manifests

__all__ = ["AirflowTry", "Fleet", "IdDetail", "MayRead", "StoreCache", "TryRow", "dag_of", "fleet", "id_detail",
           "scoped", "tries", "visible"]

#: Whether the user may read (or edit) a DAG's checkpoints; ``None``: an item no DAG owns (needs every DAG).
MayRead = Callable[[str | None], bool]


@dataclass(frozen=True)
class Fleet:
    ids: tuple[IdListing, ...]
    stored_bytes: int
    checkpoints_last_hour: int
    restores: int
    restores_last_day: int


@dataclass(frozen=True)
class IdDetail:
    listing: IdListing  # the part the user may read (scoped)
    manifests: tuple[Manifest, ...]  # oldest first; those of DAGs the user may read
    restores: tuple[RestoreRecord, ...]  # oldest first; likewise
    partial: bool = False  # items of DAGs the user may not read were left out
    dags: frozenset[str | None] = frozenset()  # every DAG named under the ID, left-out items' too (delete needs each)
    seqs: frozenset[int] = frozenset()  # every checkpoint read now, shown or not: what a delete judged, and takes


def dag_of(x: Manifest | RestoreRecord | IdListing) -> str | None:
    """The DAG an item names itself: a manifest, a restore record, an ID's index entry."""
    return x.airflow.dag_id if x.airflow else None


def _row_dag(r: IndexRow) -> str | None:
    return r.dag_id or None  # "" (taken outside Airflow) and None (not recorded) need every DAG


def _dags(x: IdListing) -> set[str | None]:
    """Every DAG an ID's rows and its index entry name."""
    return {_row_dag(r) for r in x.checkpoints} | {dag_of(x)}


def scoped(x: IdListing, may_read: MayRead) -> IdListing | None:
    """The part of an ID a user may read, or None when no part: each row by its own DAG. What the
    entry holds for the whole ID (skips, failures, restores, the heartbeat, the restore warning) has
    no DAG of its own, so it stays only for a user who may read every DAG the ID names."""
    if all(may_read(d) for d in _dags(x)):
        return x
    rows = tuple(r for r in x.checkpoints if may_read(_row_dag(r)))
    if not rows:
        return None
    return IdListing(x.checkpoint_id, rows, source=x.source, airflow=x.airflow if may_read(dag_of(x)) else None)


def visible(listed: Sequence[IdListing], may_read: MayRead) -> list[IdListing]:
    may_read = cache(may_read)  # one question per DAG, however many IDs and rows name it
    return [s for x in listed if (s := scoped(x, may_read)) is not None]


class StoreCache:
    """The store's listing for a long-lived api-server: kept for ``ttl`` seconds (the calls of one
    page load), then revalidated: the index shards it parsed are asked whether they changed
    (If-None-Match; a 304 has no body) and only changed ones are read and parsed again, so a reload
    is fresh and costs 17 small requests, not a re-read of every shard. Thread-safe; a failed
    listing is not cached."""

    def __init__(self, ttl: float = 1.0) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._at = 0.0
        self._listed: list[IdListing] = []
        self._url = ""
        self._shards = ShardCache()

    def listing(self, store: Store) -> list[IdListing]:
        with self._lock:
            if store.url == self._url and time.monotonic() - self._at < self.ttl:
                return self._listed
            if store.url != self._url:
                self._shards = ShardCache()
            shards = self._shards
        listed = list_store(store, cache=shards)
        with self._lock:
            self._listed, self._at, self._url = listed, time.monotonic(), store.url
        return listed

    def clear(self) -> None:
        with self._lock:
            self._at = 0.0


def fleet(listed: Sequence[IdListing], may_read: MayRead, now: datetime | None = None) -> Fleet:
    ids = visible(listed, may_read)
    now = now or datetime.now(timezone.utc)
    hour_ago, day_ago = now - timedelta(hours=1), now - timedelta(days=1)
    return Fleet(
        ids=tuple(ids),
        stored_bytes=sum(r.stored_bytes for x in ids for r in x.checkpoints),
        checkpoints_last_hour=sum(1 for x in ids for r in x.checkpoints if r.created_at >= hour_ago),
        restores=sum(x.restores for x in ids),
        restores_last_day=sum(1 for x in ids for t in x.recent_restores if t >= day_ago),
    )


def id_detail(store: Store, listing: IdListing, may_read: MayRead) -> IdDetail:
    """One ID (``listing`` as the store lists it, not scoped), each manifest and restore record shown
    by its own DAG; read now, so a manifest newer than the listing is judged by itself too."""
    may_read = cache(may_read)
    seqs = frozenset(store.list_seqs(listing.checkpoint_id))  # before the reads: a later one is not judged
    ms = sorted(load_manifests(store, listing.checkpoint_id), key=lambda m: (m.try_number, m.seq))
    rs = list_restores(store, listing.checkpoint_id)
    shown_ms = tuple(m for m in ms if may_read(dag_of(m)))
    shown_rs = tuple(r for r in rs if may_read(dag_of(r)))
    x = scoped(listing, may_read) or IdListing(listing.checkpoint_id, ())
    partial = x is not listing or len(shown_ms) < len(ms) or len(shown_rs) < len(rs)
    if partial:  # the ID's own lines go (see scoped); its task is the newest shown manifest's
        x = IdListing(x.checkpoint_id, x.checkpoints, source=x.source, restores=len(shown_rs),
                      airflow=next((m.airflow for m in reversed(shown_ms) if m.airflow), x.airflow))
    dags = _dags(listing) | {dag_of(m) for m in ms} | {dag_of(r) for r in rs}
    return IdDetail(x, shown_ms, shown_rs, partial, frozenset(dags), seqs)


@dataclass(frozen=True)
class AirflowTry:
    """What Airflow knows of one try of a task instance (its history table): no Airflow import here."""

    try_number: int
    state: str | None = None
    start: datetime | None = None
    end: datetime | None = None


@dataclass(frozen=True)
class TryRow:
    """One try as the task-instance tab shows it: how it started, what it took, what work it lost."""

    try_number: int
    airflow: AirflowTry | None
    restore: RestoreRecord | None  # the resume it started with (restored or fresh), when one was recorded
    fresh_reason: str  # why it started fresh; "" when it restored
    checkpoints: tuple[Manifest, ...]  # the checkpoints it took, oldest first
    lost_seconds: float | None  # work after its newest checkpoint, redone by the next try (None: see lost)
    lost: str = "known"  # "known" (lost_seconds), "bound" (≤ lost_seconds: the next try's restore gap,
    #                      work lost plus time down), "none" (it succeeded, or still runs), "unknown"


#: The states of a try that ended without finishing its work (Airflow's TaskInstanceState values).
_ENDED_BADLY = ("failed", "up_for_retry", "upstream_failed", "restarting")


def _lost(a: AirflowTry | None, start: datetime | None, cps: Sequence[Manifest],
          next_restore: RestoreRecord | None, last: bool) -> tuple[float | None, str]:
    """Work a try did after its newest checkpoint (or since it started, with none): what the next try
    could not resume. A try that ended well, or the last one while it runs, lost nothing; without
    Airflow's word on how a try ended, the next try's restore gap bounds it, or it is not known."""
    if a is not None and (a.state == "success" or last and a.state not in _ENDED_BADLY):
        return None, "none"
    since = cps[-1].created_at if cps else start
    if a is not None and a.end is not None and since is not None:
        return max(0.0, (a.end - since).total_seconds()), "known"
    if next_restore is not None and next_restore.outcome == "restored" and cps and next_restore.seq == cps[-1].seq:
        return next_restore.gap_seconds, "bound"
    return None, "unknown"


def tries(d: IdDetail, airflow_tries: Sequence[AirflowTry] = ()) -> list[TryRow]:
    """Every try the store or Airflow knows of, oldest first. A try with no resume record started fresh:
    the first because there was nothing to resume yet; a later one did not get as far as a resume (it
    did not ask for one, or failed before it: its log says which)."""
    by_airflow = {a.try_number: a for a in airflow_tries}
    numbers = sorted({m.try_number for m in d.manifests} | {r.try_number for r in d.restores} | set(by_airflow))
    rows = []
    for i, n in enumerate(numbers):
        cps = tuple(m for m in d.manifests if m.try_number == n)
        rec = next((r for r in reversed(d.restores) if r.try_number == n), None)
        nxt = next((r for r in d.restores if r.try_number == numbers[i + 1]), None) if i + 1 < len(numbers) else None
        a = by_airflow.get(n)
        if rec is not None and rec.outcome == "restored":
            why = ""
        elif rec is not None:
            why = rec.reason or "every checkpoint was refused"
        else:
            why = "the first try: nothing to resume yet" if n <= 1 else "no resume recorded for this try"
        start = rec.at if rec is not None else (a.start if a else None)
        seconds, lost = _lost(a, start, cps, nxt, last=i + 1 == len(numbers))
        rows.append(TryRow(n, a, rec, why, cps, seconds, lost))
    return rows
