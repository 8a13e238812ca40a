"""CheckpointSensor (poke, reschedule, or deferrable through CheckpointTrigger): wait until a checkpoint
ID has a complete checkpoint newer than a given age. A sensor (or trigger) whose process is not root
asks the node agent, as a task's workload goes through it (docs/agent.md)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent

from cedana_airflow.agent.client import AgentClient
from cedana_airflow.agent.route import through_agent
from cedana_airflow.airflow.config import default_deferrable, task_settings
from cedana_airflow.airflow_compat import AirflowException, AirflowFailException
from cedana_airflow.hooks.store import task_store
from cedana_airflow.errors import AgentUnavailable, CedanaError, CheckpointIdError, ConfigError
from cedana_airflow.ids import validate_checkpoint_id
from cedana_airflow.store import FileStore
from cedana_airflow.store.transfer import load_manifests

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["CheckpointSensor", "CheckpointTrigger", "fresh_checkpoint"]

log = logging.getLogger(__name__)


def fresh_checkpoint(checkpoint_id: str, max_age_seconds: float | None, store: str | None,
                     aws_conn_id: str | None) -> dict[str, Any] | None:
    """The newest complete checkpoint of an ID (restore order) if it is young enough, else None. Where
    this process is not root (``[cedana] agent``: agent/route.py) and the sensor names no store of its own,
    the node agent answers: it holds the store and the key, and tells a caller only of its own uid's
    checkpoints (agent/views.py); where none answers and ``agent = auto``, the sensor reads the store itself,
    as it did before 0.8.4."""
    overrides = {"store": store, "aws_conn_id": aws_conn_id}
    settings, options = task_settings(overrides)
    cid = validate_checkpoint_id(checkpoint_id)
    if through_agent(settings) and not (store or aws_conn_id):  # a store the DAG names is read as before
        try:
            with AgentClient.connect(settings.agent_socket) as agent:
                rows = agent.checkpoints([cid])
        except AgentUnavailable as e:
            if settings.agent != "auto":
                raise
            log.info("cedana: %s; the sensor reads the store itself", e)  # as before 0.8.4
        else:
            if not rows:
                return None
            row = rows[0]
            return _young_enough(row["id"], row["seq"], row["try_number"], row["node"],
                                 datetime.fromisoformat(row["created_at"]), row["image_bytes"], max_age_seconds)
    s = task_store(settings, options.aws_conn_id)
    if isinstance(s, FileStore) and not s.root.exists():
        return None  # a file store appears with its first checkpoint; a sensor may start before that
    s.open(create=False, chunk_avg_bytes=settings.chunk_avg_bytes)
    found = load_manifests(s, cid)
    if not found:
        return None
    m = found[0]
    return _young_enough(m.checkpoint_id, m.seq, m.try_number, m.node, m.created_at, m.image_bytes, max_age_seconds)


def _young_enough(cid: str, seq: int, try_number: int, node: str, created_at: datetime, image_bytes: int,
                  max_age_seconds: float | None) -> dict[str, Any] | None:
    age = (datetime.now(timezone.utc) - created_at).total_seconds()
    if max_age_seconds is not None and age > max_age_seconds:
        return None
    return {"checkpoint_id": cid, "seq": seq, "try_number": try_number, "node": node,
            "created_at": created_at.isoformat(), "age_seconds": round(age, 1), "image_bytes": image_bytes}


class CheckpointTrigger(BaseTrigger):
    """Runs in the triggerer: checks the store every ``poll_seconds`` (in a thread: boto3 is blocking)."""

    def __init__(self, checkpoint_id: str, max_age_seconds: float | None, store: str | None, aws_conn_id: str | None,
                 poll_seconds: float = 30.0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # Airflow's BaseTrigger is not annotated
        self.checkpoint_id, self.max_age_seconds = checkpoint_id, max_age_seconds
        self.store, self.aws_conn_id, self.poll_seconds = store, aws_conn_id, poll_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"checkpoint_id": self.checkpoint_id, "max_age_seconds": self.max_age_seconds, "store": self.store,
                 "aws_conn_id": self.aws_conn_id, "poll_seconds": self.poll_seconds})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            try:
                found = await asyncio.to_thread(fresh_checkpoint, self.checkpoint_id, self.max_age_seconds,
                                                self.store, self.aws_conn_id)
            except CedanaError as e:
                yield TriggerEvent({"status": "error", "message": str(e)})  # type: ignore[no-untyped-call]
                return
            if found:
                yield TriggerEvent({"status": "found", "checkpoint": found})  # type: ignore[no-untyped-call]
                return
            await asyncio.sleep(self.poll_seconds)


class CheckpointSensor(BaseSensorOperator):
    """Wait until ``checkpoint_id`` has a complete checkpoint no older than ``max_age``.

    Pushes the checkpoint's summary (seq, node, created_at, age) as the sensor's XCom.

    :param checkpoint_id: templated; e.g. ``{{ macros.cedana.checkpoint_id(ti, run_id, 'train') }}``.
    :param max_age: how fresh the checkpoint must be (default: any age).
    :param store: / :param aws_conn_id: as for CheckpointedCommandOperator (default: [cedana]).
    :param deferrable: wait in the triggerer instead of holding a worker slot (default: Airflow's
        ``[operators] default_deferrable``).
    """

    template_fields: Sequence[str] = ("checkpoint_id", "store")

    def __init__(self, *, checkpoint_id: str, max_age: timedelta | None = None, store: str | None = None,
                 aws_conn_id: str | None = None, deferrable: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint_id, self.max_age, self.store = checkpoint_id, max_age, store
        self.aws_conn_id, self.deferrable = aws_conn_id, default_deferrable(deferrable)

    @property
    def _max_age_seconds(self) -> float | None:
        return self.max_age.total_seconds() if self.max_age is not None else None

    def _check(self) -> dict[str, Any] | None:
        try:
            return fresh_checkpoint(self.checkpoint_id, self._max_age_seconds, self.store, self.aws_conn_id)
        except (ConfigError, CheckpointIdError) as e:
            raise AirflowFailException(f"cedana: {e}") from None  # waiting longer would not help
        except CedanaError as e:
            raise AirflowException(f"cedana: {e}") from None

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        found = self._check()  # already there: no need to defer at all
        if found:
            return found
        self.defer(trigger=CheckpointTrigger(self.checkpoint_id, self._max_age_seconds, self.store, self.aws_conn_id,
                                             poll_seconds=self.poke_interval),
                   method_name="execute_complete", timeout=timedelta(seconds=self.timeout))

    def poke(self, context: Context) -> Any:
        from airflow.sdk import PokeReturnValue

        found = self._check()
        if not found:
            self.log.info("cedana: no complete checkpoint of %s%s yet", self.checkpoint_id,
                          f" newer than {self.max_age}" if self.max_age else "")
        return PokeReturnValue(is_done=bool(found), xcom_value=found)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        if event.get("status") != "found":
            raise AirflowException(f"cedana: {event.get('message', event)}")
        return event["checkpoint"]
