"""The running tasks a live drill chooses among (tests/integration/test_live_drill.py): one eligible
(checkpointed, a retry left), one checkpointed without retries, one not checkpointed."""

import os
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, task

from cedana_airflow.operators import CheckpointedCommandOperator

TRAIN = str(Path(__file__).resolve().parent.parent / "workloads" / "train.py")
ARGS = os.environ["CEDANA_LIVE_TRAIN_ARGS"].split()

with DAG("live_target", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retry_delay": timedelta(seconds=1)}):
    CheckpointedCommandOperator(task_id="train", command=[sys.executable, TRAIN, *ARGS], heartbeat=timedelta(seconds=1),
                                retries=1)
    CheckpointedCommandOperator(task_id="no_retries", command=[sys.executable, TRAIN, *ARGS],
                                heartbeat=timedelta(seconds=3), retries=0)

    @task(task_id="plain", retries=1)
    def plain() -> None:
        time.sleep(float(os.environ.get("CEDANA_LIVE_PLAIN_SECONDS", "120")))

    plain()
