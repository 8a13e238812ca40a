"""The listing index: what ``checkpoints`` shows, answered in a few reads instead of one per manifest.

Manifests stay the only truth: restore, retention and gc never read the index. It is a cache for
listing, kept in 16 shard documents (``index/<hex digit>.json``, by the SHA-256 of the checkpoint
ID) that writers update by compare-and-swap (``If-Match`` on S3, a lock on a file store), so two
writers never lose each other's rows. A writer killed between its manifest and its index update
leaves the index one row short; :func:`rebuild_index` (run by gc) repairs it from the manifests.
It also holds what no manifest can: heartbeats skipped as too large (run/estimate.py).
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import CedanaError
from ..format.layout import INDEX_SHARDS, index_shard_key, index_shard_keys
from ..format.manifest import AirflowTask, Manifest
from .base import Store

__all__ = ["HeartbeatRow", "IndexEntry", "IndexRow", "SHARDS", "count_restore", "forget", "read_index", "read_entry", "rebuild_index",
           "record_checkpoint", "record_heartbeat", "record_skip", "shard_key"]

log = logging.getLogger(__name__)

SHARDS = INDEX_SHARDS
_ATTEMPTS = 12


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class IndexRow(_Model):
    """One complete checkpoint, as a listing shows it (a summary of its manifest)."""

    seq: int
    try_number: int = 0
    node: str = ""
    created_at: datetime
    image_bytes: int = 0
    stored_bytes: int = 0
    freeze_seconds: float = 0.0
    engine: str = "criu"  # or "cooperative" (0.6.0; rows written before it are all CRIU's)
    # Its own manifest's DAG, so that a reader authorizes each row, not an ID by its newest manifest (issue 48);
    # "": taken outside Airflow; None: a row written before, which listings read from the manifests instead.
    dag_id: str | None = None

    @classmethod
    def of(cls, m: Manifest) -> IndexRow:
        return cls(seq=m.seq, try_number=m.try_number, node=m.node, created_at=m.created_at,
                   image_bytes=m.image_bytes, stored_bytes=m.stored_bytes, freeze_seconds=m.freeze_seconds,
                   engine=m.engine, dag_id=m.airflow.dag_id if m.airflow else "")


class HeartbeatRow(_Model):
    """The heartbeat an ID's latest run chose (run/cadence.py), and what from (0.7.0)."""

    interval_seconds: float
    auto: bool = False
    cost_seconds: float = 0.0  # what one checkpoint cost the workload (median of the latest)
    commit_seconds: float = 0.0  # from a checkpoint's start to its commit
    mtbf_seconds: float | None = None  # None: no failure seen and no prior
    expected_loss_seconds: float = 0.0  # work a failure loses, on average
    reason: str = ""  # the task log's line
    in_force: str = ""  # the setting it came from, e.g. "every 10m (from the default of heartbeat_seconds)" (0.11.0)


class IndexEntry(_Model):
    checkpoints: tuple[IndexRow, ...] = ()
    skipped_heartbeats: int = Field(default=0, ge=0)
    last_skip: str = ""  # the estimate and the threshold of the latest skip
    failed_heartbeats: int = Field(default=0, ge=0)  # heartbeats that failed, every run of the ID (issue 47)
    last_failure: str = ""  # the latest one's line
    restore_warning: str = ""  # why a restore would refuse the ID's checkpoints, said at its first (unsigned) one
    airflow: AirflowTask | None = None  # the task whose checkpoints these are (newest manifest's block)
    restores: int = Field(default=0, ge=0)  # resumes recorded (store/restores.py holds each one)
    recent_restores: tuple[datetime, ...] = ()  # when the last RECENT_RESTORES of them happened
    heartbeat: HeartbeatRow | None = None  # the interval chosen and its figures (0.7.0)

    def empty(self) -> bool:
        return not self.checkpoints and not self.skipped_heartbeats and not self.restores and not self.failed_heartbeats


