"""The ``live`` drill: fail a real, running, checkpointed task on purpose and follow its retry.

The most real drill and the only disruptive one, so it acts only inside the operator's limits
(``[drills]`` of the opt-in list, scope/optin.py: off unless ``live = true``; at most N tasks per drill,
per DAG and per pool; only inside its time windows; never a task without a retry left or whose latest
checkpoint is older than a bound) and checks its kill switch before each action. A dry run says what
it would have done and touches nothing.

The core does not know Airflow: a :class:`Fleet` (the Airflow side implements it over Airflow's REST
API, airflow/live_fleet.py) lists running tasks, fails a try, clears it and reports its state and log.
The drill fails the try (Airflow stops the task; our operator takes a final checkpoint on the way
out), waits until the try's supervisor has let go of the checkpoint ID (its writer lease), clears the
task as the UI's Clear does, and follows the new try: when it started, what it restored (the store's
restore record), its first workload output after the restore, and how it ended.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from ..scope.optin import Drills
from ..scope.windows import in_any_window
from ..store.base import Store
from ..store.listing import list_store
from ..store.restores import RestoreRecord, list_restores
from ..store.transfer import load_manifests
from ..store.writer_lease import LeaseRecord, lease_key
from .report import DrillReport, LiveTarget, new_drill_id

__all__ = ["Fleet", "RunningTask", "TaskNow", "choose", "live"]

#: Airflow states after which a try no longer runs.
FINISHED = frozenset({"success", "failed", "upstream_failed", "skipped", "removed"})
_SETTLE_SECONDS = 60.0  # at most, for Airflow to stop the failed try (SIGTERM, final checkpoint, SIGKILL 5 s later)


class RunningTask(BaseModel):
    """A running task instance as the fleet lists it."""

    model_config = ConfigDict(frozen=True)

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1
    try_number: int
    max_tries: int  # the retries it was given (Airflow's max_tries): the last try is max_tries + 1
    pool: str = ""
    queue: str = ""
    hostname: str = ""

    def key(self) -> tuple[str, str, str, int]:
        return self.dag_id, self.task_id, self.run_id, self.map_index

    def name(self) -> str:
        return f"{self.dag_id}.{self.task_id}" + (f"[{self.map_index}]" if self.map_index >= 0 else "") + f" ({self.run_id})"


class TaskNow(BaseModel):
    """A task instance's current try, as the fleet reports it."""

    model_config = ConfigDict(frozen=True)

    state: str | None
    try_number: int
    start_date: datetime | None = None


class Fleet(Protocol):
    def stop_reason(self) -> str | None:
        """Why live drills must stop now (a kill switch is on), or None."""

    def running_tasks(self) -> list[RunningTask]: ...

    def fail_try(self, task: RunningTask, note: str) -> None: ...

    def clear(self, task: RunningTask) -> None:
        """What the UI's Clear does: a new try of the (failed) task."""

    def now(self, task: RunningTask) -> TaskNow: ...

    def output(self, task: RunningTask, try_number: int) -> list[tuple[datetime, str]]:
        """The try's task log lines written by the task itself (the workload's output and ours), timed."""


@dataclass(frozen=True)
class _Latest:
    checkpoint_id: str
    seq: int
    created_at: datetime


def _latest_by_task(store: Store) -> dict[tuple[str, str, str, int], _Latest]:
    """The newest complete checkpoint of each task instance the store knows (its manifests name it)."""
    out: dict[tuple[str, str, str, int], _Latest] = {}
    for x in list_store(store):
        if x.airflow is None or not x.checkpoints:
            continue
        a, row = x.airflow, x.checkpoints[-1]
        key = (a.dag_id, a.task_id, a.run_id, a.map_index)
        if key not in out or out[key].created_at < row.created_at:
            out[key] = _Latest(x.checkpoint_id, row.seq, row.created_at)
    return out


def _why_not(task: RunningTask, latest: _Latest | None, limits: Drills, at: datetime) -> str:
    if latest is None:
        return "not checkpointed: no checkpoint in the store names this task instance"
    if task.max_tries <= 0:
        return "no retries (retries=0): a live drill never fails a task that cannot retry"
    if task.try_number > task.max_tries:
        return f"no retry left: this is try {task.try_number} of {task.max_tries + 1}"
    age = (at - latest.created_at).total_seconds()
    if age > limits.max_checkpoint_age_seconds:
        return (f"latest checkpoint (seq {latest.seq}) is {age:.0f} s old, above max_checkpoint_age_seconds "
                f"{limits.max_checkpoint_age_seconds:.0f}: too much work would be lost")
    return ""


