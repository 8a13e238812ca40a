"""heartbeat = "auto" through Airflow (tests/integration/test_airflow_torch.py): a training task on its own
queue, killed twice; each try chooses its interval from what it measured and what Airflow's history of the
queue says. Defined only when the test names its directory."""

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from cedana_airflow.operators import CheckpointedCommandOperator

ROOT = os.environ.get("CEDANA_E2E_AUTO_ROOT")
WORKLOADS = Path(__file__).resolve().parent.parent / "workloads"
ARGS = ["--mb", "40", "--steps", "120", "--step-seconds", "0.1"]

if ROOT:
    with DAG("cedana_auto", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             default_args={"retries": 2, "retry_delay": timedelta(seconds=1)}):
        CheckpointedCommandOperator(
            task_id="train", queue="auto_gpu", heartbeat="auto", heartbeat_min=timedelta(seconds=1),
            heartbeat_max=timedelta(seconds=4), settings={"keep_checkpoints": 50},
            command=[sys.executable, str(WORKLOADS / "train.py"), *ARGS],
        )
