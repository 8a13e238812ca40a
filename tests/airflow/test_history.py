"""How a try ended, as Airflow recorded it (airflow/history.py): node losses, kills and stops count as
failures, the workload's own errors and a person's state changes do not; a history that cannot be read
never fails a task. The whole path against a real api-server: tests/integration/test_airflow_torch.py."""

from __future__ import annotations

import logging

import pytest

from cedana_airflow.airflow.history import INFRASTRUCTURE, AirflowHistory, _ends_from, classify


@pytest.mark.parametrize("state, events, ended, ending", [
    ("up_for_retry", {"running", "heartbeat timeout"}, None, "node-loss"),  # the scheduler's word for a lost node
    ("failed", {"running", "state mismatch"}, None, "killed"),  # the executor saw the process gone
    ("up_for_retry", {"running", "up_for_retry"}, "killed SIGKILL", "killed"),  # the OOM killer, an Xid's kill
    ("up_for_retry", {"running", "up_for_retry"}, "stopped SIGTERM", "stopped"),  # a drain, a preemption
    ("up_for_retry", {"running", "up_for_retry"}, "exited 3", "workload"),  # its own code
    ("failed", {"running", "failed"}, None, "workload"),  # any task that reported its own failure
    ("failed", {"running", "patch_task_instance", "failed"}, "stopped SIGTERM", "user"),  # mark-failed (a drill too)
    ("up_for_retry", {"running"}, None, "lost"),  # failed, and nothing said how
    ("success", {"running", "success"}, None, "success"),
    ("running", {"running"}, None, "running"),
    # a heartbeat timeout wins over what the task may have managed to say
    ("up_for_retry", {"running", "up_for_retry", "heartbeat timeout"}, "exited 1", "node-loss"),
])
def test_a_try_is_classified_by_what_airflow_recorded(state, events, ended, ending) -> None:
    assert classify(state, events, ended) == ending


def test_only_what_is_not_the_workloads_doing_counts() -> None:
    assert INFRASTRUCTURE == {"node-loss", "killed", "stopped", "lost"}


def test_a_tries_run_time_is_its_duration_else_its_dates_and_never_the_time_since_an_old_start() -> None:
    from datetime import datetime, timezone

    from cedana_airflow.airflow.history import _try_of

    now = datetime(2026, 12, 3, 12, tzinfo=timezone.utc)
    base = {"dag_id": "d", "task_id": "t", "dag_run_id": "r", "try_number": 1}
    assert _try_of({**base, "state": "failed", "duration": 42.0}, now).seconds == 42.0
    assert _try_of({**base, "state": "failed", "start_date": "2026-11-20T00:00:00Z",
                    "end_date": "2026-11-20T00:10:00Z"}, now).seconds == 600
    assert _try_of({**base, "state": "failed", "start_date": "2026-11-20T00:00:00Z"}, now).seconds == 0
    assert _try_of({**base, "state": "running", "start_date": "2026-12-03T11:00:00Z"}, now).seconds == 3600
    assert _try_of({**base, "state": "up_for_retry"}, now).seconds == 0


def test_the_recorded_ends_are_read_from_the_operators_task_state_record() -> None:
    record = {"checkpoint_id": "x", "tries": [{"try_number": 1, "node": "a", "ended": "killed SIGKILL"},
                                               {"try_number": 2, "node": "b"}, "junk", {"ended": "exited 0"}]}
    assert _ends_from(record) == {1: "killed SIGKILL"}
    assert _ends_from(None) == {} and _ends_from(["not", "a", "record"]) == {}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_history_that_cannot_be_read_is_said_once_and_never_raised(monkeypatch) -> None:
    pytest.importorskip("airflow")
    monkeypatch.setenv("AIRFLOW__CEDANA__HISTORY_API_URL", "http://127.0.0.1:1")  # nothing listens there
    log, said = logging.getLogger("test-history"), _Lines()
    log.addHandler(said)
    h = AirflowHistory(log)
    got = h.failures("gpu", "default_pool")
    seconds, why = h.duration("dag", "task")
    assert got.failures == 0 and got.scope == "queue gpu" and got.note.startswith("history not read: Airflow API at "
                                                                                 "http://127.0.0.1:1 cannot be reached")
    assert seconds is None and "Airflow's history cannot be read" in why
    assert sum("Airflow's history cannot be read" in line for line in said.lines) == 1, said.lines
