"""Restore history: one small record per resume, so the CLI and the UI can say what each try restored.

A record is written create-only after each resume attempt, under its checkpoint ID::

    <checkpoint id>/restores/<UTC time>-<try>-<random>.json
    {"checkpoint_id": ..., "outcome": "restored", "seq": 7, "try_number": 2, "from_node": "gpu-3",
     "node": "gpu-9", "at": "...", "gap_seconds": 41.0, "restore_seconds": 3.2, "refused": [...]}

``outcome`` is ``restored`` or ``fresh`` (with ``reason``: nothing to resume, every checkpoint
refused). Readers of checkpoints never look here: a record is history, not state. Best effort, like
the listing index: a record that cannot be written is logged and never fails the run.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import CedanaError
from ..format.layout import restore_record_key, restores_prefix
from ..format.manifest import AirflowTask
from .base import Store
from .records import read_records

__all__ = ["RestoreRecord", "delete_restores", "list_restores", "record_restore"]

log = logging.getLogger(__name__)


class RestoreRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    checkpoint_id: str
    outcome: Literal["restored", "fresh"]
    reason: str = ""  # fresh: why nothing was restored
    seq: int | None = None
    try_number: int = Field(ge=0, default=0)  # the try that resumed
    from_node: str = ""  # where the restored checkpoint was taken
    node: str = ""  # where it was restored
    at: datetime
    gap_seconds: float = 0.0
    restore_seconds: float = 0.0
    refused: tuple[str, ...] = ()  # newer checkpoints refused on the way, newest first
    airflow: AirflowTask | None = None


def record_restore(store: Store, rec: RestoreRecord) -> None:
    key = restore_record_key(rec.checkpoint_id, rec.at, rec.try_number, uuid.uuid4().hex[:8])
    try:
        store.put_if_absent(key, rec.model_dump_json().encode())
    except CedanaError as e:
        log.warning("restore history not written checkpoint_id=%s: %s", rec.checkpoint_id, e)


def list_restores(store: Store, checkpoint_id: str) -> list[RestoreRecord]:
    """Every readable record of an ID, oldest first."""
    return sorted(read_records(store, restores_prefix(checkpoint_id), RestoreRecord), key=lambda r: r.at)


def delete_restores(store: Store, checkpoint_id: str) -> int:
    keys = [o.key for o in store.list_objects(restores_prefix(checkpoint_id))]
    for k in keys:
        store.delete(k)
    return len(keys)
