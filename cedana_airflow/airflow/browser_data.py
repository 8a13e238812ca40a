"""What the checkpoint browser shows, filtered by what a user may read: no FastAPI, no HTML here.

A checkpoint ID belongs to the DAG its manifests name (their ``airflow`` block, carried by the
listing index). A user sees an ID when the auth manager lets them read its DAG; an ID no DAG owns
(taken by the CLI) only when they may read every DAG. The store is the api-server's: the ``[cedana]``
store, through ``aws_conn_id`` for S3, exactly as a task reaches it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from ..format.manifest import Manifest
from ..store.base import Store
from ..store.listing import IdListing, list_store
from ..store.restores import RestoreRecord, list_restores
from ..store.transfer import load_manifests

__all__ = ["Fleet", "IdDetail", "MayRead", "StoreCache", "fleet", "id_detail", "visible"]

#: Whether the user may read a DAG's checkpoints; ``None``: an ID no DAG owns (needs every DAG).
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
    listing: IdListing
    manifests: tuple[Manifest, ...]  # oldest first
    restores: tuple[RestoreRecord, ...]  # oldest first


def dag_of(x: IdListing) -> str | None:
    return x.airflow.dag_id if x.airflow else None


def visible(listed: Sequence[IdListing], may_read: MayRead) -> list[IdListing]:
    answers: dict[str | None, bool] = {}  # one question per DAG, however many IDs it has
    out = []
    for x in listed:
        dag = dag_of(x)
        if dag not in answers:
            answers[dag] = may_read(dag)
        if answers[dag]:
            out.append(x)
    return out


class StoreCache:
    """The store's listing, kept for ``ttl`` seconds: the api-server is long-lived and a page reload
    must not cost 17 S3 requests. Thread-safe; a failed listing is not cached."""

    def __init__(self, ttl: float = 5.0) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._at = 0.0
        self._listed: list[IdListing] = []
        self._url = ""

    def listing(self, store: Store) -> list[IdListing]:
        with self._lock:
            if store.url == self._url and time.monotonic() - self._at < self.ttl:
                return self._listed
        listed = list_store(store)
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


def id_detail(store: Store, listing: IdListing) -> IdDetail:
    ms = sorted(load_manifests(store, listing.checkpoint_id), key=lambda m: (m.try_number, m.seq))
    return IdDetail(listing, tuple(ms), tuple(list_restores(store, listing.checkpoint_id)))