def choose(tasks: Sequence[RunningTask], store: Store, limits: Drills, at: datetime,
           seed: int | None = None) -> list[tuple[RunningTask, LiveTarget]]:
    """Every running task with the verdict on it: eligible ones in a random order (no task is always
    first), chosen until a blast-radius limit is reached; each passed-over one says why."""
    latest = _latest_by_task(store)
    verdicts = [(t, _why_not(t, latest.get(t.key()), limits, at)) for t in tasks]
    eligible = [t for t, why in verdicts if not why]
    random.Random(seed).shuffle(eligible)
    chosen: list[RunningTask] = []
    out: list[tuple[RunningTask, LiveTarget]] = []

    def target(t: RunningTask, ok: bool, reason: str) -> tuple[RunningTask, LiveTarget]:
        cp = latest.get(t.key())
        return t, LiveTarget(dag_id=t.dag_id, task_id=t.task_id, run_id=t.run_id, map_index=t.map_index,
                             try_number=t.try_number, pool=t.pool, checkpoint_id=cp.checkpoint_id if cp else None,
                             chosen=ok, reason=reason)

    for t in eligible:
        age = (at - latest[t.key()].created_at).total_seconds()
        limit = next((f"limit reached: max_{name} = {n}" for name, n, same in (
            ("per_run", limits.max_per_run, chosen),
            ("per_dag", limits.max_per_dag, [c for c in chosen if c.dag_id == t.dag_id]),
            ("per_pool", limits.max_per_pool, [c for c in chosen if c.pool == t.pool])) if len(same) >= n), "")
        if limit:
            out.append(target(t, False, f"eligible, but {limit}"))
        else:
            chosen.append(t)
            out.append(target(t, True, f"eligible: try {t.try_number} of {t.max_tries + 1}, "
                                       f"latest checkpoint {age:.0f} s old"))
    out += [target(t, False, why) for t, why in verdicts if why]
    return out


T = TypeVar("T")


def _wait(what: Callable[[], T | None], until: float, poll: float) -> T | None:
    """Call ``what`` until it returns something (not None) or the monotonic deadline passes."""
    while True:
        got = what()
        if got is not None or time.monotonic() >= until:
            return got
        time.sleep(poll)


def _utc() -> datetime:
    return datetime.now(timezone.utc)


def _drill_one(store: Store, fleet: Fleet, limits: Drills, task: RunningTask, target: LiveTarget, drill_id: str,
               poll: float) -> LiveTarget:
    cid = target.checkpoint_id
    assert cid is not None  # chosen targets are checkpointed
    now = fleet.now(task)
    if now.state != "running" or now.try_number != task.try_number:
        return target.model_copy(update={"chosen": False, "reason": f"not failed: it is now {now.state} "
                                         f"(try {now.try_number}), no longer the running try the drill chose"})
    failed_at, t0 = _utc(), time.monotonic()
    fleet.fail_try(task, f"cedana live drill {drill_id}: try {task.try_number} failed on purpose; the drill "
                         f"clears it to resume from checkpoint ID {cid}")
    fields: dict[str, object] = {}
    seen = _wait(lambda: True if fleet.now(task).state in FINISHED else None, t0 + _SETTLE_SECONDS, poll)
    if seen:
        fields["detect_seconds"] = round(time.monotonic() - t0, 3)

    def lease_gone() -> bool | None:
        """The failed try's supervisor has stopped (its final checkpoint, if any, is in): it released
        its writer lease, or stopped renewing it (Airflow SIGKILLs a task 5 s after SIGTERM)."""
        raw = store.get(lease_key(cid))
        try:
            rec = LeaseRecord.model_validate_json(raw) if raw is not None else None
        except ValueError:
            return True  # unreadable: it protects nobody, the retry replaces it
        if rec is None or rec.try_number != task.try_number:
            return True
        return True if time.time() - rec.renewed_at > rec.ttl_seconds / 3 + 5 else None

    _wait(lease_gone, time.monotonic() + _SETTLE_SECONDS, poll)  # else the retry's lease takes over from it
    fleet.clear(task)
    until = t0 + limits.follow_seconds

    def retry_started() -> TaskNow | None:
        n = fleet.now(task)
        started = n.state == "running" or n.state in FINISHED
        return n if n.try_number > task.try_number and started and n.start_date is not None else None

    def finish(problem: str, **more: object) -> LiveTarget:
        return target.model_copy(update={**fields, **more, "ok": not problem, "problem": problem})

    retry = _wait(retry_started, until, poll)
    if retry is None:
        return finish(f"the cleared task did not start a new try within follow_seconds = {limits.follow_seconds:.0f}")
    assert retry.start_date is not None
    fields.update(retry_try_number=retry.try_number,
                  retry_seconds=round(max(0.0, (retry.start_date - failed_at).total_seconds()), 3))

    def restore_record() -> RestoreRecord | None:
        return next((r for r in list_restores(store, cid) if r.try_number == retry.try_number), None)

    def state() -> str:
        return fleet.now(task).state or ""

    rec = _wait(lambda: restore_record() or (None if state() not in FINISHED else False), until, poll)
    if not isinstance(rec, RestoreRecord):
        return finish(f"try {retry.try_number} wrote no restore record (it is {state() or 'not running'})",
                      retry_state=state())
    if rec.outcome != "restored":
        return finish(f"try {retry.try_number} started fresh instead of restoring: {rec.reason}", retry_state=state())
    restored = next((m for m in load_manifests(store, cid) if m.seq == rec.seq), None)
    fields.update(restored_seq=rec.seq, from_node=rec.from_node, to_node=rec.node, restore_seconds=rec.restore_seconds,
                  bytes_fetched=restored.image_bytes if restored else 0)
    if restored is not None:  # from the restored checkpoint to the failed try's last output (it may run
        # on a few seconds after it was failed, until Airflow stops it)
        last = [at for at, _ in fleet.output(task, task.try_number)]
        stopped_at = max(last) if last else failed_at
        fields["lost_work_seconds"] = round(max(0.0, (stopped_at - restored.created_at).total_seconds()), 3)
    resumed_at = rec.at.timestamp() + rec.restore_seconds

    def first_progress() -> datetime | None:
        return next((at for at, line in fleet.output(task, retry.try_number)
                     if at.timestamp() >= resumed_at and not line.startswith("cedana")), None)

    progress = _wait(lambda: first_progress() or (None if state() not in FINISHED else False), until, poll)
    if isinstance(progress, datetime):
        fields["rto_seconds"] = round((progress - failed_at).total_seconds(), 3)
    end = _wait(lambda: s if (s := state()) in FINISHED else None, until, poll) or state()
    if end in FINISHED and end != "success":
        return finish(f"try {retry.try_number} restored seq {rec.seq} and then ended {end}", retry_state=end)
    return finish("", retry_state=end)  # still running when follow_seconds ran out: it restored; Airflow follows the rest


