"""What a store holds, per checkpoint ID: the answer behind ``cedana-airflow checkpoints`` and the UI.

One ID is listed exactly, from its manifests (a handful of reads). A whole store is listed from the
listing index (index.py: 16 reads, however many IDs) plus one key listing of the IDs, so that an ID
the index does not know yet (a store written before the index, or a writer killed between its
manifest and its index update) is read from its manifests instead of being left out, and an ID
whose folder is gone is left out even if the index still names it. ``exact`` reads every manifest.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..format.manifest import AirflowTask
from ..ids import validate_checkpoint_id
from . import index
from .base import Store
from .index import HeartbeatRow, IndexEntry, IndexRow
from .transfer import load_manifests_of

__all__ = ["IdListing", "as_json", "list_store"]


@dataclass(frozen=True)
class IdListing:
    checkpoint_id: str
    checkpoints: tuple[IndexRow, ...]  # complete checkpoints, oldest first
    skipped_heartbeats: int = 0
    last_skip: str = ""
    source: str = "manifests"  # or "index"
    airflow: AirflowTask | None = None  # the task that wrote them, when an operator did
    restores: int = 0  # resumes recorded in the index
    recent_restores: tuple[datetime, ...] = ()  # when the latest of them happened (index.RECENT_RESTORES)
    restore_warning: str = ""  # why a restore would refuse these checkpoints (said at the first one)
    heartbeat: HeartbeatRow | None = None  # the interval its latest run chose, and from what (run/cadence.py)
    failed_heartbeats: int = 0  # heartbeats that failed, over every run of the ID
    last_failure: str = ""  # the latest one's line

    @property
    def worth_listing(self) -> bool:
        """Checkpoints, or heartbeats that were skipped or failed: an ID whose every heartbeat failed is listed too."""
        return bool(self.checkpoints or self.skipped_heartbeats or self.failed_heartbeats)

    @classmethod
    def of(cls, cid: str, e: IndexEntry, source: str, rows: tuple[IndexRow, ...] | None = None,
           airflow: AirflowTask | None = None) -> IdListing:
        """An ID as its index entry tells it; ``rows`` and ``airflow`` when read from its manifests instead."""
        return cls(cid, e.checkpoints if rows is None else rows, e.skipped_heartbeats, e.last_skip, source,
                   airflow or e.airflow, e.restores, e.recent_restores, e.restore_warning, e.heartbeat,
                   e.failed_heartbeats, e.last_failure)


def _from_manifests(store: Store, ids: list[str], entries: dict[str, IndexEntry]) -> list[IdListing]:
    by_id = load_manifests_of(store, ids)
    out = []
    for cid in ids:
        e = entries.get(cid, IndexEntry())
        rows = tuple(sorted((IndexRow.of(m) for m in by_id[cid]), key=lambda r: r.seq))
        owner = next((m.airflow for m in by_id[cid] if m.airflow is not None), None)
        out.append(IdListing.of(cid, e, "manifests", rows, owner))
    return out


def _rows_known(e: IndexEntry) -> bool:
    """Rows the index can answer for: each names its own DAG (issue 48); rows written before are read
    from the manifests until the ID's next checkpoint or gc rewrites them."""
    return bool(e.checkpoints) and all(r.dag_id is not None for r in e.checkpoints)


def list_store(store: Store, checkpoint_id: str | None = None, *, exact: bool = False,
               cache: index.ShardCache | None = None) -> list[IdListing]:
    """Every checkpoint ID with its complete checkpoints and skipped or failed heartbeats, sorted by ID.
    ``cache``: the shards parsed before, revalidated instead of read again (a long-lived reader)."""
    if checkpoint_id is not None:
        cid = validate_checkpoint_id(checkpoint_id)
        return [x for x in _from_manifests(store, [cid], {cid: index.read_entry(store, cid)}) if x.worth_listing]
    with ThreadPoolExecutor(1, thread_name_prefix="cedana-list") as pool:  # the two reads overlap
        ids = pool.submit(store.list_ids)
        entries = index.read_index(store, cache)
        present = set(ids.result())
    if exact:
        unknown = sorted(present)
        known: list[IdListing] = []
    else:
        unknown = sorted(c for c in present if not _rows_known(entries.get(c, IndexEntry())))
        known = [IdListing.of(c, e, "index") for c, e in entries.items() if c in present and _rows_known(e)]
    # IDs with skipped or failed heartbeats but no checkpoint have no folder: only the index knows them.
    index_only = [IdListing.of(c, e, "index", rows=()) for c, e in entries.items()
                  if c not in present and (e.skipped_heartbeats or e.failed_heartbeats)]
    listed = known + index_only + [x for x in _from_manifests(store, unknown, entries) if x.worth_listing]
    return sorted(listed, key=lambda x: x.checkpoint_id)


def as_json(x: IdListing) -> dict[str, Any]:
    """One ID as ``cedana-airflow checkpoints --json`` prints it, and the UI's JSON API serves it."""
    return {
        "id": x.checkpoint_id, "skipped_heartbeats": x.skipped_heartbeats, "last_skip": x.last_skip, "source": x.source,
        "airflow": x.airflow.model_dump() if x.airflow else None, "restores": x.restores,
        "restore_warning": x.restore_warning,
        # 0.7.0: the heartbeat's interval, what one checkpoint cost, and the work a failure is expected to lose
        "heartbeat": x.heartbeat.model_dump() if x.heartbeat else None,
        # issue 47: heartbeats that failed over every run of the ID, and the latest one's line
        "failed_heartbeats": x.failed_heartbeats, "last_failure": x.last_failure,
        "checkpoints": [{"seq": r.seq, "try_number": r.try_number, "node": r.node, "created_at": r.created_at.isoformat(),
                         "image_bytes": r.image_bytes, "stored_bytes": r.stored_bytes,
                         "freeze_seconds": round(r.freeze_seconds, 3), "engine": r.engine} for r in x.checkpoints],
    }
