"""The ``live`` drill: fail a real, running, checkpointed task on purpose and follow its retry.

The most real drill and the only disruptive one, so it acts only inside the operator's limits
(``[drills]`` of the opt-in list, scope/optin.py: off unless ``live = true``; at most N tasks per drill,
per DAG and per pool; only inside its time windows; never a task without a retry left or whose latest
checkpoint is older than a bound) and checks its kill switch before each action. A dry run says what
it would have done and touches nothing.

The drill acts through a :class:`~.fleet.Fleet` (Airflow's REST API, airflow/live_fleet.py): it fails
the try (Airflow stops the task; our operator takes a final checkpoint on the way out), waits until
the try's supervisor has let go of the checkpoint ID (its writer lease), clears the task as the UI's
Clear does, and follows the new try (follow.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from datetime import datetime

from ..format.manifest import AirflowTask
from ..scope.optin import Drills
from ..scope.windows import in_any_window
from .facts import UNREADABLE, Facts, Latest
from .fleet import Fleet, RunningTask, utc, wait
from .follow import follow_retry, seen_failed
from .report import DrillReport, LiveTarget, new_drill_id

__all__ = ["choose", "live"]

_SETTLE_SECONDS = 60.0  # at most, for Airflow to stop the failed try (SIGTERM, final checkpoint, SIGKILL 5 s later)


def _why_not(task: RunningTask, latest: Latest | None, limits: Drills, at: datetime) -> str:
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


def _unverified(facts: Facts, latest: Latest, task: RunningTask) -> str:
    """Why the listing's latest checkpoint of ``task`` is not one this node would restore for it, or "".
    The listing is the store's word: a drill fails a real try only on a checkpoint the key vouches for."""
    owner = AirflowTask(dag_id=task.dag_id, task_id=task.task_id, run_id=task.run_id, map_index=task.map_index)
    why = facts.refusal(latest, owner)
    return f"its latest checkpoint (seq {latest.seq}) is not one this node would restore: {why}" if why else ""


def choose(tasks: Sequence[RunningTask], facts: Facts, limits: Drills, at: datetime,
           seed: int | None = None) -> list[tuple[RunningTask, LiveTarget]]:
    """Every running task with the verdict on it: eligible ones in a random order (no task is always
    first), chosen until a blast-radius limit is reached; each passed-over one says why. ``facts``
    judge with this node's key the checkpoint a chosen task would resume from."""
    latest = facts.latest_by_task()
    verdicts = [(t, _why_not(t, latest.get(t.key()), limits, at)) for t in tasks]
    verdicts = [(t, why or _unverified(facts, latest[t.key()], t)) for t, why in verdicts]
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


def _drill_one(facts: Facts, fleet: Fleet, limits: Drills, task: RunningTask, target: LiveTarget, drill_id: str,
               poll: float) -> LiveTarget:
    cid = target.checkpoint_id
    assert cid is not None  # chosen targets are checkpointed
    now = fleet.now(task)
    if now.state != "running" or now.try_number != task.try_number:
        return target.model_copy(update={"chosen": False, "reason": f"not failed: it is now {now.state} "
                                         f"(try {now.try_number}), no longer the running try the drill chose"})
    failed_at, t0 = utc(), time.monotonic()
    fleet.fail_try(task, f"cedana live drill {drill_id}: try {task.try_number} failed on purpose; the drill "
                         f"clears it to resume from checkpoint ID {cid}")
    fields: dict[str, object] = {"detect_seconds": seen_failed(fleet, task, t0, t0 + _SETTLE_SECONDS, poll)}

    def lease_gone() -> bool | None:
        """The failed try's supervisor has stopped (its final checkpoint, if any, is in): it released
        its writer lease, or stopped renewing it (Airflow SIGKILLs a task 5 s after SIGTERM)."""
        rec = facts.lease(cid)
        if rec is None or rec is UNREADABLE or rec.try_number != task.try_number:  # unreadable: protects nobody
            return True
        return True if time.time() - rec.renewed_at > rec.ttl_seconds / 3 + 5 else None

    wait(lease_gone, time.monotonic() + _SETTLE_SECONDS, poll)  # else the retry's lease takes over from it
    fleet.clear(task)
    fields.update(follow_retry(facts, fleet, task, cid, failed_at, t0 + limits.follow_seconds, poll))
    problem = str(fields.pop("problem"))
    return target.model_copy(update={**fields, "ok": not problem, "problem": problem})


def live(facts: Facts, fleet: Fleet, limits: Drills, *, node: str, dry_run: bool = False, seed: int | None = None,
         poll: float = 1.0) -> DrillReport:
    started = utc()
    drill_id = new_drill_id("live", started)

    def report(ok: bool, problems: Sequence[str] = (), **fields: object) -> DrillReport:
        return DrillReport(drill_id=drill_id, mode="live", ok=ok, problems=tuple(problems), node=node,
                           started_at=started, finished_at=utc(), dry_run=dry_run, **fields)  # type: ignore[arg-type]

    if not limits.live:
        return report(True, stopped="live drills are off: set live = true under [drills] in the opt-in list")
    if why := fleet.stop_reason():
        return report(True, stopped=why)
    if not in_any_window(limits.parsed_windows(), started):
        return report(True, stopped=f"outside the drill windows {list(limits.windows)} (UTC)")
    running = fleet.running_tasks()
    verdicts = choose(running, facts, limits, utc(), seed)
    if dry_run or not any(t.chosen for _, t in verdicts):
        return report(True, targets=tuple(t for _, t in verdicts),
                      stopped="" if dry_run else f"no running task is eligible ({len(verdicts)} running)")
    done: list[LiveTarget] = []
    stop = ""
    for task, target in verdicts:
        if target.chosen and not stop and (stop := fleet.stop_reason() or ""):
            target = target.model_copy(update={"chosen": False, "reason": f"not failed: {stop}"})
        elif target.chosen and not stop:
            target = _drill_one(facts, fleet, limits, task, target, drill_id, poll)
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
