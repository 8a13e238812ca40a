"""A drill's report, and where reports live: ``drills/<drill_id>.json`` in the store, create-only.

The JSON is a contract (``cedana-airflow drill --json``, ``drills --json``, docs/store-format.md):
fields are only ever added. Reports are history: no restore reads them.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..config import Settings
from ..errors import CedanaError, ConfigError
from ..format.layout import DRILLS, drill_report_key
from ..run.runner import ensure_work_dir
from ..store.base import Store
from ..store.records import read_records

__all__ = ["CheckedId", "DrillReport", "LiveTarget", "list_reports", "new_drill_id", "save_report", "scratch_dir"]

log = logging.getLogger(__name__)

class CheckedId(BaseModel):
    """One checkpoint ID a ``verify`` drill read: its latest usable checkpoint, or why none was."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    checkpoint_id: str
    ok: bool
    seq: int | None = None
    node: str = ""
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    problem: str = ""
    note: str = ""  # what was left undone and why (a recorded verify command not run: unverified)


class LiveTarget(BaseModel):
    """One running task a ``live`` drill looked at: chosen (and, unless a dry run, failed and followed)
    or passed over, with the reason either way."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1
    try_number: int
    pool: str = ""
    checkpoint_id: str | None = None
    chosen: bool
    reason: str
    # filled once the chosen task was failed and its retry followed
    ok: bool | None = None
    problem: str = ""
    retry_try_number: int | None = None
    retry_host: str = ""  # the worker Airflow ran the retry on
    retry_state: str = ""  # the retry's Airflow state when the drill stopped following it
    restored_seq: int | None = None
    from_node: str = ""
    to_node: str = ""
    detect_seconds: float | None = None
    retry_seconds: float | None = None
    restore_seconds: float | None = None
    restore_done_seconds: float | None = None  # failure -> the restore done
    rto_seconds: float | None = None
    lost_work_seconds: float | None = None
    bytes_fetched: int = 0


class DrillReport(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    drill_id: str
    mode: Literal["verify", "canary", "live"]
    ok: bool
    problems: tuple[str, ...] = ()
    node: str  # where the drill ran
    started_at: datetime
    finished_at: datetime
    # what was restored (canary, live) or the first ID read (verify)
    checkpoint_id: str | None = None
    restored_seq: int | None = None
    from_node: str = ""
    to_node: str = ""
    rto_seconds: float | None = None
    lost_work_seconds: float | None = None
    restore_seconds: float | None = None
    fetch_seconds: float | None = None
    bytes_fetched: int = 0
    digest_match: bool | None = None
    checked: tuple[CheckedId, ...] = ()  # verify: every ID read
    # live: the RTO's first parts (failure -> Airflow saw it; failure -> the retry ran), what was
    # looked at, and whether the drill acted at all
    detect_seconds: float | None = None
    retry_seconds: float | None = None
    targets: tuple[LiveTarget, ...] = ()
    dry_run: bool = False
    stopped: str = ""  # why a drill did nothing (kill switch, outside its windows, nothing eligible)

    def counts(self) -> bool:
        """Whether the report proves something about restore (trends skip dry runs and drills that stopped)."""
        return not self.dry_run and not self.stopped


def new_drill_id(mode: str, at: datetime | None = None) -> str:
    at = at or datetime.now(timezone.utc)
    return f"{at.strftime('%Y%m%dT%H%M%SZ')}-{mode}-{uuid.uuid4().hex[:6]}"


def save_report(store: Store, report: DrillReport) -> bool:
    """Keep the report in the store; a store that refuses it is logged (the drill's result stands)."""
    try:
        return store.put_if_absent(drill_report_key(report.drill_id), report.model_dump_json(indent=1).encode())
    except CedanaError as e:
        log.warning("drill report %s not stored: %s", report.drill_id, e)
        return False


def list_reports(store: Store) -> list[DrillReport]:
    """Every readable report, oldest first; a damaged one is skipped with a warning."""
    return sorted(read_records(store, DRILLS, DrillReport), key=lambda r: r.started_at)


def scratch_dir(settings: Settings, prefix: str) -> Path:
    """A private temp dir for a drill's images, in the work dir when one is set (it holds process memory)."""
    where = ensure_work_dir(settings)
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=where))  # mode 0700
    except OSError as e:
        raise ConfigError(f"work dir {where or tempfile.gettempdir()} cannot be used: {e.strerror}. Point --work-dir / "
                          "CEDANA_WORK_DIR at a writable local directory.") from None
