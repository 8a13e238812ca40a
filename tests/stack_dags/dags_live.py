"""The live drill under a real scheduler (tests/integration/test_live_drill.py), as factories: each test calls
them with its own DAG IDs, store, work dir and opt-in list, on the test run's shared Airflow stack
(tests/shared_stack.py). The drill sees the stack's every running task; it may choose only those with a
checkpoint in its store, which is this test's alone."""

import os
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Param, get_current_context, task

from nobody import nobody_task

from cedana_airflow.airflow.drills import run_drill
from cedana_airflow.operators import CheckpointedCommandOperator

TRAIN = str(Path(__file__).resolve().parent.parent / "workloads" / "train.py")


def target_dag(dag_id: str, *, store: str, work_dir: str, train_args: list[str], plain_seconds: float = 120,
               agent: dict[str, str] | None = None) -> None:
    """The running tasks a live drill chooses among: one eligible (checkpointed, a retry left), one
    checkpointed without retries, one not checkpointed. ``agent``: they run as nobody through it."""
    user, settings = nobody_task(agent)
    here = {"store": store, "settings": {"work_dir": work_dir, **settings}, **user}
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(task_id="train", command=[sys.executable, TRAIN, *train_args],
                                    heartbeat=timedelta(seconds=1), retries=1, **here)
        CheckpointedCommandOperator(task_id="no_retries", command=[sys.executable, TRAIN, *train_args],
                                    heartbeat=timedelta(seconds=3), retries=0, **here)

        @task(task_id="plain", retries=1, **user)
        def plain() -> None:
            time.sleep(plain_seconds)

        plain()


def drill_dag(dag_id: str, *, settings: dict, agent: dict[str, str] | None = None) -> None:
    """The cedana_fleet_drill DAG's live task alone (the same call, with the test's store and opt-in list), so
    the test does not also run a canary and a verify drill. ``agent``: it runs as nobody, asking that agent."""
    user, more = nobody_task(agent)
    settings = {**settings, **more}
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False, default_args={"retries": 0},
             params={"live_dry_run": Param(False, type="boolean")}):

        @task(task_id="live", **user)
        def live() -> dict:
            report = run_drill("live", dry_run=bool(get_current_context()["params"]["live_dry_run"]), poll=0.5,
                               settings=settings)
            return {**report, "ran_as_uid": os.geteuid()}  # the test checks who ran it

        live()
