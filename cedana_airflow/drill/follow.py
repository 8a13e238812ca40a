"""After a try failed (a live drill failed it, or its node died): measure what the recovery took.

From the fleet (Airflow: the task's tries and its log) and the store (manifests, restore records):
when Airflow showed the failure, when the next try started and where, what it restored, the work
lost (the restored checkpoint to the failed try's last output), the first output after the restore
(the end of the RTO), and how the new try ended. Wall-clock times from different machines are
compared, so the figures are as good as the fleet's clock sync (NTP: milliseconds).
"""

from __future__ import annotations

import time
from datetime import datetime

from ..store.restores import RestoreRecord
from .facts import Facts
from .fleet import FAILED, FINISHED, Fleet, RunningTask, TaskNow, wait

__all__ = ["follow_retry", "seen_failed"]


def seen_failed(fleet: Fleet, task: RunningTask, t0: float, until: float, poll: float) -> float | None:
    """Seconds from ``t0`` (monotonic) until Airflow shows ``task``'s try as failed; None: not by ``until``."""
    def failed() -> bool | None:
        n = fleet.now(task)
        return True if n.try_number > task.try_number or n.state in FAILED else None

    return round(time.monotonic() - t0, 3) if wait(failed, until, poll) else None


def follow_retry(facts: Facts, fleet: Fleet, task: RunningTask, checkpoint_id: str, failed_at: datetime, until: float,
                 poll: float) -> dict[str, object]:
    """Follow the try after ``task``'s until it ends or ``until`` (monotonic) passes. The figures use the
    names of drill/report.py's LiveTarget; ``problem`` is empty when the new try restored and did not fail."""
    fields: dict[str, object] = {"problem": ""}

    def state() -> str:
        return fleet.now(task).state or ""

    def done(problem: str = "", **more: object) -> dict[str, object]:
        fields.update(more, problem=problem)
        return fields

    def retry_started() -> TaskNow | None:
        n = fleet.now(task)
        started = n.state == "running" or n.state in FINISHED
        return n if n.try_number > task.try_number and started and n.start_date is not None else None

    retry = wait(retry_started, until, poll)
    if retry is None:
        return done("no new try started in time; the task is " + (state() or "not scheduled"))
    assert retry.start_date is not None
    fields.update(retry_try_number=retry.try_number, retry_host=retry.hostname,
                  retry_seconds=round(max(0.0, (retry.start_date - failed_at).total_seconds()), 3))

    def restore_record() -> RestoreRecord | None:
        return next((r for r in facts.restores(checkpoint_id) if r.try_number == retry.try_number), None)

    rec = wait(lambda: restore_record() or (None if state() not in FINISHED else False), until, poll)
    if not isinstance(rec, RestoreRecord):
        return done(f"try {retry.try_number} wrote no restore record (it is {state() or 'not running'})", retry_state=state())
    if rec.outcome != "restored":
        refused = "".join(f"; refused: {r}" for r in rec.refused)  # the cause a drill exists to find
        return done(f"try {retry.try_number} started fresh instead of restoring: {rec.reason}{refused}", retry_state=state(),
                    to_node=rec.node)
    restored = facts.checkpoint(checkpoint_id, rec.seq) if rec.seq is not None else None
    resumed_at = rec.at.timestamp() + rec.restore_seconds
    fields.update(restored_seq=rec.seq, from_node=rec.from_node, to_node=rec.node, restore_seconds=rec.restore_seconds,
                  restore_done_seconds=round(resumed_at - failed_at.timestamp(), 3),
                  bytes_fetched=restored.image_bytes if restored else 0)
    if restored is not None:  # a try failed through Airflow runs on a few seconds, until Airflow stops it
        last = [at for at, _ in fleet.output(task, task.try_number)]
        stopped_at = max(last) if last else failed_at
        fields["lost_work_seconds"] = round(max(0.0, (stopped_at - restored.created_at).total_seconds()), 3)

    def first_progress() -> datetime | None:
        return next((at for at, line in fleet.output(task, retry.try_number)
                     if at.timestamp() >= resumed_at and not line.startswith("cedana")), None)

    progress = wait(lambda: first_progress() or (None if state() not in FINISHED else False), until, poll)
    if isinstance(progress, datetime):
        fields["rto_seconds"] = round((progress - failed_at).total_seconds(), 3)
    end = wait(lambda: s if (s := state()) in FINISHED else None, until, poll) or state()
    if end in FINISHED and end != "success":
        return done(f"try {retry.try_number} restored seq {rec.seq} and then ended {end}", retry_state=end)
    return done(retry_state=end)  # still running when following stopped: it restored; Airflow follows the rest
