"""What a live drill reads of the store, from wherever it may read it: the store itself with this node's
key (a drill running as root), or the node agent (a drill whose task is not root: it holds neither the
store nor the key, and the agent answers for it, agent/views.py).

Both answer the same four questions: each task instance's newest checkpoint, whether this node would
restore it for that task, who holds an ID's writer lease, and what the retry's restore record says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from ..format.layout import lease_key
from ..format.manifest import AirflowTask
from ..format.trust import Trust, owner_text
from ..store.base import Store
from ..store.listing import list_store
from ..store.restores import RestoreRecord, list_restores
from ..store.transfer import load_manifests
from ..store.writer_lease import LeaseRecord

__all__ = ["AgentFacts", "Facts", "Latest", "LeaseNow", "StoreFacts", "TaskKey"]

TaskKey = tuple[str, str, str, int]  # dag_id, task_id, run_id, map_index


@dataclass(frozen=True)
class Latest:
    checkpoint_id: str
    seq: int
    created_at: datetime


@dataclass(frozen=True)
class LeaseNow:
    """An ID's writer lease as a drill judges it: whose try holds it, and whether it is still renewed."""

    try_number: int
    renewed_at: float
    ttl_seconds: float


#: A lease that is there and does not parse: it protects nobody (a retry replaces it).
UNREADABLE = LeaseNow(-1, 0.0, 0.0)


@dataclass(frozen=True)
class Restored:
    """A checkpoint's size and time, for the work a retry lost."""

    image_bytes: int
    created_at: datetime


class Facts(Protocol):
    def latest_by_task(self) -> dict[TaskKey, Latest]:
        """The newest complete checkpoint of each task instance checkpoints name."""

    def refusal(self, latest: Latest, owner: AirflowTask) -> str:
        """Why this node would not restore ``latest`` for ``owner`` ("" where it would)."""

    def lease(self, checkpoint_id: str) -> LeaseNow | None:
        """The ID's writer lease (:data:`UNREADABLE` where it does not parse), None where there is none."""

    def restores(self, checkpoint_id: str) -> list[RestoreRecord]:
        """The ID's restore records, oldest first."""

    def checkpoint(self, checkpoint_id: str, seq: int) -> Restored | None:
        """One checkpoint's facts, None where it is gone."""


class StoreFacts:
    """The store itself, judged with this node's key (``trust``; None: not judged)."""

    def __init__(self, store: Store, trust: Trust | None) -> None:
        self.store, self.trust = store, trust

    def latest_by_task(self) -> dict[TaskKey, Latest]:
        out: dict[TaskKey, Latest] = {}
        for x in list_store(self.store):
            if x.airflow is None or not x.checkpoints:
                continue
            a, row = x.airflow, x.checkpoints[-1]
            key = (a.dag_id, a.task_id, a.run_id, a.map_index)
            if key not in out or out[key].created_at < row.created_at:
                out[key] = Latest(x.checkpoint_id, row.seq, row.created_at)
        return out

    def refusal(self, latest: Latest, owner: AirflowTask) -> str:
        if self.trust is None:
            return ""
        judge = dataclasses.replace(self.trust, owner=owner)
        m = next((m for m in load_manifests(self.store, latest.checkpoint_id) if m.seq == latest.seq), None)
        return "it is gone" if m is None else judge.refusal(m) or ""

    def lease(self, checkpoint_id: str) -> LeaseNow | None:
        raw = self.store.get(lease_key(checkpoint_id))
        if raw is None:
            return None
        try:
            rec = LeaseRecord.model_validate_json(raw)
        except ValueError:
            return UNREADABLE
        return LeaseNow(rec.try_number, rec.renewed_at, rec.ttl_seconds)

    def restores(self, checkpoint_id: str) -> list[RestoreRecord]:
        return list_restores(self.store, checkpoint_id)

    def checkpoint(self, checkpoint_id: str, seq: int) -> Restored | None:
        m = next((m for m in load_manifests(self.store, checkpoint_id) if m.seq == seq), None)
        return Restored(m.image_bytes, m.created_at) if m is not None else None


class _Agent(Protocol):
    def checkpoints(self, ids: list[str] | None = None, *, detail: bool = False) -> list[dict[str, Any]]: ...


class AgentFacts:
    """The node agent's answers (its ``checkpoints`` query): only checkpoints its key vouches for, and,
    for a caller outside ``agent_readers`` and ``agent_drillers``, only its own uid's. A drill's user is
    meant to be a driller."""

    def __init__(self, agent: _Agent) -> None:
        self.agent = agent
        self._rows: dict[str, Mapping[str, Any]] = {}

    def latest_by_task(self) -> dict[TaskKey, Latest]:
        out: dict[TaskKey, Latest] = {}
        for row in self.agent.checkpoints():
            a = row.get("airflow")
            if not a:
                continue
            self._rows[row["id"]] = row
            key = (a["dag_id"], a["task_id"], a["run_id"], int(a["map_index"]))
            latest = Latest(row["id"], int(row["seq"]), datetime.fromisoformat(row["created_at"]))
            if key not in out or out[key].created_at < latest.created_at:
                out[key] = latest
        return out

    def refusal(self, latest: Latest, owner: AirflowTask) -> str:
        a = (self._rows.get(latest.checkpoint_id) or {}).get("airflow") or {}
        if (a.get("dag_id"), a.get("task_id"), a.get("map_index")) != (owner.dag_id, owner.task_id, owner.map_index):
            return f"it belongs to another task, not to {owner_text(owner)}"
        return ""  # the agent lists only what its key vouches for

    def _detail(self, checkpoint_id: str) -> Mapping[str, Any]:
        rows = self.agent.checkpoints([checkpoint_id], detail=True)
        return rows[0] if rows else {}

    def lease(self, checkpoint_id: str) -> LeaseNow | None:
        raw = self._detail(checkpoint_id).get("lease")
        if raw is None:
            return None
        if raw.get("unreadable"):
            return UNREADABLE
        return LeaseNow(int(raw["try_number"]), float(raw["renewed_at"]), float(raw["ttl_seconds"]))

    def restores(self, checkpoint_id: str) -> list[RestoreRecord]:
        return [RestoreRecord.model_validate({**r, "checkpoint_id": checkpoint_id})
                for r in self._detail(checkpoint_id).get("restores") or ()]

    def checkpoint(self, checkpoint_id: str, seq: int) -> Restored | None:
        got = next((c for c in self._detail(checkpoint_id).get("seqs") or () if c["seq"] == seq), None)
        return Restored(int(got["image_bytes"]), datetime.fromisoformat(got["created_at"])) if got else None
