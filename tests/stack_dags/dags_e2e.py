"""The Clear and the stop through a real scheduler (tests/integration/test_airflow_e2e.py), as factories: each
test calls one with its own DAG ID, store and work dir, on the test run's shared Airflow stack
(tests/shared_stack.py)."""

import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator
from nobody import nobody_task

TRAIN = str(Path(__file__).resolve().parent.parent / "workloads" / "train.py")


def clear_dag(dag_id: str, *, store: str, work_dir: str, train_args: list[str], heartbeat: float = 1.0,
              agent: dict[str, str] | None = None) -> None:
    """No automatic retry: the test fails the task and then clears it through the REST API, as the UI's Clear does.
    ``agent``: the task runs as nobody, through that node agent (its store is the agent's, not ``store``)."""
    user, settings = nobody_task(agent)
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False, default_args={"retries": 0}):
        CheckpointedCommandOperator(
            task_id="train",
            command=[sys.executable, TRAIN, *train_args],
            heartbeat=timedelta(seconds=heartbeat),
            store=store,
            settings={"work_dir": work_dir, **settings},
            **user,
        )
