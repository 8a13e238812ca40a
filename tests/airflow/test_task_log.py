"""The task log as a reader filters it: every line we write there starts with `cedana` (airflow/logsink.py)."""

from __future__ import annotations

import logging

import pytest

from cedana_airflow.airflow.logsink import prefixed


class _Operator:
    def __init__(self) -> None:
        self.raised = False

    @prefixed
    def execute(self, fail: bool = False) -> str:
        logging.getLogger("cedana_airflow.run.runner").info("workload started checkpoint_id=%s", "x")
        logging.getLogger("cedana_airflow.agent.route").info("cedana: already ours")
        logging.getLogger("airflow.task").info("Airflow's own line")
        logging.getLogger("cedana_airflowx").info("a package that only starts with our name")
        assert logging.makeLogRecord({"name": "cedana_airflow.x", "msg": "rebuilt"}).msg == "rebuilt"  # filled in after
        if fail:
            raise RuntimeError("the task failed")
        return "done"


def test_the_core_s_lines_carry_the_prefix_while_a_task_runs_and_not_after(caplog):
    caplog.set_level(logging.INFO)
    assert _Operator().execute() == "done"
    assert [r.getMessage() for r in caplog.records] == [
        "cedana: workload started checkpoint_id=x", "cedana: already ours", "Airflow's own line",
        "a package that only starts with our name"]
    caplog.clear()
    with pytest.raises(RuntimeError):
        _Operator().execute(fail=True)
    logging.getLogger("cedana_airflow.run.runner").info("after the task")  # the process's factory is back
    assert caplog.records[0].getMessage().startswith("cedana: ") and caplog.records[-1].getMessage() == "after the task"


def test_executes_that_overlap_leave_no_prefix_behind(caplog):
    """Two executes in one process that end in the order they started (a threaded harness): the prefix holds
    while either runs, and is gone after both."""
    import threading

    caplog.set_level(logging.INFO)
    started, release = threading.Event(), threading.Event()

    @prefixed
    def first() -> None:
        started.set()
        release.wait(10)

    t = threading.Thread(target=first)
    t.start()
    started.wait(10)
    _Operator().execute()  # starts second, ends first
    logging.getLogger("cedana_airflow.run.runner").info("while the first still runs")
    release.set()
    t.join(10)
    logging.getLogger("cedana_airflow.run.runner").info("after both")
    said = [r.getMessage() for r in caplog.records]
    assert "cedana: while the first still runs" in said and said[-1] == "after both", said
