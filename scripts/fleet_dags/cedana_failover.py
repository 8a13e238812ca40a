"""The failover scenario's DAGs (scripts/demo_fleet.py, tests/integration/test_fleet_failover.py): a
checkpointed training-style task with a retry, on whichever Celery worker takes it. `cedana_failover`
checkpoints every second; `cedana_failover_late` only after a minute, to lose a node before any
checkpoint exists."""

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

TRAIN = str(Path(__file__).resolve().parents[2] / "tests" / "workloads" / "train.py")
ARGS = os.environ.get("CEDANA_FLEET_TRAIN_ARGS", "--mb 40 --steps 150 --step-seconds 0.1").split()

for dag_id, heartbeat in (("cedana_failover", 1), ("cedana_failover_late", 60)):
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(task_id="train", command=[sys.executable, TRAIN, *ARGS],
                                    heartbeat=timedelta(seconds=heartbeat))