class _Shard(_Model):
    format_version: int = 1
    ids: dict[str, IndexEntry] = {}
    #: Random per write (0.11.0; readers ignore it): two writers making the same change from the same shard
    #: never write equal bytes, so the S3 store's read-back after a retried PUT tells its own write from a
    #: rival's (store/s3.py, _put), and no counter increment is lost.
    nonce: str = ""


shard_key = index_shard_key  # the name this module's callers know


def _parse(raw: bytes | None, key: str) -> _Shard:
    if raw is None:
        return _Shard()
    try:
        return _Shard.model_validate_json(raw)
    except (ValidationError, ValueError) as e:
        # A cache: a damaged shard is rewritten, never trusted, and never stops a checkpoint.
        log.warning("listing index %s unreadable (%s); it will be rewritten", key, str(e).splitlines()[0])
        return _Shard()


_conflicts = [0]  # this process's lost compare-and-swaps (a run's summary reports them)
_conflicts_lock = threading.Lock()


def conflicts_retried() -> int:
    """Index updates this process had to retry because another writer changed the shard first."""
    return _conflicts[0]


def _update(store: Store, key: str, change: Callable[[dict[str, IndexEntry]], None]) -> bool:
    """Apply ``change`` to a shard's entries and write it back, retrying when another writer won."""
    for attempt in range(_ATTEMPTS):
        raw, token = store.get_versioned(key)
        ids = dict(_parse(raw, key).ids)
        change(ids)
        data = _Shard(ids={k: v for k, v in sorted(ids.items()) if not v.empty()},
                      nonce=secrets.token_hex(8)).model_dump_json().encode()
        if store.put_if_version(key, data, token):
            return True
        with _conflicts_lock:
            _conflicts[0] += 1
        time.sleep(random.uniform(0, 0.02 * 2 ** min(attempt, 5)))  # contention: back off, jittered
    log.warning("listing index %s: gave up after %d contended updates; gc rebuilds it", key, _ATTEMPTS)
    return False


def _update_entry(store: Store, checkpoint_id: str, change: Callable[[IndexEntry], IndexEntry],
                  quiet: bool = False) -> bool:
    """Best effort: a failed index update is logged (``quiet``: at DEBUG) and never fails the checkpoint
    that caused it."""
    def apply(ids: dict[str, IndexEntry]) -> None:
        ids[checkpoint_id] = change(ids.get(checkpoint_id, IndexEntry()))

    try:
        return _update(store, shard_key(checkpoint_id), apply)
    except CedanaError as e:
        (log.debug if quiet else log.warning)("listing index not updated checkpoint_id=%s: %s", checkpoint_id, e)
        return False


def record_checkpoint(store: Store, manifest: Manifest, kept: Sequence[Manifest] | None = None) -> bool:
    """Add a just-committed checkpoint; with ``kept`` (what retention left), the ID's rows become exactly those."""
    rows = {r.seq: r for r in ((IndexRow.of(m) for m in kept) if kept is not None else ())}
    rows[manifest.seq] = IndexRow.of(manifest)

    def change(e: IndexEntry) -> IndexEntry:
        merged = rows if kept is not None else {**{r.seq: r for r in e.checkpoints}, **rows}
        return e.model_copy(update={"checkpoints": tuple(merged[s] for s in sorted(merged)),
                                    "airflow": manifest.airflow or e.airflow})

    return _update_entry(store, manifest.checkpoint_id, change)


#: Restore times kept per ID in the index (what "restores in the last day" counts from).
RECENT_RESTORES = 20


def count_restore(store: Store, checkpoint_id: str, at: datetime) -> bool:
    return _update_entry(store, checkpoint_id, lambda e: e.model_copy(update={
        "restores": e.restores + 1, "recent_restores": (*e.recent_restores, at)[-RECENT_RESTORES:]}))


def record_skip(store: Store, checkpoint_id: str, why: str) -> bool:
    return _update_entry(store, checkpoint_id, lambda e: e.model_copy(update={
        "skipped_heartbeats": e.skipped_heartbeats + 1, "last_skip": why}))