def live(store: Store, fleet: Fleet, limits: Drills, *, node: str, dry_run: bool = False, seed: int | None = None,
         poll: float = 1.0) -> DrillReport:
    started = _utc()
    drill_id = new_drill_id("live", started)

    def report(ok: bool, problems: Sequence[str] = (), **fields: object) -> DrillReport:
        return DrillReport(drill_id=drill_id, mode="live", ok=ok, problems=tuple(problems), node=node,
                           started_at=started, finished_at=_utc(), dry_run=dry_run, **fields)  # type: ignore[arg-type]

    if not limits.live:
        return report(True, stopped="live drills are off: set live = true under [drills] in the opt-in list")
    if why := fleet.stop_reason():
        return report(True, stopped=why)
    if not in_any_window(limits.parsed_windows(), started):
        return report(True, stopped=f"outside the drill windows {list(limits.windows)} (UTC)")
    running = fleet.running_tasks()
    verdicts = choose(running, store, limits, _utc(), seed)
    if dry_run or not any(t.chosen for _, t in verdicts):
        return report(True, targets=tuple(t for _, t in verdicts),
                      stopped="" if dry_run else f"no running task is eligible ({len(verdicts)} running)")
    done: list[LiveTarget] = []
    stop = ""
    for task, target in verdicts:
        if target.chosen and not stop and (stop := fleet.stop_reason() or ""):
            target = target.model_copy(update={"chosen": False, "reason": f"not failed: {stop}"})
        elif target.chosen and not stop:
            target = _drill_one(store, fleet, limits, task, target, drill_id, poll)
        done.append(target)
    acted = [t for t in done if t.ok is not None]
    if not acted:
        return report(True, targets=tuple(done), stopped=stop or "every chosen task had stopped running")
    first = acted[0]
    return report(all(t.ok for t in acted), [f"{t.dag_id}.{t.task_id} ({t.run_id}): {t.problem}" for t in acted if not t.ok],
                  targets=tuple(done), checkpoint_id=first.checkpoint_id, restored_seq=first.restored_seq,
                  from_node=first.from_node, to_node=first.to_node, rto_seconds=first.rto_seconds,
                  lost_work_seconds=first.lost_work_seconds, restore_seconds=first.restore_seconds,
                  bytes_fetched=sum(t.bytes_fetched for t in acted), detect_seconds=first.detect_seconds,
                  retry_seconds=first.retry_seconds)