def record_failure(store: Store, checkpoint_id: str, why: str) -> bool:
    """A failed heartbeat, counted; quiet, since the store may be what failed it (said once already)."""
    return _update_entry(store, checkpoint_id, lambda e: e.model_copy(update={
        "failed_heartbeats": e.failed_heartbeats + 1, "last_failure": why}), quiet=True)


def record_heartbeat(store: Store, checkpoint_id: str, heartbeat: HeartbeatRow) -> bool:
    return _update_entry(store, checkpoint_id, lambda e: e.model_copy(update={"heartbeat": heartbeat}))


def record_restore_warning(store: Store, checkpoint_id: str, why: str) -> bool:
    return _update_entry(store, checkpoint_id, lambda e: e.model_copy(update={"restore_warning": why}))


def forget(store: Store, checkpoint_id: str) -> bool:
    """Drop an ID's rows (its checkpoints were deleted); its skip count goes with them."""
    return _update_entry(store, checkpoint_id, lambda e: IndexEntry())


def read_entry(store: Store, checkpoint_id: str) -> IndexEntry:
    key = shard_key(checkpoint_id)
    return _parse(store.get(key), key).ids.get(checkpoint_id, IndexEntry())


class ShardCache:
    """The shards a long-lived reader (the UI's api-server) parsed, with their version tokens: the
    next read asks the store whether each changed (S3: If-None-Match, a 304 without a body) and
    parses only those that did. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shards: dict[str, tuple[str, _Shard]] = {}

    def read(self, store: Store, key: str) -> tuple[str, _Shard]:
        with self._lock:
            token, shard = self._shards.get(key, ("", _Shard()))
        got = store.get_if_changed(key, token) if token else store.get_versioned(key)
        if got is not None:
            raw, token = got
            shard = _parse(raw, key)
            with self._lock:
                self._shards[key] = (token, shard)
        return token, shard


def read_index(store: Store, cache: ShardCache | None = None) -> dict[str, IndexEntry]:
    """Every entry of every shard: 16 reads, in parallel (with ``cache``, 16 conditional ones)."""
    return read_index_versioned(store, cache)[0]


def read_index_versioned(store: Store, cache: ShardCache | None = None) -> tuple[dict[str, IndexEntry], tuple[str, ...]]:
    """:func:`read_index`, and each shard's version token (with ``cache``; else "" for each)."""
    keys = index_shard_keys()
    with ThreadPoolExecutor(min(SHARDS, store.parallelism), thread_name_prefix="cedana-index") as pool:
        if cache is None:
            got = list(pool.map(lambda k: ("", _parse(store.get(k), k)), keys))
        else:
            got = list(pool.map(lambda k: cache.read(store, k), keys))
    return {cid: e for _, s in got for cid, e in s.ids.items()}, tuple(t for t, _ in got)


def rebuild_index(store: Store, manifests: Mapping[str, Sequence[Manifest]]) -> None:
    """Make every shard agree with the manifests (the truth), keeping the skip counts."""
    by_shard: dict[str, dict[str, tuple[IndexRow, ...]]] = {k: {} for k in index_shard_keys()}
    owners = {cid: next((m.airflow for m in ms if m.airflow is not None), None) for cid, ms in manifests.items()}
    for cid, ms in manifests.items():
        by_shard[shard_key(cid)][cid] = tuple(sorted((IndexRow.of(m) for m in ms), key=lambda r: r.seq))

    def fix(key: str) -> None:
        rows = by_shard[key]

        def apply(ids: dict[str, IndexEntry]) -> None:
            for cid in set(ids) | set(rows):
                e = ids.get(cid, IndexEntry())
                ids[cid] = e.model_copy(update={"checkpoints": rows.get(cid, ()), "airflow": owners.get(cid) or e.airflow})

        _update(store, key, apply)

    with ThreadPoolExecutor(min(SHARDS, store.parallelism), thread_name_prefix="cedana-index") as pool:
        list(pool.map(fix, by_shard))
